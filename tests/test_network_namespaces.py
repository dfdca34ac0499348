"""Draft, target and orchestrator as separate hosts: each in its own Linux network namespace, joined by
point-to-point veth links (orchestrator<->target, orchestrator<->draft, test<->orchestrator), so that
each service has its own address and reaches the others only over a network link."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import client_json
from tools.local_stack import orchestrator_command, service_command, stop_processes, wait_serving

PORT = 50051
# (namespace suffix, link name, orchestrator-side address, peer address); addresses stay inside the
# namespaces this test creates and removes.
LINKS = {
    "target": ("10.231.1.1", "10.231.1.2"),
    "draft": ("10.231.2.1", "10.231.2.2"),
    "client": ("10.231.3.2", "10.231.3.1"),  # the test itself stays in the root namespace
}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _skip_reason() -> str | None:
    if sys.platform != "linux" or shutil.which("ip") is None:
        return "needs Linux with iproute2 (`ip`)"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    probe = f"sdprobe{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except subprocess.CalledProcessError as exc:
        return f"cannot create network namespaces here: {exc.stderr.strip()}"
    return None


@pytest.fixture()
def hosts() -> Iterator[dict[str, str]]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:5]
    names = {role: f"sd{role[:3]}{tag}" for role in ("orchestrator", "target", "draft")}
    created: list[str] = []
    try:
        for name in names.values():
            _ip("netns", "add", name)
            created.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        orchestrator = names["orchestrator"]
        for role, (orch_address, peer_address) in LINKS.items():
            orch_end, peer_end = f"o{role[:3]}{tag}", f"p{role[:3]}{tag}"
            _ip("link", "add", orch_end, "type", "veth", "peer", "name", peer_end)
            _ip("link", "set", orch_end, "netns", orchestrator)
            _ip("-n", orchestrator, "addr", "add", f"{orch_address}/30", "dev", orch_end)
            _ip("-n", orchestrator, "link", "set", orch_end, "up")
            if role == "client":
                _ip("addr", "add", f"{peer_address}/30", "dev", peer_end)
                _ip("link", "set", peer_end, "up")
            else:
                _ip("link", "set", peer_end, "netns", names[role])
                _ip("-n", names[role], "addr", "add", f"{peer_address}/30", "dev", peer_end)
                _ip("-n", names[role], "link", "set", peer_end, "up")
        yield names
    finally:
        for name in created:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", f"pcli{tag}"], capture_output=True)


def _start_hosts(
    hosts: dict[str, str], tiny_pair, tmp_path: Path, *orchestrator_args: str
) -> list[subprocess.Popen[bytes]]:
    """The three services, each in its own namespace, with the command lines LocalStack uses."""
    target_address = f"{LINKS['target'][1]}:{PORT}"
    draft_address = f"{LINKS['draft'][1]}:{PORT}"
    commands = {
        "target": service_command("target", str(tiny_pair.target), LINKS["target"][1], PORT),
        "draft": service_command("draft", str(tiny_pair.close_draft), LINKS["draft"][1], PORT),
        "orchestrator": orchestrator_command(
            target_address, draft_address, LINKS["client"][0], PORT, *orchestrator_args
        ),
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    processes: list[subprocess.Popen[bytes]] = []
    for role in ("target", "draft", "orchestrator"):
        log = open(tmp_path / f"{role}.log", "wb")  # noqa: SIM115 - the process holds it
        processes.append(
            subprocess.Popen(
                ["ip", "netns", "exec", hosts[role], sys.executable, "-m", *commands[role]],
                stdout=log,
                stderr=log,
                env=env,
                cwd=Path(__file__).resolve().parents[1],
            )
        )
    wait_serving(f"{LINKS['client'][0]}:{PORT}", 120, processes[-1])
    return processes


@pytest.mark.slow
def test_generation_across_three_hosts(hosts, tiny_pair, tmp_path: Path):
    target_address = f"{LINKS['target'][1]}:{PORT}"
    orchestrator_address = f"{LINKS['client'][0]}:{PORT}"
    processes = _start_hosts(hosts, tiny_pair, tmp_path)
    try:
        # The fixed policy, so that every round asks the draft's host (load_aware may price K = 0 for
        # the tiny pair from the first round, and probe it only beside the target's steps).
        result = client_json(
            orchestrator_address,
            *("--prompt", "w2 w3", "--max-new-tokens", "10", "--num-speculative-tokens", "3", "--policy", "fixed"),
        )
        assert len(result["token_ids"]) >= 1 and result["stats"]["draft_tokens"] > 0
        # The target is not reachable from the test's own host: only the orchestrator links to it.
        unreachable = subprocess.run(
            [sys.executable, "-m", "tools.client", "--server", target_address, "--prompt", "x", "--timeout", "1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert unreachable.returncode != 0
    finally:
        stop_processes(processes)


@pytest.mark.slow
def test_the_draft_link_going_down_mid_generation_leaves_the_output_exact(hosts, tiny_pair, target_model, tmp_path):
    """The draft host's link is taken down mid-generation: the request finishes on the target alone, with
    the target's own tokens."""
    import grpc

    from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc
    from tests.conftest import hf_greedy

    processes = _start_hosts(hosts, tiny_pair, tmp_path, "--draft-timeout-s", "1", "--draft-retry-after-s", "60")
    prompt = [4, 8, 15, 16]
    try:
        with grpc.insecure_channel(f"{LINKS['client'][0]}:{PORT}") as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            request = orchestrator_pb2.GenerateRequest(
                token_ids=orchestrator_pb2.TokenIds(ids=prompt), max_new_tokens=120, num_speculative_tokens=3
            )
            call = stub.Generate(request)
            ids = list(next(call).token_ids)
            tag = hosts["draft"].removeprefix("sddra")
            _ip("-n", hosts["draft"], "link", "set", f"pdra{tag}", "down")
            last = None
            for message in call:
                ids += message.token_ids
                last = message
        assert last is not None and last.stats.draft_fallback_rounds > 0
        assert ids == hf_greedy(target_model, prompt, 120)
    finally:
        stop_processes(processes)
