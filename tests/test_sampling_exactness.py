"""Sampling exactness: the first three generated tokens follow the target's exact distribution.

A tiny-vocabulary target makes the distribution of the first three tokens computable exactly
(vocab^3 outcomes). The orchestrator's real Generation loop runs 20,000 times per setting against
stand-ins for the two services that answer from the tiny models' own logits (computed once per
prefix) through the same code the services run: the draft's `choose_token`, the target's
`answer_sampled` (its first rejection and its row), and the wire form of logit rows. A smaller test
below drives the real services over gRPC.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from scipy import stats

from draft_service.jobs import choose_token
from model_host.loading import LoadedModel
from orchestrator.generation import Generation, GenerationRequest, ModelLimits
from orchestrator.k_policy import FixedK
from orchestrator.upstream import DraftAvailability, Place, Stepped
from serving.logits import logits_to_probs, rows_to_wire
from serving.sampling import SamplingParams, seeded_generator
from specdec.v1 import common_pb2, draft_pb2, orchestrator_pb2, target_pb2
from target_service.servicer import answer_sampled
from tests.conftest import collect
from tests.tiny_models import perturbed_copy, tiny_llama

VOCAB = 8
PROMPT = [1, 2, 3]
NEW_TOKENS = 3
SAMPLES = 20_000


class FixedKBesidePrefill(FixedK):
    """The fixed policy with load_aware's first round: the target's prefill alone, the draft prefilling
    beside it and drafting the next block."""

    drafts_beside_prefill = True


class LogitsTable(dict[tuple[int, ...], torch.Tensor]):
    """Next-token logits of a model for every prefix: PROMPT plus every continuation of up to
    `max_extra` tokens computed up front in batches, longer prefixes on first use. [vocab] each"""

    def __init__(self, model: torch.nn.Module, max_extra: int) -> None:
        super().__init__()
        self.model = model
        # (prefix, rows) -> the block's logits: tens of thousands of generations ask the same few hundred
        self.blocks: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}
        with torch.no_grad():
            for extra in range(max_extra + 1):
                continuations = list(itertools.product(range(VOCAB), repeat=extra))
                for start in range(0, len(continuations), 4096):
                    chunk = continuations[start : start + 4096]
                    logits = model(torch.tensor([PROMPT + list(c) for c in chunk])).logits[:, -1]
                    for continuation, row in zip(chunk, logits, strict=True):
                        self[tuple(PROMPT) + continuation] = row

    def __missing__(self, prefix: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            row = self.model(torch.tensor([list(prefix)])).logits[0, -1]
        self[prefix] = row
        return row


def _common_prefix(held: list[int], context: list[int], min_append: int) -> int:
    """What a session holding `held` keeps of `context`, feeding at least `min_append` tokens."""
    keep = 0
    while keep < min(len(held), len(context) - min_append) and held[keep] == context[keep]:
        keep += 1
    return keep


class TableTarget:
    """A target session answering from exact logits, through the target's own row processing."""

    def __init__(self, logits: LogitsTable) -> None:
        self.logits = logits
        self.seen: list[int] = []
        self.last_fed = self.reopens = self.wire_bytes = 0

    def _request(self, context: list[int], build: Callable[[int], Any], min_append: int) -> Any:
        """The request as SessionStream builds it; the tokens it leaves the session with must be `context`."""
        keep = _common_prefix(self.seen, list(context), min_append)
        request = build(keep)
        assert self.seen[: request.keep] + list(request.append_token_ids) == list(context)
        self.last_fed = len(context) - keep
        return request

    async def step(
        self, context: list[int], build: Callable[[int], Any], min_append: int = 1, fed_beyond: Any = None
    ) -> Stepped[target_pb2.VerifyResponse]:
        request = self._request(context, build, min_append)
        self.seen = list(context)
        key = (tuple(self.seen), request.num_rows)
        if key not in self.logits.blocks:
            first = len(self.seen) - request.num_rows + 1
            self.logits.blocks[key] = torch.stack(
                [self.logits[tuple(self.seen[: first + i])] for i in range(request.num_rows)]
            )
        response = target_pb2.VerifyResponse(result=common_pb2.SESSION_RESULT_OK)
        answer_sampled(response, self.logits.blocks[key], SamplingParams.from_proto(request.sampling), request)
        return Stepped(response, self.last_fed)

    def close(self) -> None:
        pass


