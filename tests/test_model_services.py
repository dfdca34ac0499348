"""The draft and target services over real gRPC: keep/append rollback, cache misses, limits, errors."""

from __future__ import annotations

import asyncio
import queue
import random

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import REGISTRY

from model_host.loading import LoadedModel
from serving.logits import logits_to_probs, rows_from_wire
from serving.sampling import SamplingParams
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.conftest import RawSession, still_speculates, wait_until
from tests.servers import start_draft, start_target

SAMPLE = SamplingParams(temperature=1.0).to_proto()
OK = common_pb2.SESSION_RESULT_OK
MISS = common_pb2.SESSION_RESULT_CACHE_MISS


def _channel(server) -> grpc.Channel:
    return grpc.insecure_channel(f"127.0.0.1:{server.port}")


def _verify(ids: list[int], sampling: common_pb2.SamplingParams | None = None) -> target_pb2.VerifyRequest:
    return target_pb2.VerifyRequest(keep=0, append_token_ids=ids, num_rows=1, sampling=sampling)


def _draft(ids: list[int], **fields) -> draft_pb2.DraftRequest:
    return draft_pb2.DraftRequest(keep=0, append_token_ids=ids, **{"num_speculative_tokens": 2, **fields})


def _rejecting(keep: int, ids: list[int], k: int) -> target_pb2.VerifyRequest:
    """A sampled verify step whose draft tokens (the last k) are point masses (q = 1) and whose uniforms
    reject almost surely: the answer's row is the one at the block's first position."""
    return target_pb2.VerifyRequest(
        keep=keep,
        append_token_ids=ids,
        num_rows=k + 1,
        sampling=SAMPLE,
        draft_token_probs=[1.0] * k,
        uniforms=[0.999999] * k,
    )


def _fresh_probs(model: LoadedModel, sequence: list[int]) -> torch.Tensor:
    """Next-token distribution from a fresh prefill of the whole sequence, no cache. [vocab]"""
    with torch.no_grad():
        logits = model.model(torch.tensor([sequence])).logits[0, -1:]
    return logits_to_probs(logits, SamplingParams(temperature=1.0))[0]


def test_target_rollback_matches_fresh_prefill(target_server, target_model):
    """Any accept/reject pattern: the cache then gives the same logits as a fresh prefill."""
    rng = random.Random(0)
    vocab = target_model.vocab_size
    with _channel(target_server) as channel:
        session = RawSession(target_pb2_grpc.TargetServiceStub(channel).Verify)
        committed = [rng.randrange(1, vocab) for _ in range(5)]
        fed = 0
        for _ in range(25):
            k = rng.randrange(0, 6)
            block = [rng.randrange(1, vocab) for _ in range(k)]
            response = session.step(_rejecting(fed, committed[fed:] + block, k))
            assert response.result == OK and response.num_accepted == 0
            row = rows_from_wire(response.row, SamplingParams(temperature=1.0), vocab)[0]
            # the first row predicts after the last committed token: compare with a fresh prefill
            fresh = _fresh_probs(target_model, committed)
            assert torch.allclose(row, fresh, atol=1e-5)
            if k:
                assert abs(response.draft_token_target_probs[0] - float(fresh[block[0]])) < 1e-5
            accepted = rng.randrange(0, k + 1)
            fed = len(committed) + accepted
            committed += [*block[:accepted], rng.randrange(1, vocab)]
        session.close()
    assert wait_until(lambda: target_server.servicer.store.open_sessions == 0)


