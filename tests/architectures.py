"""Tiny random-weight checkpoints of many Hugging Face architectures, for the architecture matrix.

Each family is a config built from transformers' own config classes at toy sizes: a 2-layer target
and a draft made of its first layer (the same embeddings and head), so that the draft agrees with the
target part of the time. Sliding windows are a few tokens, so that prompts of a few dozen tokens run
far past them; `layer_types` mixes local and global layers where the family has both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from tests.tiny_models import word_tokenizer

VOCAB = 96
CONTEXT = 256
WINDOW = 8  # the sliding window of the families that have one: prompts run far past it

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": CONTEXT,
    "eos_token_id": 0,
    "bos_token_id": 0,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class Family:
    """One architecture at toy size: the config's model type and the fields that differ from _COMMON."""

    name: str
    model_type: str
    fields: dict[str, Any] = field(default_factory=dict)
    drop: tuple[str, ...] = ()  # fields of _COMMON the config class does not take
    layer_types: tuple[str, ...] | None = None  # the target's; the draft keeps the first
    windowed: bool = False  # whether some layer attends within a window (the matrix runs past it)
    attention: str | None = None  # the attention implementation, when not the family's default

    def config(self, layers: int = 2) -> Any:
        fields = {key: value for key, value in _COMMON.items() if key not in self.drop}
        fields.update(self.fields)
        fields["num_hidden_layers"] = layers
        if self.layer_types is not None:
            fields["layer_types"] = list(self.layer_types[:layers])
        for key in ("n_layer", "num_layers"):
            if key in fields:
                fields[key] = layers
        return AutoConfig.for_model(self.model_type, **fields)


_SLIDING = {"sliding_window": WINDOW}
_LOCAL_GLOBAL = ("sliding_attention", "full_attention")

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in [
        Family("llama", "llama"),
        Family(
            "llama-rope-llama3",
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 10000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
        ),
        Family(
            "llama-rope-linear",
            "llama",
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
        ),
        Family("mistral", "mistral", {"sliding_window": 4096}),  # its default window, beyond the context
        Family("mistral-window", "mistral", _SLIDING, windowed=True),
        Family("llama-eager", "llama", attention="eager"),
        Family(
            "ministral-local-global", "ministral", {"head_dim": 8, **_SLIDING}, layer_types=_LOCAL_GLOBAL, windowed=True
        ),
        Family("qwen2", "qwen2"),
        Family(
            "qwen2-window",
            "qwen2",
            {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
            windowed=True,
        ),  # layer 0 global, layer 1 local
        Family("qwen3", "qwen3", {"head_dim": 8}),
        Family("phi3", "phi3"),
        Family("phi3-window", "phi3", _SLIDING, windowed=True),
        Family("gemma", "gemma", {"head_dim": 8}),
        Family("gemma2", "gemma2", {"head_dim": 8, **_SLIDING}, layer_types=_LOCAL_GLOBAL, windowed=True),
        Family(
            "gemma3-text",
            "gemma3_text",
            {"head_dim": 8, "query_pre_attn_scalar": 8, **_SLIDING},
            layer_types=_LOCAL_GLOBAL,
            windowed=True,
        ),
        Family("olmo", "olmo"),
        Family("olmo2", "olmo2"),
        Family("olmo3-local-global", "olmo3", _SLIDING, layer_types=_LOCAL_GLOBAL, windowed=True),
        Family("cohere2-local-global", "cohere2", _SLIDING, layer_types=_LOCAL_GLOBAL, windowed=True),
        Family("exaone4-local-global", "exaone4", _SLIDING, layer_types=_LOCAL_GLOBAL, windowed=True),
        Family(
            "gpt-oss-sinks",
            "gpt_oss",
            {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, **_SLIDING},
            layer_types=_LOCAL_GLOBAL,
            windowed=True,
        ),  # learned attention sinks, local and global layers
        Family(
            "llama4-chunked",
            "llama4_text",
            {
                "head_dim": 8,
                "attention_chunk_size": WINDOW,
                "num_local_experts": 2,
                "num_experts_per_tok": 1,
                "intermediate_size_mlp": 64,
                "no_rope_layers": [1, 0],
                "moe_layers": [],
            },
            layer_types=("chunked_attention", "full_attention"),
            windowed=True,
        ),
        Family("smollm3-no-rope-layers", "smollm3", {"no_rope_layers": [1, 0]}),
        Family("gpt-neox", "gpt_neox", {"rotary_pct": 0.5}, drop=("num_key_value_heads",)),
        Family(
            "falcon", "falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}, drop=("num_key_value_heads",)
        ),
        Family("falcon-alibi", "falcon", {"alibi": True}, drop=("num_key_value_heads", "intermediate_size")),
        Family("stablelm", "stablelm"),
        Family("starcoder2", "starcoder2", _SLIDING, windowed=True),
        Family(
            "gpt2",
            "gpt2",
            {"n_embd": 32, "n_head": 4, "n_layer": 2, "n_positions": CONTEXT},
            drop=(
                "hidden_size",
                "num_attention_heads",
                "num_key_value_heads",
                "intermediate_size",
                "max_position_embeddings",
            ),
        ),
    ]
}


def build(family: Family, seed: int = 0) -> tuple[PreTrainedModel, PreTrainedModel]:
    """The family's 2-layer target and a 1-layer draft that shares its embeddings, first layer and head."""
    torch.manual_seed(seed)
    kwargs = {"attn_implementation": family.attention} if family.attention else {}
    target = AutoModelForCausalLM.from_config(family.config(2), **kwargs).eval()
    _sharpen(target)
    draft = AutoModelForCausalLM.from_config(family.config(1), **kwargs).eval()
    draft.load_state_dict(target.state_dict(), strict=False)  # the second layer's weights have no place
    return target, draft


def _sharpen(model: PreTrainedModel) -> None:
    """Random heads give near-uniform rows, where every token is a near tie; scale the head so that
    the top two logits stand apart, as trained models' do."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)


def save_pair(family: Family, root: Path, seed: int = 0) -> tuple[Path, Path]:
    """Write the family's target and draft as checkpoints (with a word tokenizer) under root."""
    tokenizer = word_tokenizer(VOCAB)
    paths = []
    for name, model in zip(("target", "draft"), build(family, seed), strict=True):
        path = root / family.name / name
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]


def _table() -> str:
    """The README's table: each family's attention layout and the forward each service runs it with."""
    from draft_service.lean import LeanDraft
    from model_host.attention import AttentionLayout
    from model_host.forward import choose_forward
    from model_host.kv_blocks import BlockStore

    def store() -> BlockStore:
        return BlockStore(torch.device("cpu"), torch.float32, CONTEXT)

    lines = ["| family | model type | attention (tiny config) | target | draft |", "| --- | --- | --- | --- | --- |"]
    for family in FAMILIES.values():
        target, draft = build(family)
        lean = LeanDraft.attach(draft, store())
        draft_forward = "lean" if lean is not None else choose_forward(draft, store()).name
        layout = AttentionLayout.of(target.config).describe()
        target_forward = choose_forward(target, store()).name
        lines.append(f"| {family.name} | `{family.model_type}` | {layout} | {target_forward} | {draft_forward} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    torch.set_num_threads(1)
    print(_table())
