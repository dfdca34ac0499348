"""Which cached keys each attention layer's queries see, read from the model's config.

Hugging Face models mix layer types: global layers attend to every earlier token, sliding-window
layers (Mistral, Gemma-2 and -3, Phi-3, Starcoder2, Qwen2 with `use_sliding_window`) to the last
`sliding_window` tokens, chunked layers (Llama 4) to the earlier tokens of their own chunk. The
layout comes from transformers' own reading of the config (`get_layer_types_and_kwargs`, which its
caches are built from), so it follows each family's fields (`layer_types`, `sliding_window`,
`attention_chunk_size`, per-layer configs) without a table of our own.

The windows are also where paged KV memory can save: a sliding layer's keys older than its window
are never read again (`LayerAttention.span`), so a block store may free them once no rollback can
reach back past them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"

# Layer types whose state is keys and values per token, so that dropping a session's last tokens
# (rollback after a rejection) is moving its length. Anything else (recurrent "linear_attention",
# convolution states, compressed or indexed attention) is beyond what speculation here can roll back.
ROLLBACK_TYPES = frozenset({FULL, SLIDING, CHUNKED})


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention pattern."""

    layer_type: str
    span: int | None = (
        None  # sliding: the window (a query sees the last `span` positions, itself included); chunked: the chunk
    )

    def describe(self) -> str:
        if self.layer_type == SLIDING:
            return f"{SLIDING} (window {self.span})"
        if self.layer_type == CHUNKED:
            return f"{CHUNKED} (chunks of {self.span})"
        return self.layer_type


GLOBAL = LayerAttention(FULL)


@dataclass(frozen=True)
class AttentionLayout:
    """The attention pattern of every layer of a model."""

    layers: tuple[LayerAttention, ...]

    @classmethod
    def of(cls, config: PretrainedConfig) -> AttentionLayout:
        text_config = config.get_text_config(decoder=True)
        layer_types, kwargs = get_layer_types_and_kwargs(text_config)
        layers = []
        for layer_type, layer_kwargs in zip(layer_types, kwargs, strict=True):
            span = layer_kwargs.get("sliding_window") if layer_type in (SLIDING, CHUNKED) else None
            layers.append(LayerAttention(layer_type, int(span) if span is not None else None))
        return cls(tuple(layers))

    @property
    def patterns(self) -> list[LayerAttention]:
        """The distinct patterns, in layer order."""
        return list(dict.fromkeys(self.layers))

    @property
    def longest_span(self) -> int:
        """The widest window or chunk of any layer (0 when every layer is global)."""
        return max((layer.span or 0 for layer in self.layers), default=0)

    @property
    def unsupported(self) -> list[str]:
        """Layer types whose state cannot be rolled back by dropping tokens."""
        return sorted({layer.layer_type for layer in self.layers} - ROLLBACK_TYPES)

    def describe(self) -> str:
        """For logs and errors: each pattern and the layers that use it."""
        parts = []
        for pattern in self.patterns:
            indices = [str(i) for i, layer in enumerate(self.layers) if layer == pattern]
            parts.append(f"{pattern.describe()} on layer{'s' if len(indices) > 1 else ''} {', '.join(indices)}")
        return "; ".join(parts)


def visible_keys(layer: LayerAttention, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Where a query at `positions` [B, T] may attend to keys at `keys` [B or 1, L] (each key's
    position: a tree's keys sit at their depth's): [B, T, L] booleans, with the same arithmetic as
    transformers' mask functions (masking_utils: causal, sliding window, chunked)."""
    query = positions[:, :, None]  # [B, T, 1]
    key = keys[:, None, :]  # [B or 1, 1, L]
    visible = key <= query
    if layer.layer_type == SLIDING and layer.span is not None:
        visible &= key > query - layer.span
    elif layer.layer_type == CHUNKED and layer.span is not None:
        visible &= torch.div(key, layer.span, rounding_mode="floor") == torch.div(
            query, layer.span, rounding_mode="floor"
        )
    return visible
