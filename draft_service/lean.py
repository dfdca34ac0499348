"""A lean forward pass for Llama-family drafts: the same weights, far less Python per token.

A small draft runs one token per forward pass, and at that size the cost of a Hugging Face forward is
mostly framework overhead (module calls, output dataclasses, mask construction), not arithmetic. This
module computes the same function directly over the model's own weight tensors, for a batch of
sessions at once over the service's block store (model_host/kv_blocks.py, where rollback frees
the blocks past the kept length), with one matrix product for the query, key and value projections (and one for the
gate and up projections), queries and keys rotated together, and one fused RMSNorm kernel in float32.
At start-up `LeanDraft.attach` checks it against the model's own forward pass and declines when they
disagree, so an unfamiliar architecture falls back to the ordinary path. Exactness never depends on
it: the draft reports the rows it really sampled from.
"""

from __future__ import annotations

import structlog
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.activations import ACT2FN

from model_host.attention import FULL, SLIDING, AttentionLayout
from model_host.batch_view import BatchView
from model_host.forward import CHECK_ERRORS, PagedForward, RowLogits, disagreement, tolerance
from model_host.kv_blocks import BlockStore
from model_host.rows import Row

log = structlog.get_logger(__name__)

SUPPORTED = {"llama", "mistral", "qwen2"}
LAYER_TYPES = {FULL, SLIDING}


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


class LeanDraft(PagedForward):
    """The lean forward over a loaded Llama-family model, batched over sessions."""

    name = "lean"

    def __init__(self, model: PreTrainedModel, store: BlockStore) -> None:
        config = model.config
        self.model = model
        self.store = store
        self.device = store.device
        self.layout = AttentionLayout.of(config)  # each layer's mask: global or sliding window
        self.layers = model.model.layers
        self.rotary = model.model.rotary_emb
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scaling = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self.act = ACT2FN[config.hidden_act]
        # Per layer, (weight, bias) of the fused projections: query-key-value, weight
        # [(heads + 2 * kv_heads) * head_dim, hidden]; gate-up, weight [2 * intermediate, hidden].
        self.qkv = [
            _fuse(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj) for layer in self.layers
        ]
        self.gate_up = [_fuse(layer.mlp.gate_proj, layer.mlp.up_proj) for layer in self.layers]

    @classmethod
    def attach(cls, model: PreTrainedModel, store: BlockStore, prefill_chunk: int = 512) -> LeanDraft | None:
        """A LeanDraft when the architecture is supported and matches the model's own forward (the
        start-up check of model_host/forward.py, past the model's windows where it has them)."""
        config = model.config
        if config.model_type not in SUPPORTED:
            return None
        if len({str(p.device) for p in model.parameters()}) > 1:
            return None  # spread over devices by device_map="auto": keep the model's own forward
        layout = AttentionLayout.of(config)
        if not {layer.layer_type for layer in layout.layers} <= LAYER_TYPES:
            log.warning("lean_draft_unavailable", reason=f"attention: {layout.describe()}")
            return None  # before fusing the model's projections for a forward that will not run
        lean = cls(model, store)
        try:
            error = disagreement(lean, model, lean.layout, store.max_context, prefill_chunk)
        except CHECK_ERRORS as exc:
            log.warning("lean_draft_unavailable", reason=f"{type(exc).__name__}: {exc}")
            return None
        if error >= tolerance(store.dtype):
            log.warning(
                "lean_draft_unavailable",
                reason=f"differs from the model's own forward by {error:.2g} of the largest logit",
                attention=lean.layout.describe(),
            )
            return None
        return lean

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

    def __call__(self, rows: list[Row]) -> RowLogits:
        """Feed each row's tokens after its cached ones; the logits of each row's last num_logits tokens."""
        with BatchView(self.store, rows) as view:
            return view.finish(self._logits(view))

    def _logits(self, view: BatchView) -> torch.Tensor:
        """[B, kept, vocab] for the view's rows, in its order."""
        rows = view.rows
        batch, width = len(rows), view.width
        hidden = self.model.model.embed_tokens(view.input_ids())  # [B, T, hidden]
        cos, sin = self.rotary(hidden, view.position_ids)  # [B, T, head_dim] each
        cos, sin = cos[:, None], sin[:, None]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        for index, layer in enumerate(self.layers):
            x = self._rms_norm(hidden, layer.input_layernorm.weight)
            qkv = F.linear(x, *self.qkv[index]).view(batch, width, heads + 2 * kv_heads, self.head_dim).transpose(1, 2)
            qk = self._rotate(qkv[:, : heads + kv_heads], cos, sin)  # queries and keys rotate together
            keys, values = view.update(qk[:, heads:], qkv[:, heads + kv_heads :], index)
            out = F.scaled_dot_product_attention(
                qk[:, :heads],
                keys,
                values,
                attn_mask=view.mask(self.layout.layers[index]),
                scale=self.scaling,
                enable_gqa=kv_heads != heads,
            )
            out = out.transpose(1, 2).reshape(batch, width, heads * self.head_dim)
            attn = layer.self_attn
            hidden = hidden + F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
            x = self._rms_norm(hidden, layer.post_attention_layernorm.weight)
            gate, up = F.linear(x, *self.gate_up[index]).chunk(2, dim=-1)
            mlp = layer.mlp
            hidden = hidden + F.linear(self.act(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        kept = max(1, max(row.num_logits for row in rows))
        last = self._rms_norm(hidden[:, -kept:], self.model.model.norm.weight)  # [B, kept, hidden]
        head = self.model.get_output_embeddings()
        return F.linear(last, head.weight, getattr(head, "bias", None))  # [B, kept, vocab]
