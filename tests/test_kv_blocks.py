"""The batched forward over resident slots computes each session's own logits, for any mix of rows,
in the Llama, Qwen2 and GPT-2 families; an architecture it cannot serve falls back to one session per
forward."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from model_host.forward import BatchedForward, SerialForward, choose_forward
from model_host.kv_blocks import BlockStore
from model_host.rows import Row
from tests.tiny_models import tiny_llama


def _models() -> dict:
    torch.manual_seed(0)
    qwen = Qwen2Config(
        vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    gpt2 = GPT2Config(vocab_size=64, n_positions=128, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    return {
        "llama": tiny_llama(96, seed=1, hidden=48, layers=3),
        "qwen2": Qwen2ForCausalLM(qwen).eval(),
        "gpt2": GPT2LMHeadModel(gpt2).eval(),
    }


def _store(model) -> BlockStore:
    return BlockStore(torch.device("cpu"), torch.float32, model.config.max_position_embeddings)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_random_batches_match_each_sessions_own_forward(family, attention):
    model = _models()[family]
    model.config._attn_implementation = attention
    vocab = model.get_output_embeddings().weight.shape[0]
    forward = choose_forward(model, _store(model))
    assert isinstance(forward, BatchedForward)
    rng = random.Random(1)
    sequences: dict[int, list[int]] = {slot: [] for slot in range(6)}
    with torch.inference_mode():
        for _ in range(40):
            rows = []
            for slot in sorted(rng.sample(range(6), rng.randrange(1, 6))):
                sequence = sequences[slot]
                if rng.random() < 0.1 or len(sequence) > 90:
                    sequence.clear()  # the slot goes to a new session
                else:
                    del sequence[max(0, len(sequence) - rng.randrange(0, 4)) :]  # a rollback
                new = [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 3, 5, 9]))]
                rows.append(Row(slot, len(sequence), new, rng.randrange(0, len(new) + 1)))
                sequence += new
            for row, logits in zip(rows, forward(rows), strict=True):
                if row.num_logits:
                    want = model(torch.tensor([sequences[row.slot]])).logits[0, -row.num_logits :]
                    assert logits is not None and torch.allclose(logits, want, atol=1e-4)


def test_storage_is_finite_where_nothing_was_written():
    """A batch reads every row's window up to its longest row; masked positions must hold finite values
    (attention turns a masked NaN into a NaN output). The store is allocated uninitialised, so every
    block handed out must have been zeroed first; the tensors never grow."""
    model = _models()["llama"]
    store = BlockStore(torch.device("cpu"), torch.float32, 128, max_tokens=512, block_tokens=8)
    forward = BatchedForward(model, store)
    with torch.inference_mode():
        forward([Row(0, 0, [1, 2, 3], 1)])
        shapes = {layer: tensor.shape for layer, tensor in store.keys.items()}
        forward([Row(9, 0, list(range(1, 60)) * 2, 1)])
        with pytest.raises(ValueError, match="context of 128"):
            forward([Row(3, 0, list(range(1, 60)) * 3, 1)])  # beyond the context: refused
    assert {layer: tensor.shape for layer, tensor in store.keys.items()} == shapes
    assert shapes[0][1] == store.num_blocks * 8  # [kv_heads, positions, head_dim]
    used = store.used_blocks * 8
    for tensor in [*store.keys.values(), *store.values.values()]:
        assert torch.isfinite(tensor[:, : used + 8]).all()


def _logits(model, tokens: list[int], count: int) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0, -count:]


def _check_blocks(store: BlockStore) -> None:
    """The store's books balance: every block is scratch, free or held, and each held block's count is
    its holders'; indexed blocks are where the index says; reservations and held tokens add up."""
    holders = [0] * store.num_blocks
    for slot in store._slots.values():
        for block in slot.table:
            holders[block] += 1
        assert len(slot.table) == -(-len(slot.tokens) // store.block_tokens)
    assert holders == store._refs
    free = set(store._free)
    held = {b for b, n in enumerate(holders) if n}
    assert not (free & held) and 0 not in free | held
    assert len(free) + len(held) == store.num_blocks - 1 == len(free) + store.used_blocks
    assert all(store._hash[block] == digest for digest, block in store._index.items())
    assert store.cached_blocks == sum(1 for block in free if store._hash[block] is not None)
    assert store.reserved_blocks == sum(slot.reserved for slot in store._slots.values())
    assert store.tokens_held == sum(len(slot.tokens) for slot in store._slots.values())


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_sessions_sharing_prefixes_under_rollbacks_and_eviction_keep_their_own_logits(prefix_caching):
    """Random sessions over a few shared prefixes, in a pool small enough that cached blocks are evicted:
    each first step starts from the longest cached prefix (as the engine does), rollbacks reach into
    shared blocks (copied before a write), and every logit matches the model's own forward."""
    model = _models()["llama"]
    store = BlockStore(torch.device("cpu"), torch.float32, 128, max_tokens=6 * 40, block_tokens=4,
                       prefix_caching=prefix_caching)  # fmt: skip
    forward = BatchedForward(model, store)
    rng = random.Random(3)
    prefixes = [[rng.randrange(96) for _ in range(rng.randrange(6, 20))] for _ in range(3)]
    sequences: dict[int, list[int]] = {}
    reused = 0
    with torch.inference_mode():
        for _ in range(60):
            rows = []
            for slot in sorted(rng.sample(range(6), rng.randrange(1, 5))):
                sequence = sequences.get(slot)
                if sequence is None or len(sequence) > 32 or rng.random() < 0.15:
                    store.release(slot)  # the session ends; a new one takes the slot
                    new = rng.choice(prefixes) + [rng.randrange(96) for _ in range(rng.randrange(1, 4))]
                    start = store.reuse(slot, new, len(new) - 1)
                    reused += start
                    assert start % 4 == 0 and start <= len(new) - 1
                    sequences[slot] = new
                    rows.append(Row(slot, start, new[start:], rng.randrange(1, len(new) - start + 1)))
                    continue
                keep = max(0, len(sequence) - rng.randrange(0, 9))  # rollbacks into shared blocks too
                store.truncate(slot, keep)
                del sequence[keep:]
                new = [rng.randrange(96) for _ in range(rng.choice([1, 2, 3, 5]))]
                rows.append(Row(slot, keep, new, rng.randrange(0, len(new) + 1)))
                sequence += new
            for row, logits in zip(rows, forward(rows), strict=True):
                if row.num_logits:
                    assert logits is not None
                    assert torch.allclose(logits, _logits(model, sequences[row.slot], row.num_logits), atol=1e-4)
            _check_blocks(store)
            assert store.used_blocks + store.cached_blocks <= store.num_blocks - 1
    assert (reused > 0) == prefix_caching
    assert store.cached_blocks or not prefix_caching  # blocks were cached (and, the pool small, evicted)


def test_salts_never_share_a_block():
    model = _models()["llama"]
    store = BlockStore(torch.device("cpu"), torch.float32, 128, max_tokens=256, block_tokens=4)
    forward = BatchedForward(model, store)
    tokens = list(range(1, 20))
    with torch.inference_mode():
        assert store.reuse(0, tokens, 18, b"tenant-a") == 0
        forward([Row(0, 0, tokens, 1)])
        store.release(0)
        assert store.reuse(1, tokens, 18, b"tenant-b") == 0
        assert store.reuse(2, tokens, 18, b"") == 0
        assert store.reuse(3, tokens, 18, b"tenant-a") == 16
        assert store.reuse(4, tokens, 10, b"tenant-a") == 8  # at most `most` tokens, in whole blocks


def test_a_forward_that_fails_indexes_nothing():
    """Blocks are indexed only once a forward has written them."""
    model = _models()["llama"]
    store = BlockStore(torch.device("cpu"), torch.float32, 64, max_tokens=256, block_tokens=4)
    forward = BatchedForward(model, store)
    with torch.inference_mode(), pytest.raises(IndexError):
        forward([Row(0, 0, [1, 2, 3, 4, 5, 6, 7, 8, 500], 1)])  # a token outside the vocabulary
    assert not store._index
    store.release(0)
    _check_blocks(store)


class _PositionBlind(LlamaForCausalLM):
    """An architecture the batched pass cannot serve: it ignores the positions it is given."""

    def forward(self, *args, position_ids=None, attention_mask=None, **kwargs):  # type: ignore[override]
        return super().forward(*args, **kwargs)


def test_an_unservable_architecture_falls_back_to_one_session_per_forward():
    base = tiny_llama(96, seed=1, hidden=48, layers=2)
    model = _PositionBlind(base.config).eval()
    model.load_state_dict(base.state_dict())
    forward = choose_forward(model, _store(model))
    assert isinstance(forward, SerialForward) and not forward.batched
    with torch.inference_mode():
        first = forward([Row(0, 0, [5, 6, 7], 1), Row(1, 0, [8, 9], 1)])
        again = forward([Row(0, 2, [7, 4], 2)])  # a rollback by one, then two tokens
    assert first[1] is not None and again[0] is not None
    assert torch.allclose(first[1], model(torch.tensor([[8, 9]])).logits[0, -1:], atol=1e-5)
    assert torch.allclose(again[0], model(torch.tensor([[5, 6, 7, 4]])).logits[0, -2:], atol=1e-5)


def test_the_pool_is_sized_from_the_model_and_refused_at_start_when_memory_cannot_hold_it(monkeypatch):
    """`sessions` (the default): max_sessions full contexts; `auto`: what the memory holds beside the
    gather windows; a number as given. A pool the memory cannot hold is refused naming the flag."""
    from types import SimpleNamespace
    from typing import cast

    from model_host import kv_memory
    from model_host.config import parse_model_service_config
    from model_host.loading import LoadedModel

    model = tiny_llama(96, seed=1, hidden=48, layers=3)  # 4 heads of 12, 2 key-value heads
    assert kv_memory.kv_bytes_per_token(model, torch.device("cpu")) == 576 == 3 * 2 * 2 * 12 * 4
    loaded = cast(LoadedModel, SimpleNamespace(model=model, input_device=torch.device("cpu"), max_context=256))
    monkeypatch.setattr(kv_memory, "host_available_bytes", lambda: 2 * 576 * 10_000)  # half of it is usable

    def size(setting: str) -> kv_memory.PoolSize:
        return kv_memory.pool_size(setting, loaded, max_sessions=4, max_rows=2, block_tokens=16)

    # a window: 2 rows of 256 + 65 positions in blocks of 16 (336 each), at most half the pool; three sets
    assert size("sessions").tokens == 4 * 256 and size("sessions").window_positions == 1024 // 2
    assert size("3000").window_positions == 2 * 336
    assert size("auto").tokens == 10_000 - 3 * 672 and size("auto").bytes == 576 * 10_000
    assert size("4096").tokens == 4096
    with pytest.raises(ValueError, match=r"--max-cached-tokens 100000: .* lower --max-cached-tokens"):
        size("100000")
    monkeypatch.setattr(kv_memory, "host_available_bytes", lambda: 2 * 576 * 2_200)
    with pytest.raises(ValueError, match="less than one full context"):
        size("auto")
    assert parse_model_service_config("target", ["--model", "m", "--max-cached-tokens", "auto"]).max_cached_tokens
    assert parse_model_service_config("target", ["--model", "m"]).max_cached_tokens == "sessions"
    with pytest.raises(SystemExit):
        parse_model_service_config("target", ["--model", "m", "--max-cached-tokens", "lots"])


def _windowed() -> tuple[LlamaForCausalLM, BlockStore, BatchedForward]:
    """The tiny Llama over a store of blocks of 8 whose budget leaves room for windows."""
    model = _models()["llama"]
    store = BlockStore(torch.device("cpu"), torch.float32, 256, max_tokens=16384, block_tokens=8)
    return model, store, BatchedForward(model, store)


def test_batches_that_continue_over_kept_windows_keep_each_sessions_own_logits():
    """A batch over the same sessions as the last forward that wrote them reuses its gathered window;
    rollbacks, sessions written by other batches, new sessions and prefix hits in between must each
    be noticed (the window is rebuilt), and every logit matches the model's own forward."""
    model, store, forward = _windowed()
    rng = random.Random(5)
    groups = [(0, 1, 2), (3, 4), (0, 1, 2, 3, 4, 5), (2,)]
    sequences: dict[int, list[int]] = {}
    with torch.inference_mode():
        for _ in range(120):
            group = groups[0] if rng.random() < 0.5 else rng.choice(groups)  # the same batch, often
            rows = []
            for slot in group:
                sequence = sequences.setdefault(slot, [])
                if len(sequence) > 120 or rng.random() < 0.03:
                    store.release(slot)
                    sequence = sequences[slot] = [1, 2, 3, 4, 5, 6, 7, 8, 9, rng.randrange(96)]
                    start = store.reuse(slot, sequence, len(sequence) - 1)
                    rows.append(Row(slot, start, sequence[start:], 1))
                    continue
                keep = max(0, len(sequence) - (rng.randrange(0, 4) if rng.random() < 0.3 else 0))
                store.truncate(slot, keep)
                del sequence[keep:]
                new = [rng.randrange(96) for _ in range(rng.choice([1, 1, 1, 3]))]
                rows.append(Row(slot, keep, new, len(new)))
                sequence += new
            for row, logits in zip(rows, forward(rows), strict=True):
                assert logits is not None
                assert torch.allclose(logits, _logits(model, sequences[row.slot], row.num_logits), atol=1e-4)
    assert store.windows.continued > 30  # the windows were really reused
    forward.idle()
    assert not store.windows.kept


def test_a_window_no_store_keeps_is_freed_at_once_without_the_cyclic_collector():
    """Windows are kept for at most two batch compositions. One that falls out, or whose sessions end,
    must be freed by reference counting: a slot pointing back at its window would keep its tensors
    alive (the soak saw the target's RSS grow by gigabytes a minute)."""
    import gc
    import weakref

    model = _models()["llama"]
    store = BlockStore(torch.device("cpu"), torch.float32, 256, max_tokens=4096, block_tokens=8)
    forward = BatchedForward(model, store)
    windows: list[weakref.ref] = []
    gc.disable()
    try:
        with torch.inference_mode():
            for group in [(0, 1), (2, 3), (4, 5), (0, 2), (1, 3, 5)]:
                rows = [Row(slot, 0, [1 + slot, 2, 3], 1) for slot in group]
                forward(rows)
                windows.append(weakref.ref(next(reversed(store.windows.kept.values()))))  # the newest
                for slot in group:
                    store.release(slot)
        assert sum(ref() is not None for ref in windows) == 2, "only the two kept windows may be alive"
        forward.idle()
        assert all(ref() is None for ref in windows)
    finally:
        gc.enable()


def _greedy_step(model, store: BlockStore, forward: BatchedForward, sequences: dict, slots: list[int]) -> int:
    """One greedy token for each of `slots` (a new session feeds its whole sequence), each logit checked
    against the model's own forward; returns the rows the forward gathered from the blocks."""
    before = store.windows.rows_gathered
    rows = []
    for slot in slots:
        sequence = sequences[slot]
        start = len(sequence) - 1 if slot in store._slots else 0
        rows.append(Row(slot, start, sequence[start:], 1))
    for row, logits in zip(rows, forward(rows), strict=True):
        assert logits is not None
        assert torch.allclose(logits, _logits(model, sequences[row.slot], 1), atol=1e-4)
        sequences[row.slot].append(int(logits[-1].argmax()))
    return store.windows.rows_gathered - before


def test_a_session_that_ends_and_one_that_joins_cost_one_row_not_the_batch():
    """Streams of different lengths end at different steps. The window keeps every other session's
    row: the joining session takes the freed row, a shrinking batch moves its last row into the hole,
    and only those rows are gathered again; every logit still matches the model's own forward."""
    model, store, forward = _windowed()
    rng = random.Random(3)
    sequences = {slot: [rng.randrange(96) for _ in range(5 + slot)] for slot in range(8)}
    with torch.inference_mode():

        def step(slots: list[int]) -> int:
            return _greedy_step(model, store, forward, sequences, slots)

        assert step(list(range(8))) == 8  # a new window: every row
        assert step(list(range(8))) == 0
        store.release(3)  # a stream ends; a new session takes its slot number
        sequences[3] = [rng.randrange(96) for _ in range(4)]
        assert step(list(range(8))) == 1
        assert step([0, 1, 2, 3, 5, 6, 7]) == 1  # slot 4 sits this step out: slot 7's row moves into its place
        assert step([0, 1, 2, 3, 5, 6, 7]) == 0
        assert step(list(range(8))) == 1  # and comes back
        store.truncate(6, len(sequences[6]) - 3)  # a rollback within what the window holds
        del sequences[6][-2:]
        assert step(list(range(8))) == 0
        assert store.windows.continued == 3


def test_a_batch_that_grows_as_streams_arrive_keeps_its_window():
    """A window has rows for the engine's largest batch (`max_rows`) where its positions allow: each
    session that arrives joins it with one row, where a window sized to its first batch would be
    replaced, every row gathered again. A batch past `max_rows` keeps no window."""
    model, _, _ = _windowed()
    store = BlockStore(torch.device("cpu"), torch.float32, 256, max_tokens=16384, block_tokens=8, max_rows=6)
    forward = BatchedForward(model, store)
    rng = random.Random(11)
    sequences = {slot: [rng.randrange(96) for _ in range(4 + slot)] for slot in range(7)}
    with torch.inference_mode():

        def step(slots: list[int]) -> int:
            return _greedy_step(model, store, forward, sequences, slots)

        assert step([0, 1]) == 2  # a new window: every row
        assert step([0, 1]) == 0
        assert step([0, 1, 2]) == 1
        assert step([0, 1, 2, 3, 4, 5]) == 3
        (window,) = store.windows.kept.values()
        assert window.rows == 6 and store.windows.continued == 1
        assert step(list(range(7))) == 7  # wider than any batch the engine forms: the forward's own gather
        assert list(store.windows.kept.values()) == [window]
        assert step(list(range(6))) == 6  # the window stays, its rows stale: written outside it


def test_a_long_prompts_chunk_keeps_no_window_and_the_decoding_batch_keeps_its_own():
    """A prefill chunk wider than a window's headroom gathers into the store's scratch buffers: the
    decoding batch's window survives it, and the prompt's session joins that window with one row."""
    model, store, forward = _windowed()
    rng = random.Random(4)
    sequences = {slot: [rng.randrange(96) for _ in range(100)] for slot in range(4)}
    with torch.inference_mode():

        def decode(slots: range) -> None:
            rows = [Row(slot, len(sequences[slot]), [7], 1) for slot in slots]
            for slot in slots:
                sequences[slot].append(7)
            for row, logits in zip(rows, forward(rows), strict=True):
                assert logits is not None
                assert torch.allclose(logits, _logits(model, sequences[row.slot], 1), atol=1e-4)

        forward([Row(slot, 0, sequences[slot], 1) for slot in range(4)])
        assert not store.windows.kept  # 100 tokens wide: a prefill
        decode(range(4))
        windows = list(store.windows.kept)
        assert len(windows) == 1
        sequences[4] = [rng.randrange(96) for _ in range(70)]  # wider than the headroom of 64
        (logits,) = forward([Row(4, 0, sequences[4], 1)])
        assert logits is not None
        assert torch.allclose(logits, _logits(model, sequences[4], 1), atol=1e-4)
        assert list(store.windows.kept) == windows
        before = store.windows.rows_gathered
        decode(range(5))
        assert store.windows.rows_gathered - before == 1  # the prompt's session joins; the others keep their rows
        assert list(store.windows.kept) == windows


def test_a_forward_that_fails_before_the_model_runs_leaves_no_row_trusted(monkeypatch):
    """A view that fails after its rows were placed (here while building its indices) must not let
    the next forward read a row it never gathered (a session written outside the window since): it
    is gathered again, and the logits are exact."""
    from model_host import batch_view

    model, _, forward = _windowed()
    rng = random.Random(6)
    sequences = {slot: [rng.randrange(96) for _ in range(5 + slot)] for slot in range(3)}
    with torch.inference_mode():
        forward([Row(slot, 0, sequences[slot], 1) for slot in range(3)])
        sequences[1] += [rng.randrange(96) for _ in range(70)]  # a wide step: written outside the window
        forward([Row(1, len(sequences[1]) - 70, sequences[1][-70:], 1)])
        rows = [Row(slot, len(sequences[slot]), [5 + slot], 1) for slot in range(3)]
        real = batch_view._addresses
        monkeypatch.setattr(batch_view, "_addresses", lambda *args: (_ for _ in ()).throw(MemoryError("index")))
        with pytest.raises(MemoryError):
            forward(rows)
        monkeypatch.setattr(batch_view, "_addresses", real)
        for slot in range(3):
            sequences[slot].append(5 + slot)
        for row, logits in zip(rows, forward(rows), strict=True):
            assert logits is not None
            assert torch.allclose(logits, _logits(model, sequences[row.slot], 1), atol=1e-4)


@pytest.mark.parametrize("one_copy", [False, True], ids=["a copy a row", "one copy (devices)"])
def test_a_row_that_joins_a_window_gathers_only_its_own_blocks(one_copy, monkeypatch):
    """The windows' buffers are taken zeroed at start, so a session that joins a kept window gathers
    only its own blocks: what lies past them in its row is finite (a zero, or the keys of the session
    that had the row), and masked."""
    from model_host import batch_view

    monkeypatch.setattr(batch_view, "_one_copy", lambda device: one_copy)
    model, store, forward = _windowed()
    rng = random.Random(7)
    sequences = {slot: [rng.randrange(96) for _ in range(6 + 3 * slot)] for slot in range(6)}
    joined: list[tuple[int, int]] = []
    view_index = batch_view.BatchView._index

    def index(view: batch_view.BatchView, rows: list[Row], device: torch.device) -> None:
        view_index(view, rows, device)
        if view.fresh:  # rows that join a kept window
            joined.append((len(view.read_blocks), sum(len(view._tables[i]) for i in view.fresh)))

    monkeypatch.setattr(batch_view.BatchView, "_index", index)
    with torch.inference_mode():
        forward([Row(0, 0, [1, 2, 3], 1)])  # the start-up check's forward allocates every layer
        store.release(0)
        forward.idle()  # as the engine does once no session is open
        store.take_pool()
        for buffers in [*store.windows.spare, store.windows.gathered]:
            for keys, values in buffers._tensors.values():
                assert keys.numel() == values.numel() >= store.windows.positions and torch.isfinite(keys).all()

        def step(slots: list[int]) -> None:
            _greedy_step(model, store, forward, sequences, slots)  # a NaN logit is never close

        step([0, 1, 2, 3])
        step([0, 1, 2, 3])
        (window,) = store.windows.kept.values()
        step([0, 1, 2, 3, 4])  # slot 4 takes row 4, never written
        store.release(1)
        del sequences[1]
        step([0, 2, 3, 4, 5])  # slot 5 takes row 1: its own blocks; the rest of the row is slot 1's
        assert store.windows.continued >= 1 and list(store.windows.kept.values()) == [window]
    assert len(joined) == 2 and all(read == own for read, own in joined)


def test_an_idle_engine_keeps_window_buffers_and_shrinks_a_grown_gather():
    """Idle, no window can be continued, but the buffers stay for the next busy spell (a host would
    fault their pages in again, and they are the service's memory from its start). A gather that a
    forward wider than a window grew goes back to its size."""
    model = _models()["llama"]
    store = BlockStore(torch.device("cpu"), torch.float32, 256, max_tokens=16384, block_tokens=8, max_rows=2)
    forward = BatchedForward(model, store)
    assert store.windows.positions == 2 * 328  # two rows of 256 + 65 positions, in blocks of 8
    with torch.inference_mode():
        forward([Row(slot, 0, [1 + slot, 2, 3], 1) for slot in range(2)])
        (window,) = store.windows.kept.values()
        forward([Row(9, 0, list(range(1, 80)), 1)])  # wider than the headroom: the own gather
        gathered = store.windows.gathered
        for slot in [*range(2), 9]:
            store.release(slot)
        forward.idle()
        assert not store.windows.kept and store.windows.gathered is gathered
        forward([Row(slot, 0, [1 + t % 90 for t in range(240)], 1) for slot in range(10, 13)])  # 720 positions: grown
        assert store.windows.gathered.grown
        for slot in range(10, 13):
            store.release(slot)
        forward.idle()
        assert store.windows.gathered is not gathered and not store.windows.gathered.grown
        forward([Row(slot, 0, [4, 5, 6], 1) for slot in range(4, 6)])
        assert next(iter(store.windows.kept.values())).buffers is window.buffers


def test_a_pool_the_memory_cannot_hold_stops_the_service_at_start_naming_the_flag(tiny_pair, monkeypatch):
    from draft_service.servicer import SERVICE_NAME, DraftServicer, register
    from model_host import kv_memory, runtime

    monkeypatch.setattr(runtime, "configure_logging", lambda level: None)  # keep the suite's logging
    monkeypatch.setattr(kv_memory, "host_available_bytes", lambda: 64 * 2**20)
    argv = ["--model", str(tiny_pair.close_draft), "--host", "127.0.0.1", "--port", "0"]
    with pytest.raises(SystemExit, match=r"^draft_service: --max-cached-tokens 10000000: .* lower --max-cached-tokens"):
        runtime.run_model_service(
            "draft_service", [*argv, "--max-cached-tokens", "10000000"], DraftServicer, register, SERVICE_NAME
        )
