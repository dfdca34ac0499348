"""End to end over real gRPC on loopback: streaming, cancellation, lost sessions, errors, stops."""

from __future__ import annotations

import asyncio
import json
import threading

import grpc
import pytest

from orchestrator.app import start_orchestrator
from orchestrator.pair import PairMismatch
from specdec.v1 import orchestrator_pb2
from tests.conftest import client_json, collect, hf_greedy, still_speculates, wait_until
from tests.servers import OrchestratorThread, load, orchestrator_config, start_draft, start_target
from tests.tiny_models import save, tiny_llama, word_tokenizer
from tools.local_stack import LocalStack

Request = orchestrator_pb2.GenerateRequest


def _ids(prompt: list[int], **fields) -> Request:
    return Request(token_ids=orchestrator_pb2.TokenIds(ids=prompt), **fields)


def test_streams_deltas_and_final_stats(orchestrators, target_model):
    stub = orchestrators["close"].stub
    messages = list(stub.Generate(Request(text="w7 w8 w9", max_new_tokens=40, num_speculative_tokens=4)))
    assert len(messages) > 3
    assert all(m.finish_reason == 0 for m in messages[:-1])
    last = messages[-1]
    ids = [t for m in messages for t in m.token_ids]
    assert last.finish_reason in (orchestrator_pb2.FINISH_REASON_LENGTH, orchestrator_pb2.FINISH_REASON_EOS)
    assert messages[0].request_id
    stats = last.stats
    assert stats.output_tokens == len(ids) and stats.prompt_tokens == 3
    assert stats.rounds >= 1 and stats.accepted_tokens <= stats.draft_tokens
    assert sum(stats.accepted_per_position) == stats.accepted_tokens
    assert stats.total_seconds >= stats.target_seconds > 0 and stats.wire_bytes > 0
    assert "".join(m.text for m in messages) == target_model.tokenizer.decode(ids, skip_special_tokens=True)


def test_cancel_mid_stream_frees_both_sessions(orchestrators, target_server, close_draft_server):
    stub = orchestrators["close"].stub
    call = stub.Generate(_ids([4, 5], max_new_tokens=200, num_speculative_tokens=2))
    next(call)
    next(call)
    call.cancel()
    assert wait_until(lambda: target_server.servicer.store.open_sessions == 0)
    assert wait_until(lambda: close_draft_server.servicer.store.open_sessions == 0)
    assert wait_until(lambda: target_server.servicer.block_store.tokens_held == 0)  # freed on the engine thread


def test_lost_sessions_mid_generation_do_not_change_output(target_model, close_draft_model):
    target, draft = start_target(target_model), start_draft(close_draft_model)
    orchestrator = OrchestratorThread(orchestrator_config(target, draft))
    stop = threading.Event()

    def evict_repeatedly() -> None:
        while not stop.wait(0.01):
            target.servicer.store.evict_all()
            draft.servicer.store.evict_all()

    evictor = threading.Thread(target=evict_repeatedly)
    evictor.start()
    try:
        prompt = [9, 3, 5, 7]
        expected = hf_greedy(target_model, prompt, 120)
        reopens = 0
        for k in (2, 5):
            got, _, last = collect(orchestrator.stub, _ids(prompt, max_new_tokens=120, num_speculative_tokens=k))
            assert got == expected
            reopens += last.stats.session_reopens
        assert reopens > 0  # the sessions really were lost and reopened
    finally:
        stop.set()
        evictor.join()
        orchestrator.stop()
        target.stop()
        draft.stop()


