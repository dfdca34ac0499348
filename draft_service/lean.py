"""A lean forward pass for Llama-family drafts: the same weights, far less Python per token.

A small draft runs one token per forward pass, and at that size the cost of a Hugging Face forward is
mostly framework overhead (module calls, output dataclasses, mask construction), not arithmetic. This
module computes the same function directly over the model's own weight tensors, with a preallocated
KV cache whose rollback is moving a length, one matrix product for the query, key and value
projections (and one for the gate and up projections), queries and keys rotated together, and one
fused RMSNorm kernel in float32. At start-up `LeanDraft.attach` checks it against the model's own
forward pass and declines when they disagree, so an unfamiliar architecture falls back to the
ordinary path. Exactness never depends on it: the draft reports the rows it really sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.activations import ACT2FN

log = structlog.get_logger(__name__)

SUPPORTED = {"llama", "mistral", "qwen2"}
_GROWTH = 256  # cache capacity grows in steps of this many tokens


@dataclass
class LeanCache:
    """Keys and values of one session: [layers, 2, kv_heads, capacity, head_dim], plus a length."""

    data: torch.Tensor
    length: int = 0

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove tokens (the DynamicCache convention)."""
        self.length = max(0, self.length + min(0, tokens_to_remove))


def _fuse(*projections: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for projections of the same input, so a step runs one matrix product
    instead of several. The projections' own weights become views into it: nothing is stored twice,
    and the model's own forward computes what it did."""
    weight = torch.cat([p.weight.detach() for p in projections])  # [sum of out_features, in_features]
    bias = None  # [sum of out_features]; a projection without one contributes zeros
    if any(p.bias is not None for p in projections):
        bias = torch.cat([weight.new_zeros(p.out_features) if p.bias is None else p.bias.detach() for p in projections])
    start = 0
    for p in projections:
        rows = p.out_features
        p.weight.data = weight[start : start + rows]
        if bias is not None and p.bias is not None:
            p.bias.data = bias[start : start + rows]
        start += rows
    return weight, bias


class LeanDraft:
    """The lean forward over a loaded Llama-family model."""

    def __init__(self, model: PreTrainedModel) -> None:
        config = model.config
        self.model = model
        self.layers = model.model.layers
        self.rotary = model.model.rotary_emb
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scaling = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self.act = ACT2FN[config.hidden_act]
        self.max_context = config.max_position_embeddings
        first = model.get_input_embeddings().weight
        self.device, self.dtype = first.device, first.dtype
        # Per layer, (weight, bias) of the fused projections: query-key-value, weight
        # [(heads + 2 * kv_heads) * head_dim, hidden]; gate-up, weight [2 * intermediate, hidden].
        self.qkv = [
            _fuse(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj) for layer in self.layers
        ]
        self.gate_up = [_fuse(layer.mlp.gate_proj, layer.mlp.up_proj) for layer in self.layers]

    @classmethod
    def attach(cls, model: PreTrainedModel) -> LeanDraft | None:
        """A LeanDraft when the architecture is supported and matches the model's own forward."""
        config = model.config
        if config.model_type not in SUPPORTED:
            return None
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            return None
        if len({str(p.device) for p in model.parameters()}) > 1:
            return None  # spread over devices by device_map="auto": keep the model's own forward
        lean = cls(model)
        try:
            agree = lean.self_check()
        except (RuntimeError, AttributeError, TypeError) as exc:
            log.warning("lean_draft_unavailable", reason=str(exc))
            return None
        if not agree:
            log.warning("lean_draft_unavailable", reason="differs from the model's own forward")
            return None
        return lean

    def new_cache(self) -> LeanCache:
        shape = (len(self.layers), 2, self.num_kv_heads, _GROWTH, self.head_dim)
        return LeanCache(torch.empty(shape, dtype=self.dtype, device=self.device))

    def _reserve(self, cache: LeanCache, length: int) -> None:
        capacity = cache.data.shape[3]
        if length > capacity:
            grown = min(self.max_context, max(length, capacity * 2) + _GROWTH - 1) // _GROWTH * _GROWTH
            data = torch.empty(
                (*cache.data.shape[:3], max(grown, length), self.head_dim), dtype=self.dtype, device=self.device
            )
            data[:, :, :, : cache.length] = cache.data[:, :, :, : cache.length]
            cache.data = data

    def _rms_norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if hidden.dtype == torch.float32:
            return F.rms_norm(hidden, weight.shape, weight, self.eps)  # one kernel, the same arithmetic
        h = hidden.float()  # lower precisions: Hugging Face's exact order of operations
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(hidden.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(self, token_ids: list[int], cache: LeanCache) -> torch.Tensor:
        """Feed tokens after the cache's contents; the logits of the last one. [vocab]"""
        start, count = cache.length, len(token_ids)
        end = start + count
        self._reserve(cache, end)
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        hidden = self.model.model.embed_tokens(ids)  # [1, T, hidden]
        positions = torch.arange(start, end, device=self.device)[None]
        cos, sin = self.rotary(hidden, positions)  # [1, T, head_dim] each
        cos, sin = cos[:, None], sin[:, None]
        mask = None
        if count > 1:
            mask = torch.arange(end, device=self.device)[None] <= positions[0][:, None]  # [T, end]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        for index, layer in enumerate(self.layers):
            x = self._rms_norm(hidden, layer.input_layernorm.weight)
            qkv = F.linear(x, *self.qkv[index]).view(1, count, heads + 2 * kv_heads, self.head_dim).transpose(1, 2)
            qk = self._rotate(qkv[:, : heads + kv_heads], cos, sin)  # queries and keys rotate together
            cache.data[index, 0, :, start:end] = qk[0, heads:]
            cache.data[index, 1, :, start:end] = qkv[0, heads + kv_heads :]
            out = F.scaled_dot_product_attention(
                qk[:, :heads],
                cache.data[index, 0, :, :end][None],
                cache.data[index, 1, :, :end][None],
                attn_mask=mask,
                scale=self.scaling,
                enable_gqa=kv_heads != heads,
            )
            out = out.transpose(1, 2).reshape(1, count, heads * self.head_dim)
            attn = layer.self_attn
            hidden = hidden + F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
            x = self._rms_norm(hidden, layer.post_attention_layernorm.weight)
            gate, up = F.linear(x, *self.gate_up[index]).chunk(2, dim=-1)
            mlp = layer.mlp
            hidden = hidden + F.linear(self.act(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        cache.length = end
        last = self._rms_norm(hidden[:, -1], self.model.model.norm.weight)
        head = self.model.get_output_embeddings()
        return F.linear(last, head.weight, getattr(head, "bias", None))[0]

    @torch.inference_mode()
    def self_check(self, tolerance: float = 1e-3) -> bool:
        """Prefill, single steps and a rollback give the model's own logits (relative tolerance)."""
        generator = torch.Generator().manual_seed(0)
        vocab = self.model.get_output_embeddings().weight.shape[0]
        ids = torch.randint(0, vocab, (12,), generator=generator).tolist()
        reference = self.model(torch.tensor([ids], device=self.device)).logits[0].float()  # [12, vocab]
        cache = self.new_cache()
        rows = [self.forward(ids[:8], cache)]
        rows += [self.forward([token], cache) for token in ids[8:10]]
        cache.crop(-2)
        rows += [self.forward(ids[8:12], cache)]
        got = torch.stack(rows).float()
        want = reference[[7, 8, 9, 11]]
        scale = want.abs().max().clamp_min(1.0)
        return bool(((got - want).abs().max() / scale) < tolerance)