def test_draft_rollback_including_unfed_last_token(close_draft_server, close_draft_model):
    """After a full acceptance the draft never fed its last token; keep/append covers it."""
    rng = random.Random(1)
    vocab = close_draft_model.vocab_size
    with _channel(close_draft_server) as channel:
        session = RawSession(draft_pb2_grpc.DraftServiceStub(channel).Draft)
        committed = [rng.randrange(1, vocab) for _ in range(4)]
        fed = 0
        full_acceptances = 0
        for step in range(25):
            k = rng.randrange(1, 6)
            response = session.step(
                draft_pb2.DraftRequest(
                    keep=fed, append_token_ids=committed[fed:], num_speculative_tokens=k, sampling=SAMPLE, seed=step
                )
            )
            assert response.result == OK and len(response.draft_token_ids) == k
            fresh = _fresh_probs(close_draft_model, committed)
            assert abs(response.draft_token_probs[0] - float(fresh[response.draft_token_ids[0]])) < 1e-5
            fetched = session.fetch(response.step_number, 0)
            assert fetched.held
            row = rows_from_wire(fetched.row, SamplingParams(temperature=1.0), vocab)[0]
            assert torch.allclose(row, fresh, atol=1e-5)
            assert response.cached_tokens == len(committed) + k - 1
            accepted = rng.choice([k, rng.randrange(0, k + 1)])
            full_acceptances += accepted == k
            fed = len(committed) + min(accepted, k - 1)
            committed += [*list(response.draft_token_ids[:accepted]), rng.randrange(1, vocab)]
        session.close()
    assert full_acceptances > 3


def test_draft_samples_from_the_rows_it_reports(close_draft_server, close_draft_model):
    vocab = close_draft_model.vocab_size
    with _channel(close_draft_server) as channel:
        session = RawSession(draft_pb2_grpc.DraftServiceStub(channel).Draft)
        response = session.step(
            draft_pb2.DraftRequest(
                keep=0,
                append_token_ids=[3, 4, 5],
                num_speculative_tokens=6,
                sampling=common_pb2.SamplingParams(temperature=0.7, top_k=5),
                seed=9,
            )
        )
        params = SamplingParams(temperature=0.7, top_k=5)
        for index, (token, q) in enumerate(zip(response.draft_token_ids, response.draft_token_probs, strict=True)):
            fetched = session.fetch(response.step_number, index)
            assert fetched.held and list(fetched.row.logits.shape) == [1, 5]  # over its support alone
            row = rows_from_wire(fetched.row, params, vocab)[0]
            assert row[token] > 0 and (row > 0).sum() <= 5
            assert abs(float(row[token]) - q) < 1e-6
        session.close()


def test_a_draft_keeps_the_rows_of_its_last_two_steps_and_answers_a_fetch_beside_a_step(close_draft_server):
    """The step verified and the one drafted beside it: a fetch for either is answered; an older step's,
    another session's, or a closed session's is not held (the orchestrator then recomputes the row)."""
    with _channel(close_draft_server) as channel:
        session = RawSession(draft_pb2_grpc.DraftServiceStub(channel).Draft)
        numbers = []
        context = [3, 4, 5]
        for seed in range(3):
            response = session.step(
                draft_pb2.DraftRequest(
                    keep=0, append_token_ids=context, num_speculative_tokens=3, sampling=SAMPLE, seed=seed
                )
            )
            numbers.append(response.step_number)
        assert numbers == [1, 2, 3]
        assert session.fetch(2, 1).held and session.fetch(3, 2).held
        assert not session.fetch(1, 0).held  # two steps later
        assert not session.fetch(3, 3).held  # the step drafted 3 tokens
        recomputed = session.step(
            draft_pb2.DraftRequest(keep=3, append_token_ids=[9], num_speculative_tokens=0, sampling=SAMPLE)
        )
        assert not recomputed.draft_token_ids and recomputed.row.logits.shape[0] == 1
        assert session.fetch(3, 0).held  # a row-only step keeps nothing new
        session.close_session()
        assert not session.fetch(3, 0).held
        session.close()