class TableDraft(TableTarget):
    """A draft session drafting with the draft service's own `choose_token` and seeding, holding each
    step's logit rows for the orchestrator's row fetch."""

    where = Place(None, 0)

    def reachable(self, place: Place) -> bool:
        return True

    def __init__(self, logits: LogitsTable) -> None:
        super().__init__(logits)
        self.rows: dict[int, tuple[SamplingParams, torch.Tensor]] = {}  # step number -> its rows

    async def fetch(self, place: Place, fetch: draft_pb2.RowFetch) -> draft_pb2.FetchedRow:
        params, rows = self.rows[fetch.step_number]
        return draft_pb2.FetchedRow(held=True, row=rows_to_wire(rows[fetch.index : fetch.index + 1], params))

    async def step(  # type: ignore[override]
        self, context: list[int], build: Callable[[int], Any], min_append: int = 1, fed_beyond: Any = None
    ) -> Stepped[draft_pb2.DraftResponse]:  # type: ignore[override]
        request = self._request(context, build, min_append)
        sequence = list(context)
        params = SamplingParams.from_proto(request.sampling)
        generator = seeded_generator(request.seed)
        if request.num_speculative_tokens == 0:  # a row recomputed after a fetch missed
            self.seen = sequence
            row = rows_to_wire(self.logits[tuple(sequence)][None], params)
            return Stepped(draft_pb2.DraftResponse(result=common_pb2.SESSION_RESULT_OK, row=row), self.last_fed)
        tokens: list[int] = []
        token_probs: list[float] = []
        rows: list[torch.Tensor] = []
        for _ in range(request.num_speculative_tokens):
            token, probs, _ = choose_token(self.logits[tuple(sequence)], params, generator, False)
            assert probs is not None
            tokens.append(token)
            token_probs.append(float(probs[token]))
            rows.append(self.logits[tuple(sequence)])
            sequence.append(token)
        self.seen = sequence[:-1]
        self.rows[len(self.rows) + 1] = (params, torch.stack(rows))
        response = draft_pb2.DraftResponse(
            result=common_pb2.SESSION_RESULT_OK,
            draft_token_ids=tokens,
            draft_token_probs=token_probs,
            step_number=len(self.rows),
        )
        return Stepped(response, self.last_fed)


@pytest.fixture(scope="module")
def tables() -> tuple[dict, dict]:
    target = tiny_llama(VOCAB, seed=5, hidden=16, layers=1, init_range=1.0)
    draft = tiny_llama(VOCAB, seed=6, hidden=16, layers=1, init_range=1.0)  # a different model
    return LogitsTable(target, NEW_TOKENS + 2), LogitsTable(draft, NEW_TOKENS + 2)


@pytest.fixture(scope="module")
def close_table(tables: tuple[dict, dict]) -> dict:
    """A draft close to the target: blocks are often fully accepted and the bonus often guessed, so
    overlapped drafting's ready blocks are used (about half the runs), while about a quarter of draft
    tokens are still rejected."""
    target_logits = tables[0]
    assert isinstance(target_logits, LogitsTable)
    return LogitsTable(perturbed_copy(target_logits.model, 0.1, seed=7), NEW_TOKENS + 2)


def exact_distribution(
    target_logits: dict, params: SamplingParams, prompt: list[int] = PROMPT
) -> dict[tuple[int, ...], float]:
    """P(x1, x2, x3) = p(x1 | prompt) p(x2 | prompt x1) p(x3 | prompt x1 x2) under the processed rows."""

    def probs(prefix: tuple[int, ...]) -> torch.Tensor:
        return logits_to_probs(target_logits[tuple(prompt) + prefix][None], params)[0].double()

    out = {}
    for outcome in itertools.product(range(VOCAB), repeat=NEW_TOKENS):
        p = 1.0
        for i in range(NEW_TOKENS):
            p *= float(probs(outcome[:i])[outcome[i]])
        out[outcome] = p
    return out


