"""Several replicas per side: spreading, pinning, and losing a pinned replica mid-generation."""

from __future__ import annotations

from orchestrator.servicer import TARGET_LINK
from specdec.v1 import orchestrator_pb2
from tests.conftest import collect, hf_greedy, wait_until
from tests.servers import LOOPBACK, OrchestratorThread, orchestrator_config, start_target


def _request(prompt: list[int], max_new_tokens: int, **fields) -> orchestrator_pb2.GenerateRequest:
    return orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=prompt), max_new_tokens=max_new_tokens, **fields
    )


def test_requests_are_spread_and_pinned(target_model, close_draft_server):
    first, second = start_target(target_model), start_target(target_model)
    addresses = f"{LOOPBACK}:{first.port},{LOOPBACK}:{second.port}"
    # The least-pinned rule alone: cache-aware routing would send both (one prompt) to one replica.
    orchestrator = OrchestratorThread(orchestrator_config(addresses, close_draft_server, cache_aware_routing=False))
    try:
        calls = [orchestrator.stub.Generate(_request([1, 2, 3], 150, num_speculative_tokens=2)) for _ in range(2)]
        for call in calls:
            next(call)
        # Two requests in flight: the least-pinned rule puts one on each replica, and each stays there.
        assert first.servicer.store.open_sessions == 1 and second.servicer.store.open_sessions == 1
        for call in calls:
            for _ in call:
                pass
        assert first.servicer.store.opened == 1 and second.servicer.store.opened == 1
    finally:
        orchestrator.stop()
        first.stop()
        second.stop()


def test_killed_target_replica_mid_generation_output_unchanged(target_model, close_draft_server):
    replicas = [start_target(target_model), start_target(target_model)]
    addresses = ",".join(f"{LOOPBACK}:{r.port}" for r in replicas)
    orchestrator = OrchestratorThread(orchestrator_config(addresses, close_draft_server))
    try:
        prompt = [8, 6, 7, 5, 3, 0, 9]
        expected = hf_greedy(target_model, prompt, 150)
        call = orchestrator.stub.Generate(_request(prompt, 150, num_speculative_tokens=3))
        ids = list(next(call).token_ids)
        pinned = next(r for r in replicas if r.servicer.store.open_sessions == 1)
        survivor = next(r for r in replicas if r is not pinned)
        pinned.stop()  # the replica dies; its cache with it
        last = None
        for message in call:
            ids += message.token_ids
            last = message
        assert ids == expected
        assert last is not None and last.stats.session_reopens >= 1
        assert survivor.servicer.store.opened >= 1
        assert wait_until(lambda: survivor.servicer.store.open_sessions == 0)
    finally:
        orchestrator.stop()
        for replica in replicas:
            replica.stop()


def test_killed_target_replica_mid_sampled_generation_keeps_the_seeds_output(target_model, close_draft_server):
    """The round's uniforms are drawn before its step is sent, and the target's answer is a function of
    the step alone: a step resent to another replica after a failover decides as the first would have,
    so the seed still gives its output."""
    replicas = [start_target(target_model), start_target(target_model)]
    addresses = ",".join(f"{LOOPBACK}:{r.port}" for r in replicas)
    orchestrator = OrchestratorThread(orchestrator_config(addresses, close_draft_server))
    try:
        request = _request(
            [8, 6, 7, 5, 3, 0, 9],
            120,
            num_speculative_tokens=3,
            speculation_policy=orchestrator_pb2.SPECULATION_POLICY_FIXED,
            temperature=1.0,
            seed=11,
        )
        expected, _, _ = collect(orchestrator.stub, request)
        call = orchestrator.stub.Generate(request)
        ids = list(next(call).token_ids)
        pinned = next(r for r in replicas if r.servicer.store.open_sessions == 1)
        pinned.stop()
        last = None
        for message in call:
            ids += message.token_ids
            last = message
        assert ids == expected
        assert last is not None and last.stats.session_reopens >= 1 and last.stats.draft_tokens > 0
    finally:
        orchestrator.stop()
        for replica in replicas:
            replica.stop()


def test_dns_name_resolves_to_replicas(target_model, target_server):
    orchestrator = OrchestratorThread(orchestrator_config(f"dns:///localhost:{target_server.port}"))
    try:
        prompt = [4, 4, 2]
        ids, _, _ = collect(orchestrator.stub, _request(prompt, 10))
        assert ids == hf_greedy(target_model, prompt, 10)
    finally:
        orchestrator.stop()


def test_replica_gone_from_dns_keeps_its_channel_until_its_sessions_end(monkeypatch):
    import asyncio

    from orchestrator import upstream

    answers = [["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:1"]]

    async def fake_resolve(name: str) -> list[str]:
        return answers.pop(0)

    monkeypatch.setattr(upstream, "resolve", fake_resolve)

    async def scenario() -> None:
        pool = upstream.ReplicaPool("target", "dns:///target:1", lambda channel: object(), TARGET_LINK, 3600)
        await pool.refresh()
        pinned = next(r for r in pool.replicas if r.address == "127.0.0.1:2")
        pinned.active = 1
        await pool.refresh()  # .2 is gone from DNS while a session is pinned to it
        assert [r.address for r in pool.replicas] == ["127.0.0.1:1"]
        assert pinned in pool._retired
        pinned.active = 0
        answers.append(["127.0.0.1:1"])
        await pool.refresh()  # its last session ended: the channel closes
        assert pool._retired == []
        await pool.close()

    asyncio.run(scenario())


def test_a_hung_target_replica_gives_a_deadline_error_and_is_avoided(tiny_pair, target_model):
    """A replica that stops answering (SIGSTOP): the request pinned to it ends with DEADLINE_EXCEEDED
    after --target-timeout-s, and the next requests go to the other replica."""
    import os
    import signal
    import subprocess
    import sys

    import grpc

    from tools.local_stack import free_port, wait_serving

    port = free_port()
    hung = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "target_service",
            "--model",
            str(tiny_pair.target),
            "--port",
            str(port),
            "--threads",
            "1",
        ],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    healthy = start_target(target_model)
    orchestrator = None
    try:
        wait_serving(f"{LOOPBACK}:{port}", 120, hung)
        addresses = f"{LOOPBACK}:{port},{LOOPBACK}:{healthy.port}"
        orchestrator = OrchestratorThread(
            orchestrator_config(addresses, target_timeout_s=2.0, cache_aware_routing=False)
        )
        calls = [orchestrator.stub.Generate(_request([5, 6], 200)) for _ in range(2)]
        for call in calls:
            next(call)  # one request on each replica (least pinned first)
        hung.send_signal(signal.SIGSTOP)
        outcomes = []
        for call in calls:
            try:
                for _ in call:
                    pass
                outcomes.append("ok")
            except grpc.RpcError as error:
                outcomes.append(error.code().name)
        assert sorted(outcomes) == ["DEADLINE_EXCEEDED", "ok"], outcomes
        prompt = [7, 3]
        for _ in range(3):  # the hung replica is avoided: these are served by the other one
            ids, _, _ = collect(orchestrator.stub, _request(prompt, 6))
            assert ids == hf_greedy(target_model, prompt, 6)
    finally:
        hung.send_signal(signal.SIGCONT)
        hung.kill()
        hung.wait()
        if orchestrator is not None:
            orchestrator.stop()
        healthy.stop()
