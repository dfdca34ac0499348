"""A request's draft steps as the step times see them: by the draft's own forwards, whatever the block."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from orchestrator.context import Context
from orchestrator.drafting import Drafter
from orchestrator.goodput import StepTimes
from orchestrator.proposals import NO_DRAFT, Stats
from specdec.v1 import common_pb2, draft_pb2

FLAT = [(1, 0.002), (8, 0.002)]  # the draft's start-up curve: 2 ms a forward


class _Stream:
    """A draft session that answers every step with `drafted` tokens in 4 forwards' time (8 ms)."""

    def __init__(self, drafted: list[int]) -> None:
        timing = common_pb2.Timing(forward_seconds=0.008, batch_size=1, batch_tokens=1)
        self.response = draft_pb2.DraftResponse(draft_token_ids=drafted, timing=timing)

    async def step(self, context, build, fed_beyond=None):  # type: ignore[no-untyped-def]
        return SimpleNamespace(response=self.response, fed=len(context))


class _Translation:
    """SLEM's re-tokenization, fixed: the draft's 4 tokens spell `target_ids` in the target's."""

    def __init__(self, target_ids: list[int]) -> None:
        self.target_ids = target_ids

    def retokenized(self, draft_ids: list[int]) -> list[int]:
        return self.target_ids


def _drafter(target_ids: list[int], times: StepTimes) -> Drafter:
    limits = SimpleNamespace(translation=None, vocab_size=100, draft_vocab_size=0)
    fields = SimpleNamespace(request=SimpleNamespace(sampling=SimpleNamespace(greedy=True)), limits=limits)
    drafter = Drafter(_Stream([5, 6, 7, 8]), SimpleNamespace(), fields, Stats(), times)  # type: ignore[arg-type]
    limits.translation, fields.string_match = _Translation(target_ids), True
    return drafter


@pytest.mark.parametrize("target_ids", [[11], [11, 12, 13, 14, 15, 16], []])
def test_a_re_tokenized_block_is_priced_by_the_drafts_forwards(target_ids):
    """4 draft tokens in 8 ms are 2 ms a forward, shared with every request's pricing, whether their text
    re-tokenizes to 1 target token, 6 (cut to K), or none (the round verifies nothing drafted)."""
    times = StepTimes(
        common_pb2.ModelInfo(forward_costs=[common_pb2.ForwardCost(batch_tokens=1, seconds=0.01)]),
        common_pb2.ModelInfo(forward_costs=[common_pb2.ForwardCost(batch_tokens=t, seconds=s) for t, s in FLAT]),
    )
    drafter = _drafter(target_ids, times)
    block = asyncio.run(drafter.propose(Context([1, 2, 3]), k=4))
    assert drafter.stats.draft_seconds == pytest.approx(0.008)
    assert times.draft.last_stretch == pytest.approx(1.0)  # 2 ms a forward, as at start-up
    if target_ids:
        assert block.token_ids == target_ids[:4] and block.forward_seconds_per_token == pytest.approx(0.002)
    else:
        assert block is NO_DRAFT
