"""The draft's speculation cache (draft_service/speculation.py): blocks drafted ahead for a step's
likely verdicts while the target verifies it.

- A block drafted ahead is the block a fresh step for that verdict drafts: the same tokens and q, and
  the same rows for a RowFetch, for a rejection's guess and for a whole block's bonus guess.
- Greedy: identity with the target alone at K = 4 and 8, with hits and misses.
- Sampling: the joint distribution of two tokens generated after hits follows the target's, at 8
  concurrent streams, with hits after rejections and after whole blocks, and misses.
- A seed reproduces, hit or miss: the same outputs whether a rejection's next block came from the
  cache or was drafted at the step (the fixed policy).
- Its tokens stay within --speculation-cache-tokens, branches yield to live sessions' blocks, and
  everything it held is freed when the sessions end.

The cost rule decides how far the cache fans out from the draft's measured forward cost; on this
CPU it launches few entries, so most tests set the engine's overhead as a GPU's memory-bound forward
has it (`_fan_out`), where every candidate pays.
"""

from __future__ import annotations

import itertools
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from draft_service.jobs import DraftJob, GuessingDraftJob, read_rows
from draft_service.servicer import DraftServicer
from draft_service.speculation import SpeculationCache
from model_host.job import Job
from model_host.loading import LoadedModel
from model_host.runtime import ModelServer
from serving.tensors import tensor_from_proto
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, orchestrator_pb2
from tests.conftest import RawSession, collect, hf_greedy, wait_until
from tests.servers import LOOPBACK, OrchestratorThread, load, orchestrator_config, start_draft, start_target
from tests.test_sampling_exactness import chi_square_pvalue
from tests.tiny_models import perturbed_copy, save, tiny_llama, word_tokenizer

SEED_BASE = 0x1234_5678_9ABC_DEF0
_U64 = (1 << 64) - 1


def _fan_out(server: ModelServer) -> list[int]:
    """Price a forward as a GPU's memory-bound one, on a device of the draft's own: every candidate
    verdict pays for its entry; and read a forward's greedy rows together, as a draft on a device does.
    Returns the count of rows read together (one number, growing)."""
    server.servicer.engine.overhead_tokens = 1e6
    _cache(server).fans_out = True
    together = [0]

    def read_together(fed: list[tuple[Job, torch.Tensor]]) -> None:
        read_rows(fed)
        together[0] += sum(isinstance(job, DraftJob) and job.prepared is not None for job, _ in fed)

    server.servicer.engine.before_advance = read_together
    return together


def _cache(server: ModelServer) -> SpeculationCache:
    servicer = server.servicer
    assert isinstance(servicer, DraftServicer) and servicer.speculation is not None
    return servicer.speculation


def _drafted_ahead(cache: SpeculationCache) -> bool:
    """Wait until the last step's entries are launched (after its answer) and drafted."""
    return wait_until(lambda: bool(cache._entries) and cache.running() == 0)


def _step(keep: int, append: list[int], k: int, temperature: float, speculate: int = 0) -> draft_pb2.DraftRequest:
    n = keep + len(append)
    request = draft_pb2.DraftRequest(
        request_id="spec",
        keep=keep,
        append_token_ids=append,
        num_speculative_tokens=k,
        sampling=common_pb2.SamplingParams(temperature=temperature),
        seed=(SEED_BASE + n) & _U64,
    )
    if speculate:
        request.speculate.CopyFrom(draft_pb2.Speculate(next_k=speculate, seed_base=SEED_BASE))
    return request


@pytest.fixture(scope="module")
def drafts(close_draft_model: LoadedModel):
    """The close draft with the cache (fanning out) and without it."""
    cached, plain = start_draft(close_draft_model), start_draft(close_draft_model, speculation_cache_tokens=0)
    _fan_out(cached)
    yield cached, plain
    cached.stop()
    plain.stop()


