"""Session forks and tree rows in the model services (model_host/kv_blocks.py, `fork` and `resolve`;
model_host/rows.py, a tree row).

- In every family of the architecture matrix that the batched forward serves, and in the lean
  draft: a fork's stepped logits equal a fresh session's over the same tokens, stepping beside its
  parent and its siblings in one forward; a tree row's logits equal one forward per root-to-leaf
  path, with sliding windows, chunks and sinks measured along the path.
- Resolve to any branch, then roll back past the fork point.
- The budget counts a shared block once: 8 branches of a 1,000-token session take the prefix once.
- Under memory pressure branches are dropped before a live session waits; a cancel mid-fork frees
  everything; a prefix-cache hit inside a fork.
- The engine forks and resolves on its own thread, in order with the steps; the serial fallback
  refuses forks.
"""

from __future__ import annotations

import random

import grpc
import pytest
import torch

from draft_service.lean import LeanDraft
from model_host.engine import Engine
from model_host.forward import BatchedForward, Forward, SerialForward
from model_host.job import EngineLimits, Job
from model_host.kv_blocks import BlockStore
from model_host.rows import Row
from serving.errors import ServiceError
from tests.architectures import CONTEXT, FAMILIES, VOCAB, WINDOW, build
from tests.conftest import wait_until
from tests.test_architectures import SERIAL_ONLY
from tests.test_kv_blocks import _check_blocks

ATOL = 1e-4


def _own_logits(model: torch.nn.Module, tokens: list[int], count: int) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0, -count:]


def _store(block_tokens: int = 4, max_tokens: int = 8 * CONTEXT, budget: int | None = None) -> BlockStore:
    return BlockStore(
        torch.device("cpu"), torch.float32, CONTEXT, max_tokens, block_tokens=block_tokens, budget_tokens=budget
    )


def _forwards(family: str) -> list[tuple[str, Forward, torch.nn.Module, BlockStore]]:
    """The batched forward over the family's target and, where it attaches, the lean draft."""
    target, draft = build(FAMILIES[family])
    store = _store()
    forwards: list[tuple[str, Forward, torch.nn.Module, BlockStore]] = [
        ("batched", BatchedForward(target, store), target, store)
    ]
    draft_store = _store()
    lean = LeanDraft.attach(draft, draft_store)
    if lean is not None:
        forwards.append(("lean draft", lean, draft, draft_store))
    return forwards


def _batched_families() -> list:
    return [pytest.param(name, id=name) for name in FAMILIES if name not in SERIAL_ONLY]


def _step(forward: Forward, model: torch.nn.Module, sequences: dict[int, list[int]], feeds: dict[int, list[int]]):
    """One forward over every slot's feed (after what it holds); each row's logits checked against the
    model's own forward over the slot's whole sequence."""
    rows = [Row(slot, len(sequences[slot]), feed, len(feed)) for slot, feed in feeds.items()]
    with torch.inference_mode():
        out = forward(rows)
    for row, logits in zip(rows, out, strict=True):
        sequences[row.slot] += row.token_ids
        assert logits is not None
        want = _own_logits(model, sequences[row.slot], row.num_logits)
        assert torch.allclose(logits, want, atol=ATOL), (row.slot, float((logits - want).abs().max()))