def test_cache_miss_then_reopen(target_server):
    with _channel(target_server) as channel:
        session = RawSession(target_pb2_grpc.TargetServiceStub(channel).Verify)
        # A first message that claims tokens the service never saw.
        assert session.step(target_pb2.VerifyRequest(keep=3, append_token_ids=[1], num_rows=1)).result == MISS
        assert session.step(target_pb2.VerifyRequest(keep=0, append_token_ids=[1, 2, 3, 4], num_rows=1)).result == OK
        assert session.step(target_pb2.VerifyRequest(keep=9, append_token_ids=[1], num_rows=1)).result == MISS
        target_server.servicer.store.evict_all()
        assert session.step(target_pb2.VerifyRequest(keep=4, append_token_ids=[5], num_rows=1)).result == MISS
        response = session.step(target_pb2.VerifyRequest(keep=0, append_token_ids=[1, 2, 3, 4, 5], num_rows=1))
        assert response.result == OK and response.cached_tokens == 5
        session.close()


@pytest.mark.parametrize(
    ("request_message", "words"),
    [
        (target_pb2.VerifyRequest(keep=0, append_token_ids=[1, 2], num_rows=3), "num_rows"),
        (target_pb2.VerifyRequest(keep=0, append_token_ids=[1, 2], num_rows=0), "num_rows"),
        (target_pb2.VerifyRequest(keep=0, append_token_ids=[1, 99999], num_rows=1), "vocabulary"),
        (target_pb2.VerifyRequest(keep=0, append_token_ids=[1] * 300, num_rows=1), "context"),
        (
            target_pb2.VerifyRequest(
                keep=0, append_token_ids=[1], num_rows=1, sampling=common_pb2.SamplingParams(temperature=-1)
            ),
            "temperature",
        ),
        (
            target_pb2.VerifyRequest(
                keep=0, append_token_ids=[1], num_rows=1, sampling=common_pb2.SamplingParams(temperature=1, top_p=2)
            ),
            "top_p",
        ),
        (_verify([1], common_pb2.SamplingParams(temperature=float("nan"))), "temperature"),
        (_verify([1], common_pb2.SamplingParams(temperature=float("inf"))), "temperature"),
        (_verify([1], common_pb2.SamplingParams(temperature=500)), "temperature must be in [0, 100]"),
        (_verify([1], common_pb2.SamplingParams(temperature=1, top_p=float("nan"))), "top_p"),
        (_verify([1], common_pb2.SamplingParams(temperature=1, top_p=0)), "top_p"),
        (_verify([1, -1]), "vocabulary"),
        (target_pb2.VerifyRequest(keep=0, append_token_ids=[1] * 20, num_rows=18), "--max-speculative-tokens + 1"),
        (target_pb2.VerifyRequest(keep=250, append_token_ids=[1] * 10, num_rows=1), "context"),
        (
            target_pb2.VerifyRequest(
                keep=0, append_token_ids=[1, 2, 3], num_rows=3, sampling=SAMPLE, uniforms=[0.5] * 2
            ),
            "draft_token_probs must hold num_rows - 1 = 2",
        ),
        (
            target_pb2.VerifyRequest(
                keep=0, append_token_ids=[1, 2], num_rows=2, sampling=SAMPLE, draft_token_probs=[0.5], uniforms=[]
            ),
            "uniforms must hold",
        ),
        (
            target_pb2.VerifyRequest(
                keep=0, append_token_ids=[1, 2], num_rows=2, sampling=SAMPLE, draft_token_probs=[0.0], uniforms=[0.5]
            ),
            "draft_token_probs must be in (0, 1]",
        ),
        (
            target_pb2.VerifyRequest(
                keep=0, append_token_ids=[1, 2], num_rows=2, sampling=SAMPLE, draft_token_probs=[0.5], uniforms=[1.0]
            ),
            "uniforms must be in [0, 1)",
        ),
    ],
)
def test_target_bad_requests(target_server, orchestrators, request_message, words):
    with _channel(target_server) as channel:
        session = RawSession(target_pb2_grpc.TargetServiceStub(channel).Verify)
        with pytest.raises(grpc.RpcError) as error:
            session.step(request_message)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in error.value.details()
    assert wait_until(lambda: target_server.servicer.store.open_sessions == 0)
    still_speculates(orchestrators["close"].stub)