def chi_square_pvalue(counts: Counter, expected: dict[tuple[int, ...], float], samples: int) -> float:
    """Pearson's test; outcomes expected fewer than 5 times are pooled into one cell."""
    observed, predicted, pooled_obs, pooled_exp = [], [], 0, 0.0
    for outcome, p in expected.items():
        if p * samples >= 5:
            observed.append(counts[outcome])
            predicted.append(p * samples)
        else:
            pooled_obs += counts[outcome]
            pooled_exp += p * samples
    if pooled_exp > 0:
        observed.append(pooled_obs)
        predicted.append(pooled_exp)
    predicted_arr = np.array(predicted) * (sum(observed) / sum(predicted))
    return float(stats.chisquare(np.array(observed), predicted_arr).pvalue)


async def _sample_many(
    tables: tuple[dict, dict],
    params: SamplingParams,
    k: int,
    samples: int,
    overlap: bool = False,
    prompt: list[int] = PROMPT,
    draft_method: str = "model",
    beside_prefill: bool = False,
    draft_type: type[TableDraft] = TableDraft,
) -> tuple[Counter, float]:
    """Run the real Generation loop `samples` times; counts of the first NEW_TOKENS tokens.

    With overlap, generations run longer than NEW_TOKENS so that blocks drafted during verification
    are used (a block is only drafted ahead when a later round can use it); so are the blocks drafted
    beside the prefill with `beside_prefill`. With the ngram method the
    blocks come from the prompt lookup alone, and the lookup must really have proposed."""
    target_logits, draft_logits = tables
    limits = ModelLimits(vocab_size=VOCAB, target_max_context=64, draft_max_context=64, eos_token_ids=frozenset())
    counts: Counter = Counter()
    drafted = accepted = overlapped = looked_up = 0
    for seed in range(samples):
        request = GenerationRequest(
            request_id="t",
            prompt_token_ids=prompt,
            max_new_tokens=NEW_TOKENS + 2 if overlap else NEW_TOKENS,
            sampling=params,
            seed=seed,
            num_speculative_tokens=k,
            overlap_drafting=overlap,
            min_confidence=0.0,
            draft_method=draft_method,
            ngram_min=1,
        )
        generation = Generation(
            request,
            limits,
            TableTarget(target_logits),  # type: ignore[arg-type]
            draft_type(draft_logits) if draft_method != "ngram" else None,  # type: ignore[arg-type]
            DraftAvailability(1.0),
            FixedKBesidePrefill(k, k) if beside_prefill else FixedK(k, k),
            lookup_policy=FixedK(k, k) if draft_method != "model" else None,
        )
        output: list[int] = []
        async for tokens in generation.rounds():
            output += tokens
        counts[tuple(output[:NEW_TOKENS])] += 1
        drafted += generation.stats.draft_tokens
        accepted += generation.stats.accepted_tokens
        overlapped += generation.stats.overlapped_rounds
        looked_up += generation.stats.ngram_draft_tokens
    assert (looked_up == drafted > 0) == (draft_method == "ngram"), (looked_up, drafted)
    # With overlap (or beside the prefill), blocks drafted during verification really were used (and
    # checked by the test).
    assert (overlapped > samples // 20) == (overlap or beside_prefill), overlapped
    return counts, accepted / drafted


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize(
    ("params", "k"),
    [(SamplingParams(temperature=1.0), 2), (SamplingParams(temperature=0.7, top_p=0.9), 1)],
    ids=["t1.0", "t0.7-top_p0.9"],
)
def test_first_three_tokens_follow_target_distribution(tables, close_table, params, k, overlap):
    pair = (tables[0], close_table) if overlap else tables
    counts, acceptance = asyncio.run(_sample_many(pair, params, k, SAMPLES, overlap))
    assert sum(counts.values()) == SAMPLES and all(len(o) == NEW_TOKENS for o in counts)
    # the draft is a different model: it is accepted sometimes, rejected sometimes
    assert 0.1 < acceptance < 0.95, acceptance
    pvalue = chi_square_pvalue(counts, exact_distribution(tables[0], params), SAMPLES)
    assert pvalue > 0.01, pvalue


@pytest.mark.slow
def test_blocks_drafted_beside_the_prefill_keep_the_target_distribution(tables, close_table):
    """load_aware's first round (the draft prefilling and drafting beside the target's prefill, its
    block verified in the second round when its first token guessed the prefill's)."""
    params = SamplingParams(temperature=1.0)
    counts, acceptance = asyncio.run(_sample_many((tables[0], close_table), params, 2, SAMPLES, beside_prefill=True))
    assert 0.1 < acceptance < 0.95, acceptance
    pvalue = chi_square_pvalue(counts, exact_distribution(tables[0], params), SAMPLES)
    assert pvalue > 0.01, pvalue


class SlowPrefillDraft(TableDraft):
    """A draft whose first step (its prefill of the prompt) takes `seconds`."""

    def __init__(self, logits: LogitsTable, seconds: float) -> None:
        super().__init__(logits)
        self.seconds = seconds
        self.steps = 0

    async def step(self, *args: Any, **kwargs: Any) -> Stepped[draft_pb2.DraftResponse]:  # type: ignore[override]
        self.steps += 1
        if self.steps == 1:
            await asyncio.sleep(self.seconds)
        return await super().step(*args, **kwargs)


class WallTimes(FixedKBesidePrefill):
    def __init__(self, k: int) -> None:
        super().__init__(k, k)
        self.walls: list[float] = []

    def observe_wall(self, k: int, seconds: float, *args: Any, **kwargs: Any) -> None:
        self.walls.append(seconds)


def test_the_drafts_prefill_beside_the_targets_prices_no_round(tables, close_table):
    """The second round starts by waiting for the block drafted beside the prefill; that wait is the
    prefill's, which prices no round (as the first round's prefill does not)."""
    limits = ModelLimits(vocab_size=VOCAB, target_max_context=64, draft_max_context=64, eos_token_ids=frozenset())
    request = GenerationRequest(
        request_id="t",
        prompt_token_ids=PROMPT,
        max_new_tokens=8,
        sampling=SamplingParams(temperature=1.0),
        seed=1,
        num_speculative_tokens=2,
        overlap_drafting=False,
        min_confidence=0.0,
    )
    policy = WallTimes(2)
    draft = SlowPrefillDraft(close_table, seconds=0.3)
    generation = Generation(
        request,
        limits,
        TableTarget(tables[0]),  # type: ignore[arg-type]
        draft,  # type: ignore[arg-type]
        DraftAvailability(1.0),
        policy,
    )

    async def run() -> list[int]:
        return [token async for tokens in generation.rounds() for token in tokens]

    assert len(asyncio.run(run())) == 8
    assert draft.steps >= 2 and policy.walls, (draft.steps, policy.walls)
    assert max(policy.walls) < 0.15, policy.walls


@pytest.mark.slow
def test_prompt_lookup_proposals_keep_the_target_distribution(tables):
    """Point-mass proposals from the lookup (a prompt that repeats itself, so lookups really happen,
    and a target that accepts them only sometimes): still the target's distribution."""
    params, prompt = SamplingParams(temperature=1.0), [1, 2, 1, 2, 1]
    counts, acceptance = asyncio.run(_sample_many(tables, params, 2, SAMPLES, prompt=prompt, draft_method="ngram"))
    assert 0.1 < acceptance < 0.95, acceptance
    pvalue = chi_square_pvalue(counts, exact_distribution(tables[0], params, prompt), SAMPLES)
    assert pvalue > 0.01, pvalue


class ForgetfulDraft(TableDraft):
    """A draft that never holds a row when asked (its session lost them): every rejection recomputes."""

    recomputed = 0

    async def fetch(self, place: Place, fetch: draft_pb2.RowFetch) -> draft_pb2.FetchedRow:
        ForgetfulDraft.recomputed += 1
        return draft_pb2.FetchedRow(held=False)


class VanishingDraft(TableDraft):
    """A draft whose replica is gone at every other target answer: those rounds are redone by the target
    alone, decided before their verdicts are read."""

    asked = 0

    def reachable(self, place: Place) -> bool:
        VanishingDraft.asked += 1
        return VanishingDraft.asked % 2 == 0


def test_a_row_the_draft_no_longer_holds_is_recomputed_to_the_same_outputs(tables, close_table):
    """Recomputing the draft's row at a rejection gives the row it was fetched as: the same seeds give
    the same outputs whichever way the rows came."""
    params, samples = SamplingParams(temperature=1.0), 300
    fetched, _ = asyncio.run(_sample_many((tables[0], close_table), params, 3, samples, overlap=True))
    recomputed, _ = asyncio.run(
        _sample_many((tables[0], close_table), params, 3, samples, overlap=True, draft_type=ForgetfulDraft)
    )
    assert ForgetfulDraft.recomputed > 50
    assert recomputed == fetched


@pytest.mark.slow
def test_rounds_redone_without_the_draft_keep_the_target_distribution(tables, close_table):
    params = SamplingParams(temperature=1.0)
    counts, _ = asyncio.run(
        _sample_many((tables[0], close_table), params, 2, SAMPLES, overlap=True, draft_type=VanishingDraft)
    )
    assert VanishingDraft.asked > SAMPLES
    pvalue = chi_square_pvalue(counts, exact_distribution(tables[0], params), SAMPLES)
    assert pvalue > 0.01, pvalue


class MisjudgingTarget(TableTarget):
    """A target replica whose first rejection is not the acceptance function's (a bug, or a faulty
    replica): one position later than the truth whenever that is possible."""

    resets = 0

    async def step(self, *args: Any, **kwargs: Any) -> Stepped[target_pb2.VerifyResponse]:  # type: ignore[override]
        stepped = await super().step(*args, **kwargs)
        response = target_pb2.VerifyResponse()
        response.CopyFrom(stepped.response)
        if response.num_accepted < len(response.draft_token_target_probs):
            response.num_accepted += 1
        return Stepped(response, stepped.fed)

    def reset(self) -> None:
        MisjudgingTarget.resets += 1


def test_a_target_whose_first_rejection_differs_fails_the_request_as_internal(tables, close_table):
    from serving.errors import ServiceError

    limits = ModelLimits(vocab_size=VOCAB, target_max_context=64, draft_max_context=64, eos_token_ids=frozenset())
    failures = 0
    for seed in range(20):
        request = GenerationRequest("t", PROMPT, 6, SamplingParams(temperature=1.0), seed, 3, False, 0.0)
        generation = Generation(
            request,
            limits,
            MisjudgingTarget(tables[0]),  # type: ignore[arg-type]
            TableDraft(close_table),  # type: ignore[arg-type]
            DraftAvailability(1.0),
            FixedK(3, 3),
        )

        async def run(generation: Generation = generation) -> None:
            async for _ in generation.rounds():
                pass

        try:
            asyncio.run(run())
        except ServiceError as exc:
            assert exc.code == grpc.StatusCode.INTERNAL and "first rejection" in exc.message
            failures += 1
    assert failures > 10 and MisjudgingTarget.resets == failures  # the replica is avoided each time


def test_the_check_detects_a_wrong_distribution(tables):
    """Power check: the draft's own distribution is told apart from the target's by the same test."""
    params = SamplingParams(temperature=1.0)
    target_logits, draft_logits = tables
    counts, _ = asyncio.run(_sample_many((draft_logits, draft_logits), params, 2, 5_000))
    assert chi_square_pvalue(counts, exact_distribution(target_logits, params), 5_000) < 1e-6


def test_same_seed_same_output_over_grpc(orchestrators):
    """The contract is the fixed policy's: under load_aware (the default) K follows the load, and a
    different K consumes the random stream differently."""
    stub = orchestrators["close"].stub
    request = orchestrator_pb2.GenerateRequest(
        text="w3 w4",
        max_new_tokens=30,
        temperature=0.9,
        top_p=0.95,
        seed=42,
        num_speculative_tokens=3,
        speculation_policy=orchestrator_pb2.SPECULATION_POLICY_FIXED,
    )
    first, _, _ = collect(stub, request)
    second, _, _ = collect(stub, request)
    request.seed = 43
    other, _, _ = collect(stub, request)
    assert first == second
    assert first != other


def test_a_sampled_round_moves_at_most_two_rows(orchestrators, target_model):
    """Of a sampled round's rows only two travel: the target's at the first rejection (or the bonus
    row), and the draft's there, fetched on a rejection; none of the block drafted ahead under overlap.
    A greedy round still moves ids alone."""
    row_bytes = 4 * target_model.vocab_size  # float32 logits
    request = orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=[5, 6, 7]),
        max_new_tokens=40,
        temperature=1.0,
        seed=3,
        num_speculative_tokens=4,
        speculation_policy=orchestrator_pb2.SPECULATION_POLICY_FIXED,
        overlap_drafting=True,
    )
    _, _, last = collect(orchestrators["close"].stub, request)
    stats = last.stats
    assert stats.draft_tokens > stats.accepted_tokens > 0 and stats.overlapped_rounds > 0
    # Dense rows were 2K + 1 of them, and K + 1 more drafted ahead: over 9 rows a round at K = 4.
    assert stats.wire_bytes < stats.rounds * (2 * row_bytes + 1024), stats.wire_bytes / stats.rounds / row_bytes
    request.temperature = 0.0
    _, _, greedy = collect(orchestrators["close"].stub, request)
    assert greedy.stats.wire_bytes < greedy.stats.rounds * 1024