@pytest.mark.parametrize("family", _batched_families())
def test_a_forks_stepped_logits_equal_a_fresh_sessions_and_resolve_keeps_any_branch(family):
    """A session past the window forks into three branches; they step beside their parent and a
    stranger, in one forward, with chains of different widths; then the session resolves to one of
    them and rolls back past the fork point."""
    rng = random.Random(family)
    for name, forward, model, store in _forwards(family):
        sequences: dict[int, list[int]] = {0: [], 9: []}
        _step(forward, model, sequences, {0: [rng.randrange(VOCAB) for _ in range(3 * WINDOW + 2)]})  # partial block
        _step(forward, model, sequences, {9: [rng.randrange(VOCAB) for _ in range(5)]})
        used = store.used_blocks
        for branch in (1, 2, 3):
            store.fork(0, branch)
            sequences[branch] = list(sequences[0])
        assert store.used_blocks == used, name  # a fork takes no block until it writes
        for _ in range(3):
            feeds = {slot: [rng.randrange(VOCAB) for _ in range(rng.choice([1, 2, 5]))] for slot in (0, 1, 2, 3, 9)}
            _step(forward, model, sequences, feeds)
            _check_blocks(store)
        kept = rng.choice([1, 2, 3])
        assert store.resolve(0, kept) and store.length(0) == len(sequences[kept])
        sequences[0] = sequences[kept]
        for branch in (1, 2, 3):
            store.release(branch)
        _step(forward, model, sequences, {0: [rng.randrange(VOCAB)], 9: [rng.randrange(VOCAB)]})
        cut = 2 * WINDOW - 1  # before the fork point
        store.truncate(0, cut)
        del sequences[0][cut:]
        _step(forward, model, sequences, {0: [rng.randrange(VOCAB) for _ in range(4)], 9: [rng.randrange(VOCAB)]})
        _check_blocks(store)
        store.release(0)
        store.release(9)
        assert store.used_blocks == 0, name


def _tree(rng: random.Random, nodes: int) -> tuple[list[int], tuple[int, ...]]:
    """Random tokens and parents: several roots, and chains and siblings below them."""
    parents: list[int] = []
    for index in range(nodes):
        parents.append(-1 if index == 0 or rng.random() < 0.15 else rng.randrange(index))
    return [rng.randrange(VOCAB) for _ in range(nodes)], tuple(parents)