def _session(server: ModelServer) -> tuple[RawSession, grpc.Channel]:
    channel = grpc.insecure_channel(f"{LOOPBACK}:{server.port}")
    return RawSession(draft_pb2_grpc.DraftServiceStub(channel).Draft), channel


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_block_drafted_ahead_is_the_block_a_fresh_step_drafts(drafts, temperature):
    """Every verdict the cache drafted for is replayed: on the cached service the step is answered from
    the entry, on the plain one drafted anew; tokens, q and the rows a RowFetch returns agree."""
    cached, plain = drafts
    prompt = [5, 6, 7, 8, 9]
    first = _step(0, prompt, 3, temperature, speculate=4)
    probe, channel = _session(cached)
    drafted = list(probe.step(first).draft_token_ids)
    assert _drafted_ahead(_cache(cached))
    (entries,) = _cache(cached)._entries.values()
    verdicts = []
    for entry in entries:
        append = list(entry.append) + ([entry.job.guess] if hasattr(entry.job, "guess") else [])
        verdicts.append((entry.keep, append))
    assert any(len(append) == 2 for _, append in verdicts), "no entry for a whole block"
    assert sum(len(append) == 1 for _, append in verdicts) >= 3, "too few entries for rejections"
    probe.close()
    channel.close()
    for keep, append in verdicts:
        answers = []
        for server in (cached, plain):
            session, channel = _session(server)
            assert list(session.step(first).draft_token_ids) == drafted
            if server is cached:
                assert _drafted_ahead(_cache(cached))
            response = session.step(_step(keep, append, 4, temperature, speculate=4))
            rows = [session.fetch(response.step_number, i) for i in range(len(response.draft_token_ids))]
            answers.append((response, rows))
            session.close()
            channel.close()
        (hit, hit_rows), (fresh, fresh_rows) = answers
        assert hit.speculated and not fresh.speculated
        assert list(hit.draft_token_ids) == list(fresh.draft_token_ids), (keep, append)
        assert torch.allclose(torch.tensor(hit.draft_token_probs), torch.tensor(fresh.draft_token_probs), atol=1e-5)
        for hit_row, fresh_row in zip(hit_rows, fresh_rows, strict=True):
            assert hit_row.held == fresh_row.held == (temperature > 0)
            if hit_row.held:
                assert torch.allclose(
                    tensor_from_proto(hit_row.row.logits), tensor_from_proto(fresh_row.row.logits), atol=1e-5
                )


def test_a_step_for_another_verdict_or_other_fields_drafts_anew(drafts):
    """A miss: a verdict no entry was drafted for, or the drafted verdict with another seed or a larger
    K, is drafted as usual; the entries go, and so do their tokens."""
    cached, _ = drafts
    cache = _cache(cached)
    prompt = [11, 12, 13]
    session, channel = _session(cached)
    first = _step(0, prompt, 2, 0.0, speculate=2)
    drafted = list(session.step(first).draft_token_ids)
    assert _drafted_ahead(cache)
    misses = cache.counts.misses
    (entries,) = cache._entries.values()
    rejection = next(entry for entry in entries if len(entry.append) == 1 and not hasattr(entry.job, "guess"))
    larger = _step(rejection.keep, rejection.append, 3, 0.0)  # K = 3 > the entry's 2
    response = session.step(larger)
    assert not response.speculated and cache.counts.misses == misses + 1
    assert not cache._entries and cache.held_tokens == 0
    session.close()
    channel.close()
    assert drafted


@pytest.mark.parametrize("whole", [False, True])
def test_a_step_answered_from_the_cache_drafts_ahead_in_turn(drafts, whole):
    """A hit's answer launches entries for its own verdicts, as a drafted step's does: after a hit on
    a rejection's entry (no bonus guess) as after a whole block's. Entries once lacked the draft's
    likeliest tokens at each position, so after every hit on a rejection's entry the next step was a
    miss (modeled 8B/1B, one stream: 0.35 of load_aware's rounds found their block ready, 0.58 after)."""
    cached, _ = drafts
    cache = _cache(cached)
    session, channel = _session(cached)
    session.step(_step(0, [21, 22, 23, 24], 3, 0.0, speculate=3))
    assert _drafted_ahead(cache)
    (entries,) = cache._entries.values()
    entry = next(entry for entry in entries if isinstance(entry.job, GuessingDraftJob) == whole)
    append = list(entry.append) + ([entry.job.guess] if isinstance(entry.job, GuessingDraftJob) else [])
    response = session.step(_step(entry.keep, append, 3, 0.0, speculate=3))
    assert response.speculated
    assert _drafted_ahead(cache), "the step answered from the cache drafted nothing ahead"
    (again,) = cache._entries.values()
    assert any(isinstance(entry.job, GuessingDraftJob) for entry in again)
    assert sum(not isinstance(entry.job, GuessingDraftJob) for entry in again) >= 3
    session.close()
    channel.close()