@pytest.mark.parametrize(
    ("request_message", "words"),
    [
        (draft_pb2.DraftRequest(keep=0, append_token_ids=[1], num_speculative_tokens=0), "num_speculative_tokens"),
        (draft_pb2.DraftRequest(keep=0, append_token_ids=[1], num_speculative_tokens=99), "num_speculative_tokens"),
        (draft_pb2.DraftRequest(keep=0, append_token_ids=[], num_speculative_tokens=2), "append_token_ids"),
        (draft_pb2.DraftRequest(keep=0, append_token_ids=[1], num_speculative_tokens=2, min_confidence=2), "min_conf"),
        (draft_pb2.DraftRequest(keep=0, append_token_ids=[1], num_speculative_tokens=17), "[0, 16]"),
        (_draft([1], min_confidence=float("nan")), "min_confidence"),
        (_draft([1], min_confidence=-0.5), "min_confidence"),
        (_draft([1], sampling=common_pb2.SamplingParams(temperature=float("nan"))), "temperature"),
        (_draft([1], sampling=common_pb2.SamplingParams(temperature=1, top_p=0)), "top_p"),
        (_draft([500]), "vocabulary"),
        (_draft([-3]), "vocabulary"),
        (_draft([1] * 250, num_speculative_tokens=16), "context"),
    ],
)
def test_draft_bad_requests(close_draft_server, orchestrators, request_message, words):
    with _channel(close_draft_server) as channel:
        session = RawSession(draft_pb2_grpc.DraftServiceStub(channel).Draft)
        with pytest.raises(grpc.RpcError) as error:
            session.step(request_message)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in error.value.details()
    assert wait_until(lambda: close_draft_server.servicer.store.open_sessions == 0)
    still_speculates(orchestrators["close"].stub)


def test_session_and_token_limits_leave_other_sessions_running(target_model):
    server = start_target(target_model, max_sessions=2, max_cached_tokens=40)
    try:
        with _channel(server) as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            # A session opens when its stream starts: open each only once the previous one holds its slot.
            first = RawSession(stub.Verify)
            assert first.step(target_pb2.VerifyRequest(keep=0, append_token_ids=[1] * 10, num_rows=1)).result == OK
            second = RawSession(stub.Verify)
            assert second.step(target_pb2.VerifyRequest(keep=0, append_token_ids=[2] * 10, num_rows=1)).result == OK
            third = RawSession(stub.Verify)
            with pytest.raises(grpc.RpcError) as error:
                third.step(target_pb2.VerifyRequest(keep=0, append_token_ids=[3], num_rows=1))
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-sessions" in error.value.details()
            with pytest.raises(grpc.RpcError) as error:
                second.step(target_pb2.VerifyRequest(keep=10, append_token_ids=[2] * 25, num_rows=1))
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-cached-tokens" in error.value.details()
            # the first session is unaffected
            assert first.step(target_pb2.VerifyRequest(keep=10, append_token_ids=[4], num_rows=1)).result == OK
            first.close()
        assert wait_until(lambda: server.servicer.store.open_sessions == 0)
        # The engine frees a closed session's blocks on its own thread, and publishes the gauge then
        assert wait_until(lambda: server.servicer.block_store.tokens_held == 0)
        assert REGISTRY.get_sample_value("specdec:cached_tokens", {"service": "target"}) == 0
    finally:
        server.stop()


