"""Forward passes over many sessions at once.

- `BatchedForward`: any Hugging Face causal LM whose attention layers call `cache.update` (Llama,
  Mistral, Qwen2, Gemma, GPT-2 and most others): one forward over every row, keys and values in the
  blocks of a `BlockStore` (with prefix reuse), per-row positions, and a 4-D mask for each attention
  pattern the model's layers use (global, sliding window, chunked: model_host/attention.py).
- `SerialForward`: the fallback for an architecture the batched pass cannot serve (its start-up check
  disagrees with the model's own forward, or the model is spread over devices): one Hugging Face
  `DynamicCache` per slot, rows run one after another.

Both take a list of `Row`s and return, per row, the logits of its last `num_logits` tokens.
`choose_forward` checks them against the model's own forward, on sequences that run past the model's
windows with rollbacks across their edges, before a service serves.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator

import structlog
import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from model_host.attention import AttentionLayout
from model_host.batch_view import BatchView, split_logits
from model_host.kv_blocks import BlockStore
from model_host.rows import Row

log = structlog.get_logger(__name__)

RowLogits = list[torch.Tensor | None]  # per row: [num_logits, vocab], or None when num_logits is 0
# What the start-up check tolerates between a forward and the model's own, relative to the largest
# logit: float32's rounding stays far below it, and a forward that misreads the model (a window ignored)
# is off by 0.4 to 1.7 on the architecture matrix.
TOLERANCE = 1e-3
# In lower precisions a stepped forward and one over the whole sequence round apart by a few units of
# the dtype's resolution (bfloat16, tiny matrix: 0.003 to 0.012; a window ignored: 0.36 to 1.0).
_RESOLUTION_UNITS = 8


def tolerance(dtype: torch.dtype) -> float:
    """The start-up check's tolerance for a model in `dtype`: 1e-3, or 8 units of the dtype's
    resolution where that is coarser (bfloat16 0.0625, float16 0.0078)."""
    return max(TOLERANCE, _RESOLUTION_UNITS * torch.finfo(dtype).eps)


class ModelNotServable(ValueError):
    """Neither forward computes the model's own function; the message names the feature and what to do."""


class Forward:
    """Runs rows through the model. Its block store (`store`) is the record of what each slot holds
    and the one allocator: the engine admits, rolls back, forks and frees slots there."""

    name = "forward"
    batched = True
    device = torch.device("cpu")
    store: BlockStore  # a paged forward's keys and values too; the fallback's books alone
    _answers: torch.cuda.Stream | None = None  # `answering`'s stream, made on first use

    def __call__(self, rows: list[Row]) -> RowLogits:
        raise NotImplementedError

    def release(self, slot: int) -> None:
        """The slot's session is gone: its blocks, and whatever the forward keeps for it, go back."""
        self.store.release(slot)

    def idle(self) -> None:
        """The engine has nothing to run: drop what only the next forward could reuse."""

    def synchronize(self) -> None:
        """Wait until the device has run what the last call queued, so that a clock read after it
        times the forward: CUDA runs kernels asynchronously, and without this a forward's time is
        only its launch (the engine's metrics, the timing every step reports, and the start-up cost
        curve that load-aware K prices rounds by). It costs no extra wait: the logits are read right
        after (the draft's on the engine's thread, the target's on the event loop's, `answering`)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def answering(self) -> contextlib.AbstractContextManager[None]:
        """Where the event loop's thread reads finished logits (the target's argmax, sampled rows,
        logprobs, the draft's rows): on CUDA, a stream of its own. On the default stream its kernels
        would queue behind the next forward, which the engine's thread launches as soon as it has
        ended the last one's jobs, and every answer would wait a forward. The logits it reads are
        complete (`synchronize` ran before their jobs ended), so the stream waits on nothing; it is
        synchronized on the way out, so no kernel of it still reads logits whose memory the next
        forward may take. Elsewhere nothing changes."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        if self._answers is None:
            # From PyTorch's pool, created non-blocking: it does not wait for the legacy default stream
            # the forwards run on. High priority: the answers' few small kernels go first.
            self._answers = torch.cuda.Stream(self.device, priority=-1)
        return _on_stream(self._answers)


@contextlib.contextmanager
def _on_stream(stream: torch.cuda.Stream) -> Iterator[None]:
    with torch.cuda.stream(stream):
        try:
            yield
        finally:
            stream.synchronize()


class PagedForward(Forward):
    """A forward whose keys and values live in its `BlockStore`."""

    def idle(self) -> None:
        self.store.drop_windows()