def _path(parents: tuple[int, ...], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("family", _batched_families())
def test_a_tree_rows_logits_equal_one_forward_per_root_to_leaf_path(family):
    """Each node's logits equal the model's own forward over the prefix and the node's path; the tree
    rides in a forward with chain rows, its tokens are dropped afterwards, and the session steps on
    as if the tree had never been fed."""
    rng = random.Random(family + "tree")
    for name, forward, model, store in _forwards(family):
        sequences: dict[int, list[int]] = {0: [], 1: []}
        _step(forward, model, sequences, {0: [rng.randrange(VOCAB) for _ in range(2 * WINDOW + 3)]})
        _step(forward, model, sequences, {1: [rng.randrange(VOCAB) for _ in range(WINDOW)]})
        for nodes in (WINDOW + 4, 3):  # deeper than the window, and shallow
            tokens, parents = _tree(rng, nodes)
            prefix = sequences[0]
            tree = Row(0, len(prefix), tokens, len(tokens), parents)
            chain = Row(1, len(sequences[1]), [rng.randrange(VOCAB)], 1)
            with torch.inference_mode():
                tree_logits, chain_logits = forward([tree, chain])
            sequences[1] += chain.token_ids
            assert chain_logits is not None and tree_logits is not None
            assert torch.allclose(chain_logits, _own_logits(model, sequences[1], 1), atol=ATOL), name
            for node in range(nodes):
                want = _own_logits(model, prefix + [tokens[i] for i in _path(parents, node)], 1)[0]
                assert torch.allclose(tree_logits[node], want, atol=ATOL), (name, node, parents)
            assert store.length(0) == len(prefix), name  # the tree's keys and values were dropped
            _step(forward, model, sequences, {0: [tokens[0]], 1: [rng.randrange(VOCAB)]})  # the accepted path, re-fed


@pytest.mark.parametrize("family", ["llama", "mistral-window"])
def test_a_tree_row_keeps_the_chain_it_appends_before_its_tree(family):
    """A verify step's row: the tokens it appends (a chain that stays), then its tree (dropped). Each
    node's logits are the model's own over the prefix, the chain and the node's path; the session then
    holds the prefix and the chain, and steps on from there."""
    rng = random.Random(family + "kept")
    for name, forward, model, store in _forwards(family):
        sequences: dict[int, list[int]] = {0: []}
        _step(forward, model, sequences, {0: [rng.randrange(VOCAB) for _ in range(2 * WINDOW + 1)]})
        chain = [rng.randrange(VOCAB) for _ in range(3)]
        tokens, parents = _tree(rng, 6)
        row = Row(
            0,
            len(sequences[0]),
            chain + tokens,
            len(chain) + len(tokens),
            (-1, 0, 1, *[len(chain) - 1 if p < 0 else p + len(chain) for p in parents]),
            kept=len(chain),
        )
        with torch.inference_mode():
            (logits,) = forward([row])
        assert logits is not None
        prefix = sequences[0] + chain
        for node in range(len(tokens)):
            want = _own_logits(model, prefix + [tokens[i] for i in _path(parents, node)], 1)[0]
            assert torch.allclose(logits[len(chain) + node], want, atol=ATOL), (name, node)
        assert torch.allclose(logits[: len(chain)], _own_logits(model, prefix, len(chain)), atol=ATOL), name
        assert store.length(0) == len(prefix), name
        sequences[0] = prefix
        _step(forward, model, sequences, {0: [tokens[0], rng.randrange(VOCAB)]})  # the accepted path, re-fed
        _check_blocks(store)
        store.release(0)
        assert store.used_blocks == 0, name


def test_a_tree_row_names_earlier_parents_and_grows_from_a_cached_prefix():
    with pytest.raises(ValueError, match="parents"):
        Row(0, 4, [1, 2], 2, (0, -1))  # the first token's parent is itself
    with pytest.raises(ValueError, match="kept"):
        Row(0, 4, [1, 2, 3], 3, (-1, -1, 0), kept=2)  # the kept tokens are no chain
    with pytest.raises(ValueError, match="kept"):
        Row(0, 4, [1, 2], 2, kept=1)  # a chain row keeps everything anyway
    with pytest.raises(ValueError, match="parents"):
        Row(0, 4, [1, 2, 3], 3, (-1, 0))
    assert Row(0, 4, [1, 2, 3, 4], 4, (-1, 0, 0, -1)).depths() == [0, 1, 1, 0]
    target, _ = build(FAMILIES["llama"])
    with torch.inference_mode(), pytest.raises(ValueError, match="cached prefix"):
        BatchedForward(target, _store())([Row(0, 0, [1, 2], 2, (-1, 0))])


def test_eight_branches_of_a_long_session_take_its_prefix_once():
    """The goal of the issue: 8 branches of a 1,000-token session reserve the prefix once, 8 copies of
    its partial last block, and what each branch writes past it."""
    target, _ = build(FAMILIES["llama"])
    store = BlockStore(torch.device("cpu"), torch.float32, 2048, 4096, block_tokens=16)
    forward = BatchedForward(target, store)
    rng = random.Random(8)
    with torch.inference_mode():
        forward([Row(0, 0, [rng.randrange(VOCAB) for _ in range(1000)], 1)])
        assert store.used_blocks == 63  # 62 full blocks and 8 tokens of the 63rd
        for branch in range(1, 9):
            store.fork(0, branch)
        assert store.used_blocks == 63 and store.reserved_blocks == 8  # the copies, reserved at the fork
        forward([Row(branch, 1000, [rng.randrange(VOCAB) for _ in range(4)], 1) for branch in range(1, 9)])
        assert store.used_blocks == 63 + 8 and store.reserved_blocks == 0
        forward([Row(branch, 1004, [rng.randrange(VOCAB) for _ in range(10)], 1) for branch in range(1, 9)])
        assert store.used_blocks == 63 + 8 + 8  # each branch crossed into a block of its own


def test_branches_are_dropped_before_a_live_session_waits_and_shared_blocks_count_once():
    target, _ = build(FAMILIES["llama"])
    store = _store(block_tokens=4, max_tokens=1024, budget=64)  # 16 blocks
    forward = BatchedForward(target, store)
    with torch.inference_mode():
        forward([Row(0, 0, list(range(1, 23)), 1)])  # 6 blocks, the last partial
        for branch in (1, 2):
            store.fork(0, branch)
            forward([Row(branch, 22, [5, 6, 7, 8, 9, 10], 1)])  # the copy and one more block each
        assert store.used_blocks == 6 + 2 * 2
        # Sessions that begin alike share their full blocks: each of these holds 20 tokens, 5 blocks,
        # but only the first pays for them.
        for slot in (10, 11, 12):
            assert store.reuse(slot, list(range(1, 23)), 21) == 20
            assert store.reserve(slot, 22)
            forward([Row(slot, 20, [21, 22], 1)])
        assert store.used_blocks == 10 + 3  # a block each past the shared ones
        assert not store.reclaimed and store.available_blocks == 3
        assert store.reserve(13, 16)  # 4 blocks: there only once the branches' own 4 go back
        assert store.reclaimed == {1, 2} and store.length(1) == 0 and store.used_blocks == 9
        assert not store.reserve(14, 64)  # no branch is left to drop: refused
        _check_blocks(store)


def test_the_engine_forks_and_resolves_in_order_with_the_steps():
    """Through the engine: branches step in the same forwards as live sessions; a resolve keeps one and
    frees the rest; a cancelled branch step and its release free everything; the serial fallback
    refuses to fork."""
    target, _ = build(FAMILIES["llama"])
    store = _store(block_tokens=4)
    forward = _Recording(target, store)
    engine = Engine(forward, EngineLimits(batch_hold_fraction=0.0), "test")
    engine.start()
    try:
        slot, live = engine.slots.lease(), engine.slots.lease()
        prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
        engine.submit(Job(slot, 0, prompt, 1)).result(10)
        engine.submit(Job(live, 0, [2, 7, 1, 8], 1)).result(10)
        with engine._wake:  # held: the fork and the steps below enter the same iteration
            branches = engine.fork(slot, 3)
            steps = [engine.submit(Job(b, len(prompt), [7 + i, 8], 2)) for i, b in enumerate(branches)]
            steps.append(engine.submit(Job(live, 4, [1], 1)))
        for i, step in enumerate(steps):
            assert step.result(10).future.done(), i
        assert {*branches, live} in forward.batches  # branches and a live session in one forward
        assert engine.resolve(slot, branches[1], [branches[0], branches[2]]).result(10)
        job = engine.submit(Job(slot, len(prompt) + 2, [1], 1)).result(10)
        assert job.start == len(prompt) + 3
        # A branch whose step is cancelled before it runs, and released: nothing is left of it
        (branch,) = engine.fork(slot, 1)
        engine.submit(Job(branch, job.start, [4, 4, 4, 4, 4], 1)).cancel()
        engine.release(branch)
        engine.release(slot)
        engine.release(live)
        assert wait_until(lambda: store.used_blocks == 0 and store.reserved_blocks == 0)
    finally:
        engine.stop()
    serial = Engine(SerialForward(target, _store()), EngineLimits(batch_hold_fraction=0.0), "test")
    with pytest.raises(ServiceError) as error:
        serial.fork(0, 2)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and "chains only" in error.value.message
    serial.start()
    try:  # a tree step fails alone, at its entry: the fallback's forward never sees it
        serial.submit(Job(0, 0, [3, 1, 4], 1)).result(10)
        with pytest.raises(ServiceError) as error:
            serial.submit(Job(0, 3, [1, 5], 2, parents=(-1, 0))).result(10)
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and "chains only" in error.value.message
        assert serial.submit(Job(0, 3, [1], 1)).result(10).start == 4
    finally:
        serial.stop()


def test_a_dropped_branchs_next_step_fails_and_a_resolve_to_it_empties_the_session():
    target, _ = build(FAMILIES["llama"])
    store = _store(block_tokens=4, max_tokens=1024, budget=40)  # 10 blocks
    engine = Engine(BatchedForward(target, store), EngineLimits(batch_hold_fraction=0.0), "test")
    engine.start()
    try:
        slot, other = engine.slots.lease(), engine.slots.lease()
        engine.submit(Job(slot, 0, list(range(1, 15)), 1)).result(10)  # 4 blocks, the last partial
        (branch,) = engine.fork(slot, 1)
        engine.submit(Job(branch, 14, [1, 2, 3, 4], 1)).result(10)  # its copy and one more
        engine.submit(Job(other, 0, list(range(40, 60)), 1)).result(10)  # 5 blocks: only if the branch goes
        with pytest.raises(ServiceError) as error:
            engine.submit(Job(branch, 18, [5], 1)).result(10)
        assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "dropped" in error.value.message
        assert not engine.resolve(slot, branch, []).result(10)
        assert store.length(slot) == 14  # the session keeps what it held
    finally:
        engine.stop()


def test_a_prefix_cache_hit_inside_a_fork():
    """Full blocks a branch writes are indexed like a session's: a new session that begins with the
    branch's tokens starts from them."""
    target, _ = build(FAMILIES["llama"])
    store = _store(block_tokens=4)
    forward = BatchedForward(target, store)
    with torch.inference_mode():
        forward([Row(0, 0, [1, 2, 3, 4, 5, 6], 1)])
        store.fork(0, 1)
        forward([Row(1, 6, [7, 8, 9, 10, 11], 1)])
        assert store.reuse(2, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 11) == 8


class _Recording(BatchedForward):
    """The batched forward, recording which slots each forward ran."""

    def __init__(self, model: torch.nn.Module, store: BlockStore) -> None:
        super().__init__(model, store)  # type: ignore[arg-type]
        self.batches: list[set[int]] = []

    def __call__(self, rows: list[Row]):
        self.batches.append({row.slot for row in rows})
        return super().__call__(rows)


class _Logits(Job):
    """Keeps the logits it was given."""

    logits: torch.Tensor | None = None

    def advance(self, logits: torch.Tensor) -> list[int] | None:
        self.logits = logits
        return None


def test_a_new_sessions_tree_step_reuses_its_chains_cached_prefix():
    """A session's first step with a tree after its chain (a verify after a lost session): the prefix
    cache gives part of the chain, the tree row starts past it with its parents and kept count shifted,
    and each node's logits are still the model's own."""
    target, _ = build(FAMILIES["llama"])
    store = _store(block_tokens=4)
    engine = Engine(BatchedForward(target, store), EngineLimits(batch_hold_fraction=0.0), "test")
    engine.start()
    try:
        first, second = engine.slots.lease(), engine.slots.lease()
        chain = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
        engine.submit(Job(first, 0, chain, 1)).result(10)  # indexes two whole blocks
        tokens, parents = [7, 8, 9], (-1, 0, -1)
        row_parents = (*range(-1, len(chain) - 1), *[len(chain) - 1 if p < 0 else len(chain) + p for p in parents])
        job = _Logits(second, 0, chain + tokens, len(tokens) + 1, parents=row_parents, kept=len(chain))
        done = engine.submit(job).result(10)
        assert done.reused == 8 and done.start == len(chain)
        assert done is job and job.logits is not None
        for node in range(len(tokens)):
            path = [tokens[i] for i in _path(parents, node)]
            assert torch.allclose(job.logits[node + 1], _own_logits(target, chain + path, 1)[0], atol=ATOL), node
        assert torch.allclose(job.logits[0], _own_logits(target, chain, 1)[0], atol=ATOL)
        engine.release(first)
        engine.release(second)
        assert wait_until(lambda: store.used_blocks == 0 and store.reserved_blocks == 0)
    finally:
        engine.stop()