def test_idle_sessions_and_streams_are_closed(target_model):
    """A silent client holds nothing for long: an idle session is closed (its next step is a cache miss,
    so the orchestrator resends the sequence) and a stream holding no session is cancelled."""
    server = start_target(target_model, session_idle_timeout_s=0.3)
    try:
        with _channel(server) as channel:
            session = RawSession(target_pb2_grpc.TargetServiceStub(channel).Verify)
            assert session.step(target_pb2.VerifyRequest(keep=0, append_token_ids=[1, 2], num_rows=1)).result == OK
            assert wait_until(lambda: server.servicer.store.open_sessions == 0, timeout_s=5)
            assert session.step(target_pb2.VerifyRequest(keep=2, append_token_ids=[3], num_rows=1)).result == MISS
            assert wait_until(lambda: not server.servicer._links, timeout_s=5)  # it holds no session now
            with pytest.raises(grpc.RpcError) as error:
                session.step(target_pb2.VerifyRequest(keep=2, append_token_ids=[3], num_rows=1))
            assert error.value.code() == grpc.StatusCode.CANCELLED
            assert "--session-idle-timeout-s" in (error.value.details() or "")
            silent = RawSession(target_pb2_grpc.TargetServiceStub(channel).Verify)  # never sends a step
            assert wait_until(lambda: len(server.servicer._links) == 1, timeout_s=5)
            assert wait_until(lambda: not server.servicer._links, timeout_s=5)
            silent.close()
    finally:
        server.stop()


class Link:
    """A raw link: batches of entries in, results by session out."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._responses = target_pb2_grpc.TargetServiceStub(channel).Verify(iter(self._requests.get, None))

    def send(self, *steps: target_pb2.VerifyStep) -> dict[int, target_pb2.VerifyResult]:
        """One message; every result for its (non-closing) steps, however many answers they come in."""
        self._requests.put(target_pb2.VerifyBatch(steps=steps))
        waiting = {step.session for step in steps if not step.close}
        results: dict[int, target_pb2.VerifyResult] = {}
        while waiting - set(results):
            for result in next(self._responses).results:
                results[result.session] = result
        return results

    def close(self) -> None:
        self._requests.put(None)


def test_a_link_carries_many_sessions_and_a_bad_step_fails_only_its_own(target_server, target_model):
    """Sessions on one stream: each step's answer is its own; a bad step (and a session that errs)
    leaves the others going; closing one frees its cache at once, the stream staying open."""
    with _channel(target_server) as channel:
        link = Link(channel)
        prompts = {1: [5, 6, 7], 2: [8, 9], 3: [10, 11, 12, 13]}
        results = link.send(
            *(target_pb2.VerifyStep(session=i, step=_verify(ids)) for i, ids in prompts.items()),
            target_pb2.VerifyStep(session=4, step=target_pb2.VerifyRequest(keep=0, append_token_ids=[1], num_rows=5)),
        )
        assert results[4].HasField("error") and "num_rows" in results[4].error.message
        assert results[4].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        for i, ids in prompts.items():
            expected = int(_fresh_probs(target_model, ids).argmax())
            assert not results[i].HasField("error") and list(results[i].response.argmax_token_ids) == [expected]
        assert target_server.servicer.store.open_sessions == 3  # the bad step's session is closed
        link.send(target_pb2.VerifyStep(session=2, close=True))
        assert wait_until(lambda: target_server.servicer.store.open_sessions == 2)
        # the others go on from their caches
        nxt = {i: int(results[i].response.argmax_token_ids[0]) for i in (1, 3)}
        steps = [
            target_pb2.VerifyStep(
                session=i,
                step=target_pb2.VerifyRequest(keep=len(prompts[i]), append_token_ids=[nxt[i]], num_rows=1),
            )
            for i in (1, 3)
        ]
        again = link.send(*steps)
        for i in (1, 3):
            expected = int(_fresh_probs(target_model, [*prompts[i], nxt[i]]).argmax())
            assert list(again[i].response.argmax_token_ids) == [expected]
        link.close()
    assert wait_until(lambda: target_server.servicer.store.open_sessions == 0)


def test_a_bug_in_one_sessions_answer_fails_that_session_alone(target_model):
    """An unexpected exception while answering one step (a server bug) is that session's INTERNAL,
    marked as the handler's own (not retried); the link and the other sessions go on."""
    from model_host.session_servicer import HANDLER_INTERNAL_PREFIX

    server = start_target(target_model)
    respond = server.servicer.respond

    def buggy(job, request, session):
        if request.append_token_ids[0] == 77:
            raise RuntimeError("boom")
        return respond(job, request, session)

    server.servicer.respond = buggy  # type: ignore[method-assign]
    try:
        with _channel(server) as channel:
            link = Link(channel)
            results = link.send(
                target_pb2.VerifyStep(session=1, step=_verify([5, 6])),
                target_pb2.VerifyStep(session=2, step=_verify([77, 6])),
            )
            assert results[2].error.code == grpc.StatusCode.INTERNAL.value[0]
            assert results[2].error.message.startswith(HANDLER_INTERNAL_PREFIX) and "boom" in results[2].error.message
            assert not results[1].HasField("error")
            again = link.send(target_pb2.VerifyStep(session=3, step=_verify([8, 9])))
            assert not again[3].HasField("error")
            link.close()
        assert wait_until(lambda: server.servicer.store.open_sessions == 0)
    finally:
        server.stop()


