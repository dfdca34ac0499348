"""Loading any AutoModelForCausalLM checkpoint on a chosen device and dtype."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from serving.vocab import tokenizer_fingerprint

log = structlog.get_logger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_MAX_CONTEXT = 2048


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve, and the facts about it that the protocol reports."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    model_id: str
    device_name: str
    input_device: torch.device  # where input ids go (the first layer's device under device_map="auto")
    dtype: torch.dtype
    vocab_size: int  # width of the logit rows
    max_context: int
    eos_token_ids: tuple[int, ...]
    tokenizer_fingerprint: str


def resolve_device(device: str) -> str:
    """Check a --device value against this machine; the message names what to change."""
    if device == "auto":
        return device
    try:
        parsed = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"--device {device!r} is not a device; use cpu, cuda, cuda:N or auto") from exc
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device} asked for a GPU but torch sees none; use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype | str:
    if dtype == "auto":
        # CPU kernels are fastest and exact in float32; GPUs keep the checkpoint's own dtype.
        return torch.float32 if device == "cpu" else "auto"
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not supported; use one of {', '.join([*_DTYPES, 'auto'])}")
    return _DTYPES[dtype]


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> tuple[int, ...]:
    candidates: list[Any] = [model.config.eos_token_id]
    if model.generation_config is not None:
        candidates.append(model.generation_config.eos_token_id)
    if tokenizer is not None:
        candidates.append(tokenizer.eos_token_id)
    ids: set[int] = set()
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


def load_model(model_id: str, device: str = "cpu", dtype: str = "auto") -> LoadedModel:
    """Load a checkpoint for inference; raises ValueError with a message that names what to change."""
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if device == "auto":
        kwargs["device_map"] = "auto"
    try:
        model = AutoModelForCausalLM.from_pretrained(model_id, **kwargs)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load model {model_id!r}: {exc}") from exc
    if device != "auto":
        model = model.to(device)
    model.eval()
    try:
        tokenizer: PreTrainedTokenizerBase | None = AutoTokenizer.from_pretrained(model_id)
    except (OSError, ValueError):
        tokenizer = None
        log.warning("no_tokenizer", model=model_id)
    vocab_size = int(model.get_output_embeddings().weight.shape[0])
    max_context = int(getattr(model.config, "max_position_embeddings", 0) or DEFAULT_MAX_CONTEXT)
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        device_name=device,
        input_device=model.get_input_embeddings().weight.device,
        dtype=next(model.parameters()).dtype,
        vocab_size=vocab_size,
        max_context=max_context,
        eos_token_ids=_eos_ids(model, tokenizer),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer) if tokenizer is not None else "",
    )
    log.info(
        "model_loaded",
        model=model_id,
        device=device,
        dtype=str(loaded.dtype),
        vocab_size=vocab_size,
        parameters=model.num_parameters(),
        max_context=max_context,
    )
    return loaded
