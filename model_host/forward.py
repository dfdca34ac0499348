"""Forward passes over many sessions at once.

- `BatchedForward`: any Hugging Face causal LM whose attention layers call `cache.update` (Llama,
  Mistral, Qwen2, GPT-2 and most others): one forward over every row, keys and values resident in a
  `SlotStore`, per-row positions and a 4-D mask.
- `SerialForward`: the fallback for an architecture the batched pass cannot serve (its start-up check
  disagrees with the model's own forward, or the model is spread over devices): one Hugging Face
  `DynamicCache` per slot, rows run one after another.

Both take a list of `Row`s and return, per row, the logits of its last `num_logits` tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import structlog
import torch
from transformers import DynamicCache, PreTrainedModel

from model_host.kv_slots import BatchView, Row, SlotStore

log = structlog.get_logger(__name__)

RowLogits = list[torch.Tensor | None]  # per row: [num_logits, vocab], or None when num_logits is 0


class Forward:
    """Runs rows through the model; `release(slot)` forgets a slot's contents."""

    name = "forward"
    batched = True
    device = torch.device("cpu")

    def __call__(self, rows: list[Row]) -> RowLogits:
        raise NotImplementedError

    def release(self, slot: int) -> None:
        """The slot's session is gone; its storage may be reused."""

    def synchronize(self) -> None:
        """Wait until the device has run what the last call queued, so that a clock read after it
        times the forward: CUDA runs kernels asynchronously, and without this a forward's time is
        only its launch (the engine's metrics, the timing every step reports, and the start-up cost
        curve that load-aware K prices rounds by). It costs no extra wait: the engine reads the
        logits on the CPU right after."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def split_logits(logits: torch.Tensor, rows: list[Row]) -> RowLogits:
    """Per row, the last num_logits of logits [B, kept, vocab] (rows are right-aligned)."""
    kept = logits.shape[1]
    return [logits[index, kept - row.num_logits :] if row.num_logits else None for index, row in enumerate(rows)]


class BatchedForward(Forward):
    name = "batched"

    def __init__(self, model: PreTrainedModel, store: SlotStore) -> None:
        self.model = model
        self.store = store
        self.device = store.device
        self.additive_mask = model.config._attn_implementation == "eager"

    def __call__(self, rows: list[Row]) -> RowLogits:
        view = BatchView(self.store, rows)
        mask = view.mask
        if self.additive_mask:  # eager attention adds its mask to the scores
            mask = torch.zeros(mask.shape, dtype=self.store.dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(self.store.dtype).min
            )
        kept = max(1, max(row.num_logits for row in rows))
        output = self.model(
            input_ids=view.input_ids(rows),
            attention_mask=mask,
            position_ids=view.position_ids,
            cache=view,
            use_cache=True,
            logits_to_keep=kept,
        )
        return split_logits(output.logits, rows)


class SerialForward(Forward):
    name = "serial"
    batched = False

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self.caches: dict[int, DynamicCache] = {}

    def __call__(self, rows: list[Row]) -> RowLogits:
        out: RowLogits = []
        for row in rows:
            cache = self.caches.get(row.slot)
            if cache is None or row.start == 0:
                cache = self.caches[row.slot] = DynamicCache(config=self.model.config)
            held = cache.get_seq_length()
            if held > row.start:
                cache.crop(row.start - held)  # transformers 5: a negative count drops tokens
            ids = torch.tensor([row.token_ids], dtype=torch.long, device=self.device)
            logits = self.model(
                input_ids=ids, cache=cache, use_cache=True, logits_to_keep=max(1, row.num_logits)
            ).logits  # [1, kept, vocab]
            out.extend(split_logits(logits, [row]))
        return out

    def release(self, slot: int) -> None:
        self.caches.pop(slot, None)


@torch.inference_mode()
def agrees_with_model(forward: Callable[[list[Row]], RowLogits], model: PreTrainedModel, tolerance: float) -> bool:
    """Three sessions of different lengths through prefill, mixed-width steps and rollbacks give the
    model's own logits (relative tolerance), in batches."""
    rng = random.Random(0)
    vocab = model.get_output_embeddings().weight.shape[0]
    device = model.get_input_embeddings().weight.device
    sequences: list[list[int]] = [[], [], []]
    worst = 0.0
    for step in range(6):
        rows = []
        for slot, sequence in enumerate(sequences):
            keep = len(sequence) - rng.randrange(0, 3) if step and sequence else len(sequence)
            del sequence[max(0, keep) :]
            new = [rng.randrange(vocab) for _ in range(rng.choice([1, 2, 4] if step else [5, 9, 12]))]
            rows.append(Row(slot=slot, start=len(sequence), token_ids=new, num_logits=min(2, len(new))))
            sequence += new
        got = forward(rows)
        for row, sequence, logits in zip(rows, sequences, got, strict=True):
            want = model(torch.tensor([sequence], device=device)).logits[0, -row.num_logits :].float()
            assert logits is not None
            scale = float(want.abs().max().clamp_min(1.0))
            worst = max(worst, float((logits.float() - want).abs().max()) / scale)
    return worst < tolerance


def choose_forward(model: PreTrainedModel, store: SlotStore, tolerance: float = 1e-3) -> Forward:
    """The batched forward when the model supports it (checked), else the serial fallback (logged)."""
    if len({str(p.device) for p in model.parameters()}) > 1:
        log.warning("batched_forward_unavailable", reason="the model is spread over several devices")
        return SerialForward(model)
    batched = BatchedForward(model, store)
    try:
        if agrees_with_model(batched, model, tolerance):
            return batched
        reason = "differs from the model's own forward"
    except (RuntimeError, AttributeError, TypeError, ValueError, IndexError, AssertionError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
    log.warning("batched_forward_unavailable", reason=reason, fallback="one session per forward")
    return SerialForward(model)