class BatchedForward(PagedForward):
    name = "batched"

    def __init__(self, model: PreTrainedModel, store: BlockStore, layout: AttentionLayout | None = None) -> None:
        self.model = model
        self.store = store
        self.device = store.device
        self.layout = layout or AttentionLayout.of(model.config)
        self.additive_mask = model.config._attn_implementation == "eager"
        self.patterns = self.layout.patterns
        if len({pattern.layer_type for pattern in self.patterns}) < len(self.patterns):
            # Models look their layers' masks up by layer type (`causal_mask_mapping[layer_type]`).
            raise ValueError(f"layers of one type attend within different windows: {self.layout.describe()}")

    def _prepared(self, mask: torch.Tensor) -> torch.Tensor:
        if not self.additive_mask:
            return mask
        # eager attention adds its mask to the scores
        return torch.zeros(mask.shape, dtype=self.store.dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(self.store.dtype).min
        )

    def __call__(self, rows: list[Row]) -> RowLogits:
        with BatchView(self.store, rows) as view:
            # One pattern: the mask every layer gets. Several (local and global layers): the mapping by
            # layer type that such models take in place of the masks they would build.
            masks = {pattern.layer_type: self._prepared(view.mask(pattern)) for pattern in self.patterns}
            attention_mask: torch.Tensor | dict[str, torch.Tensor] = (
                masks if len(masks) > 1 else next(iter(masks.values()))
            )
            output = self.model(
                input_ids=view.input_ids(),
                attention_mask=attention_mask,
                position_ids=view.position_ids,
                cache=view,
                use_cache=True,
                logits_to_keep=max(1, max(row.num_logits for row in rows)),
            )
            return view.finish(output.logits)


class SerialForward(Forward):
    """One Hugging Face cache per slot. The block store keeps its books: what each slot holds and the
    blocks it would take, for admission against the one budget (no keys or values live there)."""

    name = "serial"
    batched = False

    def __init__(self, model: PreTrainedModel, store: BlockStore) -> None:
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self.caches: dict[int, DynamicCache] = {}
        self.store = store
        store.prefix_caching = False  # the keys and values live in the caches: no block can be reused

    def _new_cache(self) -> DynamicCache:
        """The model's own cache layout, except that sliding-window layers keep every token: Hugging
        Face's sliding layer drops what falls out of its window, and a rollback across the window's
        edge then needs tokens it no longer has (`crop` raises). The mask still applies the window."""
        cache = DynamicCache(config=self.model.config)
        cache.layers = [
            DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) else layer for layer in cache.layers
        ]
        return cache

    def __call__(self, rows: list[Row]) -> RowLogits:
        if any(row.parents for row in rows):
            raise ValueError("the serial forward serves chains only: a tree row needs the batched forward")
        self.store.prepare(rows)  # its books only
        self.store.publish()
        out: RowLogits = []
        for row in rows:
            cache = self.caches.get(row.slot)
            if cache is None or row.start == 0:
                cache = self.caches[row.slot] = self._new_cache()
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
        super().release(slot)


def check_schedule(layout: AttentionLayout, context: int, vocab: int, chunk: int) -> list[list[Row]]:
    """The steps of three sessions that the start-up check feeds, forward by forward.

    Without windows: short prefills, then mixed-width steps with rollbacks. With a window (or chunk)
    shorter than the context, the sessions are prefilled to just short of its edge, in chunks of at
    most `chunk` tokens as the engine feeds a long prompt, and then step across it in widths of 1 to 5
    with rollbacks of up to 3 tokens, until each runs several tokens past it: a batched forward that
    ignores a layer's window, or a cache that cannot roll back once its window is full, shows here."""
    rng = random.Random(0)
    edge = layout.longest_span if 0 < layout.longest_span < context else 0
    sequences: list[list[int]] = [[], [], []]
    steps: list[list[Row]] = []

    def feed(slot: int, sequence: list[int], keep: int, width: int, num_logits: int) -> Row:
        del sequence[keep:]
        new = [rng.randrange(vocab) for _ in range(width)]
        row = Row(slot=slot, start=len(sequence), token_ids=new, num_logits=num_logits)
        sequence += new
        return row

    if not edge:
        steps.append(
            [feed(slot, s, 0, width, 2) for slot, (s, width) in enumerate(zip(sequences, (5, 9, 12), strict=True))]
        )
        for _ in range(5):
            rows = []
            for slot, s in enumerate(sequences):
                width = rng.choice([1, 2, 4])
                rows.append(feed(slot, s, max(0, len(s) - rng.randrange(0, 3)), width, min(2, width)))
            steps.append(rows)
        return steps
    prefill = [max(1, edge - 6), max(1, edge - 4), max(1, edge - 1)]
    while any(len(s) < want for s, want in zip(sequences, prefill, strict=True)):
        rows = []
        for slot, (s, want) in enumerate(zip(sequences, prefill, strict=True)):
            width = min(chunk, want - len(s))
            if width > 0:
                rows.append(feed(slot, s, len(s), width, min(2, width) if len(s) + width == want else 0))
        steps.append(rows)
    past = min(edge + 6, context - 6)
    for _ in range(40):
        if min(len(s) for s in sequences) >= past:
            break
        rows = []
        for slot, s in enumerate(sequences):
            keep = max(0, len(s) - rng.randrange(0, 4))
            width = min(rng.choice([1, 2, 4, 5]), context - keep)
            rows.append(feed(slot, s, keep, width, min(2, width)))
        steps.append(rows)
    return steps