@pytest.fixture(scope="module")
def greedy_stack(target_model: LoadedModel, close_draft_model: LoadedModel):
    target = start_target(target_model)
    draft = start_draft(close_draft_model)
    together = _fan_out(draft)
    orchestrator = OrchestratorThread(orchestrator_config(target, draft))
    yield orchestrator, draft, together
    orchestrator.stop()
    draft.stop()
    target.stop()


@pytest.mark.parametrize("k", [4, 8])
def test_greedy_outputs_are_the_targets_through_hits_and_misses(greedy_stack, target_model, k):
    orchestrator, draft, together = greedy_stack
    cache = _cache(draft)
    hits, misses, read = cache.counts.hits, cache.counts.misses, together[0]
    for prompt in ([5, 6, 7], [40, 41, 2, 9], [17, 3, 3, 3, 80], [90, 1]):
        request = orchestrator_pb2.GenerateRequest(
            token_ids=orchestrator_pb2.TokenIds(ids=prompt),
            max_new_tokens=40,
            num_speculative_tokens=k,
            speculation_policy=orchestrator_pb2.SPECULATION_POLICY_FIXED,
        )
        ids, _, last = collect(orchestrator.stub, request)
        assert ids == hf_greedy(target_model, prompt, 40), prompt
        assert last.stats.draft_fallback_rounds == 0
    assert cache.counts.hits > hits and cache.counts.misses > misses, cache.counts
    assert together[0] > read  # the draft's rows were read together (draft_service/jobs.py: read_rows)


# --- sampling: a vocabulary of 8, so that the distribution of generated tokens is computable ---------

VOCAB = 8
PROMPT = [1, 2, 3]
NEW_TOKENS = 6  # the first comes from the prefill; hits answer rounds from the third on


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, LoadedModel]:
    root: Path = tmp_path_factory.mktemp("speculation_pair")
    tokenizer = word_tokenizer(VOCAB)
    target = tiny_llama(VOCAB, seed=11, hidden=32, layers=2, init_range=0.2, eos=tokenizer.eos_token_id)
    draft = perturbed_copy(target, scale=0.3, seed=12)  # agrees often, not always: rejections too
    return load(save(target, tokenizer, root / "target")), load(save(draft, tokenizer, root / "draft"))


def _last_two_distribution(model: torch.nn.Module) -> dict[tuple[int, ...], float]:
    """P(t5, t6) of NEW_TOKENS sampled tokens at temperature 1, summed over t1 .. t4."""
    with torch.no_grad():
        probs: dict[tuple[int, ...], torch.Tensor] = {
            (): model(torch.tensor([PROMPT])).logits[0, -1].double().softmax(-1)
        }
        for length in range(1, NEW_TOKENS):
            prefixes = list(itertools.product(range(VOCAB), repeat=length))
            logits = model(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1].double()
            for prefix, row in zip(prefixes, logits.softmax(-1), strict=True):
                probs[prefix] = row
    joint: dict[tuple[int, ...], float] = {}
    for sequence in itertools.product(range(VOCAB), repeat=NEW_TOKENS):
        p = 1.0
        for i, token in enumerate(sequence):
            p *= float(probs[sequence[:i]][token])
        joint[sequence[-2:]] = joint.get(sequence[-2:], 0.0) + p
    return joint