@pytest.mark.parametrize(
    ("request_message", "code", "words"),
    [
        (Request(text="", max_new_tokens=5), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
        (Request(max_new_tokens=5), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
        (_ids([1] * 300, max_new_tokens=5), grpc.StatusCode.INVALID_ARGUMENT, "context is 256"),
        (_ids([1, 500], max_new_tokens=5), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
        (_ids([1], max_new_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens must be in [1, 4096]"),
        (_ids([1], max_new_tokens=5000), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
        (_ids([1], max_new_tokens=5, temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT, "temperature must be in"),
        (
            _ids([1], max_new_tokens=5, temperature=1, top_p=0),
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_p must be in (0, 1]",
        ),
        (_ids([1], max_new_tokens=5, temperature=1, top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (_ids([1], max_new_tokens=5, num_speculative_tokens=17), grpc.StatusCode.INVALID_ARGUMENT, "[0, 16]"),
        (_ids([1], max_new_tokens=5, speculation_policy=9), grpc.StatusCode.INVALID_ARGUMENT, "speculation_policy"),
        (_ids([1], max_new_tokens=5, stop=[""]), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    ],
)
def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(orchestrators, request_message, code, words):
    stub = orchestrators["close"].stub
    with pytest.raises(grpc.RpcError) as error:
        collect(stub, request_message)
    assert error.value.code() == code
    assert words in error.value.details()
    still_speculates(stub)


def test_speculation_without_a_draft_is_a_failed_precondition(orchestrators):
    with pytest.raises(grpc.RpcError) as error:
        collect(orchestrators["none"].stub, _ids([1], max_new_tokens=5, num_speculative_tokens=3))
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--draft" in error.value.details()


def test_stop_string_ends_generation_before_it(orchestrators, target_model):
    stub = orchestrators["close"].stub
    prompt = [11, 12, 13]
    expected = hf_greedy(target_model, prompt, 30)
    words = target_model.tokenizer.decode(expected[:12], skip_special_tokens=True).split()
    stop = " ".join(words[6:8])
    ids, text, last = collect(stub, _ids(prompt, max_new_tokens=30, num_speculative_tokens=4, stop=[stop]))
    assert last.finish_reason == orchestrator_pb2.FINISH_REASON_STOP
    assert stop not in text
    full = target_model.tokenizer.decode(expected, skip_special_tokens=True)
    assert text == full[: full.index(stop)]
    assert ids == expected[: len(ids)] and len(ids) <= 8


def test_get_info(orchestrators):
    info = orchestrators["close"].stub.GetInfo(orchestrator_pb2.GetInfoRequest())
    assert info.target.vocab_size == info.draft.vocab_size == 96
    assert info.num_speculative_tokens_cap == 16 and info.max_new_tokens_cap == 4096
    none = orchestrators["none"].stub.GetInfo(orchestrator_pb2.GetInfoRequest())
    assert not none.HasField("draft") and none.default_num_speculative_tokens == 0


def test_mismatched_vocabularies_are_refused(tmp_path, target_server):
    other = save(tiny_llama(64, seed=9), word_tokenizer(64), tmp_path / "other")
    draft = start_draft(load(other))
    try:
        with pytest.raises(PairMismatch) as error:
            asyncio.run(start_orchestrator(orchestrator_config(target_server, draft)))
        message = str(error.value)
        assert str(other) in message and "target" in message and "64" in message and "96" in message
    finally:
        draft.stop()


def test_unreachable_draft_falls_back_to_target_alone(target_server, target_model, close_draft_model):
    from tools.local_stack import free_port

    port = free_port()  # nothing listens here yet
    orchestrator = OrchestratorThread(orchestrator_config(target_server, f"127.0.0.1:{port}", draft_retry_after_s=0.3))
    try:
        prompt = [2, 4, 6]
        expected = hf_greedy(target_model, prompt, 20)
        got, _, last = collect(orchestrator.stub, _ids(prompt, max_new_tokens=20, num_speculative_tokens=3))
        assert got == expected and last.stats.draft_tokens == 0
        # The draft comes up later: requests start drafting again.
        draft = start_draft(close_draft_model, port=port)
        try:
            assert wait_until(
                lambda: (
                    orchestrator.running.servicer.draft is not None
                    and orchestrator.running.servicer.draft.info is not None
                ),
                timeout_s=10,
            )
            # Fixed K: every round asks the draft (load_aware may price K = 0 for the tiny pair).
            fixed = orchestrator_pb2.SPECULATION_POLICY_FIXED
            got, _, last = collect(
                orchestrator.stub, _ids(prompt, max_new_tokens=20, num_speculative_tokens=3, speculation_policy=fixed)
            )
            assert got == expected and last.stats.draft_tokens > 0
        finally:
            draft.stop()
    finally:
        orchestrator.stop()


def test_draft_dying_mid_generation_keeps_output_exact(target_server, target_model, close_draft_model):
    draft = start_draft(close_draft_model)
    orchestrator = OrchestratorThread(orchestrator_config(target_server, draft, draft_retry_after_s=30))
    try:
        prompt = [3, 1, 4, 1, 5]
        expected = hf_greedy(target_model, prompt, 150)
        call = orchestrator.stub.Generate(_ids(prompt, max_new_tokens=150, num_speculative_tokens=2))
        ids = list(next(call).token_ids)
        draft.stop()
        last = None
        for message in call:
            ids += message.token_ids
            last = message
        assert ids == expected
        assert last is not None and last.stats.draft_fallback_rounds > 0
    finally:
        orchestrator.stop()


@pytest.mark.slow
def test_command_line_services_and_client(tiny_pair, tmp_path):
    """The entry points users run: three processes, the JSON client, SIGTERM drains them."""
    with LocalStack(
        str(tiny_pair.target),
        str(tiny_pair.close_draft),
        log_dir=tmp_path,
        extra_orchestrator_args=["--num-speculative-tokens", "3"],
    ) as stack:
        result = client_json(stack.orchestrator_address, "--prompt", "w5 w6", "--max-new-tokens", "12")
        assert {"text", "token_ids", "finish_reason", "stats"} <= set(result)
        assert {"rounds", "draft_tokens", "accepted_tokens"} <= set(result["stats"])
        assert result["stats"]["draft_tokens"] > 0
        processes = list(stack.processes)
    assert all(p.returncode == 0 for p in processes), [p.returncode for p in processes]
    log_line = next(line for line in (tmp_path / "orchestrator.log").read_text().splitlines() if "request_done" in line)
    record = json.loads(log_line)
    assert record["request_id"] == result["request_id"] and record["rounds"] >= 1
    # The request id travelled to both services in gRPC metadata.
    for service in ("target", "draft"):
        lines = [json.loads(x) for x in (tmp_path / f"{service}.log").read_text().splitlines() if "session_closed" in x]
        assert any(line["request_id"] == record["request_id"] for line in lines), service


def test_a_stream_interval_changes_no_token_and_never_holds_the_first(orchestrators):
    """The close draft's orchestrator gathers up to 16 tokens a message (the default), the random
    draft's sends each round's at once: the same tokens either way, the first at once."""
    request = _ids([5, 6, 7], max_new_tokens=40, num_speculative_tokens=2)
    gathered = list(orchestrators["close"].stub.Generate(request))
    each = list(orchestrators["random"].stub.Generate(request))
    assert [t for m in gathered for t in m.token_ids] == [t for m in each for t in m.token_ids]
    assert 1 <= len(gathered[0].token_ids) <= 3  # the first round's tokens: at most K + 1
    assert gathered[-1].finish_reason and gathered[-1].stats.output_tokens == 40