def first_token_pvalue(counts: Counter[int], probs: torch.Tensor, samples: int) -> float:
    """The chi-square p-value of first tokens' `counts` against a distribution, probs [vocab]."""
    expected: dict[tuple[int, ...], float] = {(t,): float(p) for t, p in enumerate(probs.double())}
    return chi_square_pvalue(Counter({(t,): c for t, c in counts.items()}), expected, samples)


def target_first_token_probs(model: LoadedModel, prompt: list[int]) -> torch.Tensor:
    """The target's distribution of the token after `prompt`, [vocab]."""
    with torch.no_grad():
        return model.model(torch.tensor([prompt])).logits[0, -1].softmax(-1)


def first_tokens_pvalue(
    model: LoadedModel, prompt: list[int], first_token: Callable[[int], int], samples: int, concurrency: int = 8
) -> float:
    """The chi-square p-value of `first_token(seed)` for seeds 0 .. samples - 1, `concurrency` at a time,
    against the target's distribution after `prompt`."""
    with ThreadPoolExecutor(concurrency) as pool:
        counts: Counter[int] = Counter(pool.map(first_token, range(samples)))
    return first_token_pvalue(counts, target_first_token_probs(model, prompt), samples)


def first_token_request(prompt: list[int], seed: int, **fields: Any) -> orchestrator_pb2.GenerateRequest:
    """A sampled request whose first token is the one the test counts (its first round drafts 1 token).
    The fixed policy, unless the test names one: load_aware may choose K = 0 under the test's own load
    (the services share this machine's cores), and the acceptance rule would go untested."""
    fields.setdefault("speculation_policy", orchestrator_pb2.SPECULATION_POLICY_FIXED)
    return orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=prompt),
        max_new_tokens=2,
        temperature=1.0,
        seed=seed,
        num_speculative_tokens=1,
        **fields,
    )


@pytest.mark.parametrize("concurrency", [1, 8, 64])
def test_real_services_first_token_distribution(orchestrators, target_model, concurrency):
    """Through real gRPC services, one client, 8 and 64 at a time (batched over one link per service;
    the test services hold 16 sessions, so of 64 clients 16 generate and the rest queue in the
    orchestrator): the first generated token follows the target's distribution."""
    samples = 600
    prompt = [5, 6, 7]
    stub = orchestrators["random"].stub

    def first_token(seed: int) -> int:
        return collect(stub, first_token_request(prompt, seed))[0][0]

    pvalue = first_tokens_pvalue(target_model, prompt, first_token, samples, concurrency)
    assert pvalue > 0.01, pvalue