@pytest.mark.slow  # 45 s: make test-long, beside the other distribution tests
def test_sampled_outputs_follow_the_target_through_hits_at_8_streams(small_vocab_pair):
    target_model, draft_model = small_vocab_pair
    target, draft = start_target(target_model), start_draft(draft_model)
    _fan_out(draft)
    orchestrator = OrchestratorThread(orchestrator_config(target, draft))
    cache = _cache(draft)
    samples = 1600
    try:

        def last_two(seed: int) -> tuple[int, ...]:
            request = orchestrator_pb2.GenerateRequest(
                token_ids=orchestrator_pb2.TokenIds(ids=PROMPT),
                max_new_tokens=NEW_TOKENS,
                temperature=1.0,
                seed=seed,
                num_speculative_tokens=2,
                speculation_policy=orchestrator_pb2.SPECULATION_POLICY_FIXED,
                ignore_eos=True,
            )
            ids, _, _ = collect(orchestrator.stub, request)
            assert len(ids) == NEW_TOKENS
            return tuple(ids[-2:])

        with ThreadPoolExecutor(8) as pool:
            counts = Counter(pool.map(last_two, range(samples)))
    finally:
        orchestrator.stop()
        draft.stop()
        target.stop()
    counts_now = cache.counts
    assert counts_now.hits >= samples // 10 and counts_now.misses >= samples // 20, counts_now
    assert counts_now.hits_after_rejection >= samples // 20, counts_now
    pvalue = chi_square_pvalue(counts, _last_two_distribution(target_model.model), samples)
    assert pvalue > 0.01, pvalue


def test_a_seed_reproduces_hit_or_miss(small_vocab_pair):
    """The fixed policy's contract: the same seed, the same outputs, whichever blocks came from the
    cache. Each seed runs twice: with entries for rejections (their steps hit) and with a whole block's
    alone (those steps miss and draft at the step)."""
    target_model, draft_model = small_vocab_pair
    target, draft = start_target(target_model), start_draft(draft_model)
    _fan_out(draft)
    cache = _cache(draft)
    orchestrator = OrchestratorThread(orchestrator_config(target, draft))
    try:
        outputs = []
        for fans_out in (True, False):
            cache.fans_out = fans_out
            after_rejection = cache.counts.hits_after_rejection
            runs = []
            for seed in range(12):
                request = orchestrator_pb2.GenerateRequest(
                    token_ids=orchestrator_pb2.TokenIds(ids=PROMPT),
                    max_new_tokens=24,
                    temperature=0.8,
                    seed=seed,
                    num_speculative_tokens=3,
                    speculation_policy=orchestrator_pb2.SPECULATION_POLICY_FIXED,
                    ignore_eos=True,
                )
                runs.append(collect(orchestrator.stub, request)[0])
            outputs.append(runs)
            hit_after_rejection = cache.counts.hits_after_rejection - after_rejection
            assert hit_after_rejection > 12 if fans_out else hit_after_rejection == 0, cache.counts
        assert outputs[0] == outputs[1]
    finally:
        orchestrator.stop()
        draft.stop()
        target.stop()