def test_streams_are_budgeted_per_peer(target_model):
    """Idle streams from one client are refused beyond --max-streams-per-peer, naming the flag; the
    streams it holds keep working."""
    server = start_target(target_model, max_streams_per_peer=2)
    try:
        with _channel(server) as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            first = RawSession(stub.Verify)  # a stream starts when it is called: one after the other
            assert first.step(_verify([1, 2])).result == OK
            second = RawSession(stub.Verify)
            assert second.step(_verify([3, 4])).result == OK
            third = RawSession(stub.Verify)
            with pytest.raises(grpc.RpcError) as error:
                third.step(_verify([5]))
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-streams-per-peer" in error.value.details()
            assert first.step(target_pb2.VerifyRequest(keep=2, append_token_ids=[9], num_rows=1)).result == OK
            for session in (first, second, third):
                session.close()
    finally:
        server.stop()


def test_model_info_health_and_reflection(target_server, target_model):
    with _channel(target_server) as channel:
        info = target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(common_pb2.GetModelInfoRequest())
        assert info.vocab_size == target_model.vocab_size and info.max_context == 256
        assert info.tokenizer_fingerprint == target_model.tokenizer_fingerprint != ""
        assert list(info.eos_token_ids) == [0]
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "specdec.v1.TargetService"):
            status = health.Check(health_pb2.HealthCheckRequest(service=name)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for answer in answers for s in answer.list_services_response.service}
        assert {"specdec.v1.TargetService", "grpc.health.v1.Health"} <= names


def test_drain_stops_accepting_lets_open_sessions_finish_then_stops(close_draft_model):
    import threading

    server = start_draft(close_draft_model)
    with _channel(server) as channel:
        session = RawSession(draft_pb2_grpc.DraftServiceStub(channel).Draft)
        first = session.step(draft_pb2.DraftRequest(keep=0, append_token_ids=[1, 2], num_speculative_tokens=2))
        drain = threading.Thread(target=server.drain, args=(5.0,))
        drain.start()

        def health_status() -> int:
            check = server.health.Check(health_pb2.HealthCheckRequest(), None)
            return asyncio.run_coroutine_threadsafe(check, server.loop).result().status

        assert wait_until(lambda: health_status() == 2)  # NOT_SERVING
        # The open session keeps being served during the grace period ...
        second = session.step(
            draft_pb2.DraftRequest(keep=first.cached_tokens, append_token_ids=[3], num_speculative_tokens=2)
        )
        assert second.result == OK
        session.close()
        # ... and once it ends, the server stops without waiting out the grace period.
        drain.join(10)
        assert not drain.is_alive()
    assert server._stopped.is_set()