def check_lengths(layout: AttentionLayout, context: int, chunk: int) -> list[int]:
    """The longest each of `check_schedule`'s sessions grows: what its forwards need cached at once."""
    longest: dict[int, int] = {}
    for rows in check_schedule(layout, context, 2, chunk):
        for row in rows:
            longest[row.slot] = max(longest.get(row.slot, 0), row.start + len(row.token_ids))
    return list(longest.values())


@torch.inference_mode()
def disagreement(
    forward: Callable[[list[Row]], RowLogits], model: PreTrainedModel, layout: AttentionLayout, context: int, chunk: int
) -> float:
    """The largest difference, relative to the largest logit, between `forward` and the model's own
    forward over each whole sequence, across `check_schedule`; releases the slots it used."""
    vocab = model.get_output_embeddings().weight.shape[0]
    device = model.get_input_embeddings().weight.device
    sequences: dict[int, list[int]] = {}
    worst = 0.0
    for rows in check_schedule(layout, context, vocab, chunk):
        for row in rows:
            sequences[row.slot] = sequences.get(row.slot, [])[: row.start] + row.token_ids
        for row, logits in zip(rows, forward(rows), strict=True):
            if not row.num_logits:
                continue
            want = model(torch.tensor([sequences[row.slot]], device=device)).logits[0, -row.num_logits :].float()
            assert logits is not None
            scale = float(want.abs().max().clamp_min(1.0))
            worst = max(worst, float((logits.float() - want).abs().max()) / scale)
    if isinstance(forward, Forward):
        for slot in sequences:
            forward.release(slot)
    return worst


CHECK_ERRORS = (RuntimeError, AttributeError, TypeError, ValueError, IndexError, KeyError, AssertionError)


def _features(model: PreTrainedModel, layout: AttentionLayout) -> str:
    """What about the model's attention a user would look at when a forward does not fit it."""
    config = model.config
    found = [f"{config.model_type}: {layout.describe()}"]
    if getattr(config, "alibi", False):
        found.append("ALiBi position biases (config.alibi), built from a 2-D padding mask")
    return "; ".join(found)


def _not_servable(layout: AttentionLayout, features: str, problem: str) -> ModelNotServable:
    if layout.unsupported:
        problem = (
            f"its {', '.join(layout.unsupported)} layers keep a state that cannot be rolled back to an earlier "
            f"token ({problem})"
        )
    return ModelNotServable(
        f"this model cannot be served: {problem}; attention: {features}. Speculative decoding drops the "
        "cache's last tokens after a rejected draft, which needs global, sliding-window or chunked attention"
    )


def choose_forward(model: PreTrainedModel, store: BlockStore, prefill_chunk: int = 512) -> Forward:
    """The batched forward when it computes the model's own function (checked), else the serial
    fallback (checked too, and logged with the reason); `ModelNotServable` when neither does."""
    layout = AttentionLayout.of(model.config)
    context = store.max_context
    features = _features(model, layout)
    allowed = tolerance(store.dtype)
    if len({str(p.device) for p in model.parameters()}) > 1:
        reason = "the model is spread over several devices (device_map=auto)"
    else:
        try:
            batched = BatchedForward(model, store, layout)
            error = disagreement(batched, model, layout, context, prefill_chunk)
            if error < allowed:
                return batched
            reason = f"its logits differ from the model's own forward by {error:.2g} of the largest logit"
        except CHECK_ERRORS as exc:
            reason = f"the model's forward refused it ({type(exc).__name__}: {exc})"
    store.reset()  # what the batched check held: the fallback keeps only the store's books
    serial = SerialForward(model, store)
    try:
        error = disagreement(serial, model, layout, context, prefill_chunk)
    except CHECK_ERRORS as exc:
        raise _not_servable(layout, features, f"rolling its cache back fails ({type(exc).__name__}: {exc})") from exc
    if error >= allowed:
        raise _not_servable(
            layout, features, f"stepping and rolling back its own cache gives logits {error:.2g} away from its forward"
        )
    log.warning(
        "batched_forward_unavailable",
        reason=reason,
        attention=features,
        fallback="one session per forward: outputs stay exact, throughput under concurrent requests is lower",
    )
    return serial