def test_the_cache_keeps_to_its_budget_yields_to_live_sessions_and_frees_everything(
    target_model: LoadedModel, close_draft_model: LoadedModel
):
    """A small token budget and a block pool that live sessions nearly fill, 6 streams: the cache's
    tokens stay within the budget, live steps never fail for its branches, outputs stay exact, and
    nothing is left held."""
    budget = 64
    target = start_target(target_model)
    draft = start_draft(close_draft_model, speculation_cache_tokens=budget, max_cached_tokens="448", kv_block_tokens=4)
    _fan_out(draft)
    cache = _cache(draft)
    held: list[int] = []
    launch = cache.launch

    shares: list[tuple[int, int]] = []

    def launch_and_note(session, request, job):  # the tokens held after each step that drafted ahead
        sessions = len(cache._sessions) or 1
        launch(session, request, job)
        held.append(cache.held_tokens)
        mine = sum(entry.tokens for entry in cache._entries.get(session.session_id, ()))
        shares.append((mine, budget // max(sessions, len(cache._sessions))))

    cache.launch = launch_and_note  # type: ignore[method-assign]
    engine = draft.servicer.engine
    reclaimed: list[int] = []
    reclaim = engine.store.reclaim

    def reclaim_and_note() -> list[int]:  # branches dropped for a live session's blocks
        dropped = reclaim()
        reclaimed.extend(dropped)
        return dropped

    engine.store.reclaim = reclaim_and_note  # type: ignore[method-assign]
    orchestrator = OrchestratorThread(orchestrator_config(target, draft))
    try:

        def generate(seed: int) -> tuple[list[int], list[int]]:
            prompt = [3 + seed % 50, 7, 9 + seed % 20] * 8
            request = orchestrator_pb2.GenerateRequest(
                token_ids=orchestrator_pb2.TokenIds(ids=prompt),
                max_new_tokens=30,
                num_speculative_tokens=4,
                speculation_policy=orchestrator_pb2.SPECULATION_POLICY_FIXED,
            )
            ids, _, last = collect(orchestrator.stub, request)
            assert last.stats.draft_fallback_rounds == 0, last.stats
            return prompt, ids

        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(generate, range(12)))
        for prompt, ids in results:
            assert ids == hf_greedy(target_model, prompt, 30)
        assert cache.counts.hits > 0 and max(held) <= budget, (cache.counts, max(held))
        assert all(mine <= share for mine, share in shares), shares  # no session takes more than its share
        print("speculation cache under load:", cache.counts, "branches reclaimed:", len(reclaimed))
    finally:
        orchestrator.stop()
    store = engine.store
    assert wait_until(
        lambda: cache.entries == 0 and cache.held_tokens == 0 and store.used_blocks == store.reserved_blocks == 0
    )
    assert engine.slots.leased() == 0
    draft.stop()
    target.stop()


def test_a_live_session_takes_the_blocks_of_entries_and_a_lost_branch_is_a_cache_miss(
    drafts, close_draft_model: LoadedModel
):
    """A pool of 16 blocks. A verdict whose fork found no block drafts at its step, as the plain service
    does. Then one session's entries hold what a second session's prefill needs; the prefill takes
    them (the branches are dropped). The first session's step for a verdict whose block was drafted is
    still answered from it (its tokens and q were drafted; only the keys and values went), and the
    session's next step is a cache miss, as after an eviction: the orchestrator reopens it."""
    _, plain = drafts
    small = start_draft(close_draft_model, max_cached_tokens="64", kv_block_tokens=4)
    _fan_out(small)
    cache = _cache(small)
    opened: list[tuple[RawSession, grpc.Channel]] = []

    def session_on(server: ModelServer) -> RawSession:
        opened.append(_session(server))
        return opened[-1][0]

    try:
        first = _step(0, list(range(20, 38)), 3, 1.0, speculate=4)  # 18 tokens, 20 after the step
        session, reference = session_on(small), session_on(plain)
        session.step(first)
        reference.step(first)
        assert _drafted_ahead(cache)
        (entries,) = cache._entries.values()
        starved = next(e for e in entries if e.job.future.exception() is not None)  # its fork found no block
        second = _step(starved.keep, starved.append + ([0] if hasattr(starved.job, "guess") else []), 3, 1.0, 4)
        answer, fresh = session.step(second), reference.step(second)
        assert not answer.speculated and list(answer.draft_token_ids) == list(fresh.draft_token_ids)
        assert _drafted_ahead(cache)
        (entries,) = cache._entries.values()
        drafted = [e for e in entries if not hasattr(e.job, "guess") and e.job.future.exception() is None]
        verdict = drafted[0]
        assert small.servicer.engine.store.used_blocks > 6  # the session's and the entries' own
        assert session_on(small).step(_step(0, list(range(40, 72)), 2, 1.0)).draft_token_ids  # 32 tokens: 8 blocks
        third = _step(verdict.keep, verdict.append, 4, 1.0)
        answer, fresh = session.step(third), reference.step(third)
        assert answer.speculated and list(answer.draft_token_ids) == list(fresh.draft_token_ids)
        assert list(answer.draft_token_probs) == pytest.approx(list(fresh.draft_token_probs), abs=1e-5)
        assert wait_until(lambda: cache.counts.lost == 1), cache.counts
        after = _step(verdict.keep + 1, [answer.draft_token_ids[0]], 2, 1.0)
        assert session.step(after).result == common_pb2.SESSION_RESULT_CACHE_MISS
    finally:
        for raw, channel in opened:
            raw.close()
            channel.close()
        small.stop()
