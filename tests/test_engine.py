"""The engine: one forward per iteration over every ready job, chunked prefill, cancellation, limits."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from model_host.batching import chunk_tokens, group_ends
from model_host.engine import Engine
from model_host.forward import Forward, RowLogits
from model_host.job import EngineLimits, Job
from model_host.kv_blocks import BlockStore
from model_host.profile import forward_costs, overhead_tokens, profile_shapes
from model_host.rows import Row
from serving.errors import ServiceError
from tests.conftest import wait_until

VOCAB = 5


class FakeForward(Forward):
    """Records every batch; logits say which slot and position produced them."""

    def __init__(self, delay_s: float = 0.0, fail_on_slot: int | None = None) -> None:
        self.store = BlockStore(torch.device("cpu"), torch.float32, 4096)  # the books alone: nothing is paged
        self.batches: list[list[Row]] = []
        self.delay_s = delay_s
        self.fail_on_slot = fail_on_slot

    def __call__(self, rows: list[Row]) -> RowLogits:
        self.batches.append(rows)
        time.sleep(self.delay_s)
        if any(row.slot == self.fail_on_slot for row in rows):
            raise RuntimeError("boom")
        out: RowLogits = []
        for row in rows:
            ends = torch.arange(row.start + len(row.token_ids) - row.num_logits, row.start + len(row.token_ids))
            out.append(ends[:, None].float().expand(-1, VOCAB).clone() if row.num_logits else None)
        return out


class Countdown(Job):
    """Feeds its tokens, then asks for `more` single tokens, one per iteration."""

    more: int = 0
    last_logits: torch.Tensor | None = None

    def advance(self, logits: torch.Tensor) -> list[int] | None:
        self.last_logits = logits
        if self.more:
            self.more -= 1
            return [1]
        return None


def _engine(forward: FakeForward, overhead_tokens: float = 32.0, **limits) -> Engine:
    engine = Engine(forward, EngineLimits(batch_hold_fraction=0.0, **limits), "test", overhead_tokens)
    engine.start()
    return engine


def test_a_long_feed_is_chunked_and_its_logits_come_from_the_lastchunk_tokens():
    assert chunk_tokens(20, 3, 8) == 8 and chunk_tokens(5, 3, 8) == 5 and chunk_tokens(10, 9, 8) == 1
    forward = FakeForward()
    engine = _engine(forward, prefill_chunk_tokens=8, max_batch_tokens=64)
    try:
        job = Countdown(slot=0, start=0, pending=list(range(20)), num_logits=3)
        done = engine.submit(job).result(5)
        assert isinstance(done, Countdown) and done.last_logits is not None
        assert [len(b[0].token_ids) for b in forward.batches] == [8, 8, 4]
        assert [b[0].num_logits for b in forward.batches] == [0, 0, 3]
        assert done.start == 20 and done.last_logits[:, 0].tolist() == [17.0, 18.0, 19.0]
    finally:
        engine.stop()


def test_jobs_that_arrive_during_a_forward_share_the_next_one():
    forward = FakeForward(delay_s=0.05)
    engine = _engine(forward)
    try:
        first = engine.submit(Countdown(slot=0, start=0, pending=[1], num_logits=1))
        time.sleep(0.01)  # the first forward is running
        later = [engine.submit(Countdown(slot=s, start=0, pending=[1, 2], num_logits=1)) for s in (1, 2, 3)]
        for future in [first, *later]:
            future.result(5)
        assert [sorted(r.slot for r in b) for b in forward.batches] == [[0], [1, 2, 3]]
    finally:
        engine.stop()


def test_decoding_rows_are_not_padded_to_a_prefills_width():
    forward = FakeForward(delay_s=0.02)
    engine = _engine(forward, prefill_chunk_tokens=64, max_batch_tokens=256)
    try:
        blocker = engine.submit(Countdown(slot=9, start=0, pending=[1], num_logits=1))
        time.sleep(0.005)
        futures = [
            engine.submit(Countdown(slot=0, start=0, pending=list(range(60)), num_logits=1)),
            engine.submit(Countdown(slot=1, start=5, pending=[1, 2], num_logits=2)),
        ]
        for future in [blocker, *futures]:
            future.result(5)
        widths = [sorted(len(r.token_ids) for r in b) for b in forward.batches[1:]]
        assert widths == [[2], [60]]  # two forwards in one iteration: narrow rows, then the wide one
    finally:
        engine.stop()


@pytest.mark.parametrize(("overhead", "forwards"), [(4.0, [[1] * 15, [12]]), (1000.0, [[1] * 15 + [12]])])
def test_a_wide_row_gets_a_forward_of_its_own_where_padding_to_it_costs_more(overhead, forwards):
    """A draft catching up 12 tokens among 15 one-token rows: one forward pads all 16 rows to 12 tokens.
    Where a forward costs little beyond its tokens (CPU) that is dearer than a second forward; where
    it costs the same at 1 and 200 tokens (GPU), one forward is cheaper."""
    forward = FakeForward(delay_s=0.02)
    engine = _engine(forward, overhead, max_batch_size=32)
    try:
        blocker = engine.submit(Countdown(slot=31, start=0, pending=[1], num_logits=1))
        time.sleep(0.005)
        futures = [engine.submit(Countdown(slot=s, start=4, pending=[1], num_logits=1)) for s in range(15)]
        futures.append(engine.submit(Countdown(slot=15, start=4, pending=list(range(12)), num_logits=1)))
        for future in [blocker, *futures]:
            future.result(5)
        assert [sorted(len(r.token_ids) for r in b) for b in forward.batches[1:]] == forwards
    finally:
        engine.stop()


def test_rows_are_grouped_into_forwards_at_the_least_padded_cost():
    # cost of a forward: overhead + rows x widest row
    assert group_ends([1] * 15 + [30], 20.0) == [15, 16]  # 35 + 50 against 20 + 480
    assert group_ends([1] * 15 + [3], 40.0) == [16]  # 40 + 48 against 55 + 43
    assert group_ends([1, 1, 3, 3, 3, 60, 512], 27.0) == [5, 6, 7]
    assert group_ends([2, 2, 2], 0.0) == [3]  # splits only between distinct widths
    assert group_ends([], 27.0) == []


def test_a_forwards_overhead_in_tokens_comes_from_the_measured_curve():
    cpu = [(1, 0.0070), (8, 0.0088), (16, 0.0108), (32, 0.0148), (160, 0.0468)]  # 6.75 ms + 0.25 ms a token
    assert overhead_tokens(cpu, 32.0) == pytest.approx(27.0, rel=0.02)
    assert overhead_tokens([(1, 0.010), (64, 0.010), (256, 0.0101)], 32.0, most=4096.0) == 4096.0  # GPU-like
    assert overhead_tokens([(1, 0.010), (8, 0.009)], 32.0, most=4096.0) == 4096.0  # no growth
    assert overhead_tokens([(4, 0.010)], 32.0) == 32.0  # one size says nothing


def test_a_draft_like_job_takes_one_iteration_per_token_beside_others():
    forward = FakeForward()
    engine = _engine(forward)
    try:
        job = Countdown(slot=0, start=3, pending=[7], num_logits=1)
        job.more = 3
        assert engine.submit(job).result(5).start == 3 + 1 + 3
        assert len(forward.batches) == 4
    finally:
        engine.stop()


class QueuedForward(FakeForward):
    """A forward that returns before the device has run it, as CUDA's does: the device takes
    `device_s` more, which only `synchronize` waits for."""

    def __init__(self, device_s: float) -> None:
        super().__init__()
        self.device_s = device_s

    def synchronize(self) -> None:
        time.sleep(self.device_s)


def test_a_forward_is_timed_until_the_device_has_run_it():
    """The step timing every reply carries (and the engine's metrics) must include the device's work,
    or load-aware K would price a GPU forward at its launch."""
    engine = _engine(QueuedForward(device_s=0.05))
    try:
        job = Countdown(slot=0, start=0, pending=[1, 2], num_logits=1)
        engine.submit(job).result(timeout=5)
        assert job.forward_seconds >= 0.05
    finally:
        engine.stop()


def test_the_cost_curve_times_forwards_until_the_device_has_run_them():
    points = forward_costs(QueuedForward(device_s=0.01), VOCAB, [1, 2], (1,))
    assert [tokens for tokens, _ in points] == [1, 2]
    assert all(seconds >= 0.01 for _, seconds in points)


def test_on_an_accelerator_the_curve_reaches_the_largest_verify_of_the_largest_batch():
    """A GPU's curve is flat to its ridge point (about 300 tokens for an 8B model on an H100); timed only
    to 32 rows of 5 tokens (160), it would never show where rows start to cost. The CPU's stays as it was."""
    batch_sizes, widths = profile_shapes("cuda:0", "target", 128, 16)
    assert batch_sizes[-1] == 128 and max(widths) == 17 and 64 in batch_sizes
    assert profile_shapes("cuda", "target", 48, 4) == ([1, 2, 4, 8, 16, 32, 48], (1, 3, 5))
    assert profile_shapes("cuda:0", "draft", 128, 16)[1] == (1,)  # a draft step feeds a token a forward
    assert profile_shapes("cpu", "target", 128, 16) == ([1, 2, 4, 8, 16, 32], (1, 3, 5))


class ClockedForward(FakeForward):
    """A forward on a fake clock: 8 ms + 0.25 ms a token fed, and 20 ms more in each of the calls
    numbered in `slow` (a burst of noise, as a pair's start-up beside this one's)."""

    def __init__(self, slow: range) -> None:
        super().__init__()
        self.now = 0.0
        self.slow = slow

    def __call__(self, rows: list[Row]) -> RowLogits:
        self.now += 0.008 + 0.00025 * sum(len(row.token_ids) for row in rows)
        self.now += 0.020 if len(self.batches) in self.slow else 0.0
        return super().__call__(rows)


def test_a_burst_of_noise_at_start_up_does_not_tilt_the_cost_curve(monkeypatch):
    """A burst as long as many back-to-back forwards (here the 39 after the prefix: the first round
    and part of the second) must not bend the line load-aware K prices rows by: each shape keeps its
    fastest over rounds. (A median of three back-to-back timings per shape did not.)"""
    forward = ClockedForward(slow=range(1, 40))
    monkeypatch.setattr("model_host.profile.time.perf_counter", lambda: forward.now)
    points = forward_costs(forward, VOCAB, *profile_shapes("cpu", "target", 32, 16))
    assert len(points) == 18  # no two shapes feed as many tokens
    for tokens, seconds in points:
        assert seconds == pytest.approx(0.008 + 0.00025 * tokens), tokens
    assert overhead_tokens(points, 0.0) == pytest.approx(32.0)


def test_only_a_cuda_device_is_waited_for(monkeypatch):
    waited: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", waited.append)
    forward = FakeForward()
    forward.synchronize()  # the CPU runs a forward before it returns
    forward.device = torch.device("cuda", 1)
    forward.synchronize()
    assert waited == [torch.device("cuda", 1)]


def test_limits_a_failing_batch_and_a_cancelled_job():
    forward = FakeForward(delay_s=0.05, fail_on_slot=1)
    engine = _engine(forward, max_batch_size=2)
    try:
        blocker = engine.submit(Countdown(slot=0, start=0, pending=[1], num_logits=1))
        time.sleep(0.01)
        cancelled = Countdown(slot=5, start=0, pending=[1], num_logits=1)
        engine.submit(cancelled)
        assert cancelled.future.cancel()  # still queued: it never runs
        failing = engine.submit(Countdown(slot=1, start=0, pending=[1], num_logits=1))
        blocker.result(5)
        with pytest.raises(ServiceError) as error:
            failing.result(5)
        assert error.value.code == grpc.StatusCode.INTERNAL and "boom" in error.value.message
        assert all(r.slot != 5 for b in forward.batches for r in b)
        assert engine.submit(Countdown(slot=2, start=0, pending=[1], num_logits=1)).result(5)  # still serving
    finally:
        engine.stop()


def test_a_step_that_waits_too_long_is_refused_as_busy():
    forward = FakeForward(delay_s=0.2)
    engine = _engine(forward, max_batch_size=1, max_queue_wait_s=0.05)
    try:
        first = engine.submit(Countdown(slot=0, start=0, pending=[1], num_logits=1))
        second = engine.submit(Countdown(slot=1, start=0, pending=[1], num_logits=1))
        first.result(5)
        with pytest.raises(ServiceError) as error:
            second.result(5)
        assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "busy" in error.value.message
    finally:
        engine.stop()


@pytest.mark.parametrize("straight_back", [True, False], ids=["next-step-at-once", "drafts-first"])
def test_the_hold_gathers_sessions_that_come_back_together(straight_back):
    """Sessions that stepped together come back a little apart; the engine waits for them (bounded).
    Sessions whose step said they draft before coming back (a speculative verify) are not waited for:
    the draft and the target should compute at once, not take turns."""
    forward = FakeForward(delay_s=0.02)
    engine = Engine(forward, EngineLimits(batch_hold_fraction=0.9), "test")
    engine.start()
    try:
        futures = [
            engine.submit(Countdown(slot=s, start=0, pending=[1], num_logits=1, comes_straight_back=straight_back))
            for s in range(4)
        ]
        for future in futures:
            future.result(5)
        forward.batches.clear()
        results = []

        def step(slot: int) -> None:
            time.sleep(0.003 * slot)  # the orchestrator answers them one after another
            results.append(engine.submit(Countdown(slot=slot, start=1, pending=[1], num_logits=1)).result(5))

        threads = [threading.Thread(target=step, args=(s,)) for s in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(results) == 4
        if straight_back:
            assert [len(b) for b in forward.batches] == [4]
        else:
            assert len(forward.batches) > 1, forward.batches  # the first one started without waiting
    finally:
        engine.stop()


class IdleCounting(FakeForward):
    def __init__(self) -> None:
        super().__init__()
        self.idles = 0
        self.released: list[int] = []

    def idle(self) -> None:
        self.idles += 1

    def release(self, slot: int) -> None:
        self.released.append(slot)
        super().release(slot)


def test_kept_buffers_survive_gaps_between_steps_and_go_after_the_last_session():
    """Between a session's steps the engine has nothing to run, but the session's next step will reuse
    what the last forward kept (dropping it cost the target alone 20% at 32 streams); once no session
    holds a slot it goes."""
    forward = IdleCounting()
    engine = _engine(forward)
    try:
        slot = engine.slots.lease()
        engine.submit(Countdown(slot, 0, [1], 1)).result(5)
        before = forward.idles  # the engine may have idled before the slot was leased
        for start in range(1, 4):
            time.sleep(0.05)  # the gap before the next step: the engine has nothing to run
            engine.submit(Countdown(slot, start, [1], 1)).result(5)
        assert forward.idles == before
        engine.release(slot)
        assert wait_until(lambda: forward.released == [slot] and forward.idles >= 1, timeout_s=5)
    finally:
        engine.stop()


def test_a_slot_released_twice_is_given_back_once():
    """A fork's branch that its owner releases and a resolve also ends: two sessions must never be
    leased the same slot."""
    from model_host.slots import SlotAllocator

    slots = SlotAllocator()
    first, second = slots.lease(), slots.lease()
    slots.release(first)
    slots.release(first)
    assert slots.recycle() == [first] and slots.leased() == 1
    assert {slots.lease(), slots.lease()} == {first, second + 1}


def test_a_malformed_tree_step_fails_alone_and_the_forward_runs_the_others():
    forward = FakeForward(delay_s=0.05)
    engine = _engine(forward)
    try:
        with engine._wake:  # one iteration enters all three
            good = engine.submit(Countdown(slot=0, start=0, pending=[1, 2, 3], num_logits=1))
            looping = engine.submit(Countdown(slot=1, start=4, pending=[1, 2], num_logits=2, parents=(1, -1)))
            rootless = engine.submit(Countdown(slot=2, start=0, pending=[1, 2], num_logits=2, parents=(-1, 0)))
        assert good.result(5).start == 3
        for step, words in ((looping, "earlier token"), (rootless, "cached prefix")):
            with pytest.raises(ServiceError) as error:
                step.result(5)
            assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in error.value.message
        assert all(row.slot == 0 for batch in forward.batches for row in batch)
    finally:
        engine.stop()


def test_before_advance_sees_each_forwards_fed_jobs_and_a_failure_leaves_each_to_its_own_row():
    forward = FakeForward(delay_s=0.05)
    engine = _engine(forward, prefill_chunk_tokens=4)
    seen: list[list[tuple[int, float]]] = []

    def before_advance(fed: list[tuple[Job, torch.Tensor]]) -> None:
        seen.append([(job.slot, float(logits[-1, 0])) for job, logits in fed])
        if len(seen) == 1:
            raise RuntimeError("boom")  # logged; the jobs advance on their own rows

    engine.before_advance = before_advance
    try:
        blocker = engine.submit(Countdown(slot=9, start=0, pending=[1], num_logits=1))
        time.sleep(0.005)  # the next two enter together, during the blocker's forward
        short = Countdown(slot=0, start=3, pending=[7], num_logits=1)
        long = Countdown(slot=1, start=0, pending=list(range(6)), num_logits=1)  # two chunks
        short.more = 1
        futures = [engine.submit(short), engine.submit(long)]
        assert blocker.result(5) and all(f.result(5) for f in futures)
        # The blocker's forward (its hook failed, it advanced all the same), then the short job with the long
        # one's first chunk, which is not fed yet; then each with its last row.
        assert seen[0] == [(9, 0.0)]
        assert seen[1] == [(0, 3.0)]
        assert sorted(seen[2]) == [(0, 4.0), (1, 5.0)]
        assert short.last_logits is not None and float(short.last_logits[-1, 0]) == 4.0
    finally:
        engine.stop()
