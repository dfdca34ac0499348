"""Run draft, target and orchestrator as three processes on loopback, as `make run` does.

    python -m tools.local_stack [--target-model PATH] [--draft-model PATH] [--prompt TEXT]
    specdec-local                        (the same, installed; the shipped default pair)

Each service is its own process with its own port, exactly as it would be on its own machine; this
module only starts them, waits until they report SERVING, and ends them by pid.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import default_models
from serving.cpus import available_cpus
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from tools.client import generate, summary
from tools.netns import Hosts

LOOPBACK = "127.0.0.1"
# The default model pair, shipped with the package (default_models/pair).
DEFAULT_PAIR = Path(default_models.__file__).resolve().parent / "pair"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def wait_serving(address: str, timeout_s: float, process: subprocess.Popen[bytes]) -> None:
    """Poll standard gRPC health until SERVING; fail early if the process died."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the process for {address} exited with code {process.returncode}")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} was not SERVING within {timeout_s:.0f} s")


def service_command(role: str, model: str, host: str, port: int, *extra: str) -> list[str]:
    """The `python -m` arguments that start a model service ("target" or "draft")."""
    return [f"{role}_service", "--model", model, "--host", host, "--port", str(port), *extra]


def orchestrator_command(target: str, draft: str | None, host: str, port: int, *extra: str) -> list[str]:
    """The `python -m` arguments that start an orchestrator over these services."""
    return ["orchestrator", "--target", target, *(["--draft", draft] if draft else []), "--host", host,
            "--port", str(port), *extra]  # fmt: skip


def stop_processes(processes: Sequence[subprocess.Popen[bytes]], timeout_s: float = 15) -> None:
    """SIGTERM every process by pid (the servers drain), then SIGKILL whatever is left."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class LocalStack:
    """Three processes on loopback; a context manager that always ends them."""

    target_model: str
    draft_model: str | None
    extra_orchestrator_args: Sequence[str] = ()
    extra_service_args: Sequence[str] = ()
    role_args: dict[str, Sequence[str]] = field(default_factory=dict)  # more flags for "target" or "draft" alone
    log_dir: Path | None = None
    startup_timeout_s: float = 300.0
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)  # by name: target, draft, orchestrator
    _logs: list[IO[bytes]] = field(default_factory=list)
    orchestrator_address: str = ""
    target_address: str = ""
    draft_address: str = ""
    cpus: dict[str, set[int]] = field(default_factory=dict)  # cores to pin a process to, by name
    with_metrics: bool = False  # give each process a Prometheus port (metrics_ports, by name)
    metrics_ports: dict[str, int] = field(default_factory=dict)
    hosts: Hosts | None = None  # the model services' namespaces, behind links (tools/netns.py); None: loopback
    target_replicas: int = 1  # more start target-2, target-3 ... beside `target`, all behind the orchestrator
    cwd: Path | None = None  # where the processes start: `python -m` imports the code found there first

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        if self.with_metrics:
            self.metrics_ports[name] = free_port()
            args = [*args, "--metrics-port", str(self.metrics_ports[name])]
        out: IO[bytes] | int = subprocess.DEVNULL
        if self.log_dir:
            out = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
            self._logs.append(out)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        argv = [sys.executable, "-m", *args]
        if self.hosts is not None and name in self.hosts.hosts:
            argv = self.hosts.command(name, argv)  # `ip netns exec` execs the command: the pid stays
        process = subprocess.Popen(argv, stdout=out, stderr=out, env=env, cwd=self.cwd)
        self.processes.append(process)
        self.pids[name] = process.pid
        if name in self.cpus:  # before it starts its threads, which inherit the affinity
            os.sched_setaffinity(process.pid, self.cpus[name])
        return process

    def _role_args(self, role: str) -> list[str]:
        return [*self._service_args(), *self.role_args.get(role, ())]

    def _service_args(self) -> list[str]:
        """The services share this machine's cores: unless told otherwise, each model service gets
        half of those this process may use (its affinity and cgroup quota), so that two OpenMP pools
        do not fight over the same cores (measured on 2 cores: 8 concurrent streams at K = 2 ran 1.6x
        faster with one thread per service than with two)."""
        args = list(self.extra_service_args)
        if "--threads" not in args:
            args += ["--threads", str(max(1, available_cpus() // 2))]
        return args

    def __enter__(self) -> LocalStack:
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            waits = []
            addresses = []
            for replica in range(self.target_replicas):
                name = "target" if replica == 0 else f"target-{replica + 1}"
                host, target_port = self._place(name)
                addresses.append(f"{host}:{target_port}")
                target = self._spawn(
                    name, service_command("target", self.target_model, host, target_port, *self._role_args("target"))
                )
                waits.append((addresses[-1], target))
            self.target_address = ",".join(addresses)
            if self.draft_model:
                host, draft_port = self._place("draft")
                self.draft_address = f"{host}:{draft_port}"
                draft = self._spawn(
                    "draft", service_command("draft", self.draft_model, host, draft_port, *self._role_args("draft"))
                )
                waits.append((self.draft_address, draft))
            for address, process in waits:
                wait_serving(address, self.startup_timeout_s, process)
            port = free_port()
            self.orchestrator_address = f"{LOOPBACK}:{port}"
            orchestrator = self._spawn(
                "orchestrator",
                orchestrator_command(
                    self.target_address, self.draft_address or None, LOOPBACK, port, *self.extra_orchestrator_args
                ),
            )
            wait_serving(self.orchestrator_address, self.startup_timeout_s, orchestrator)
        except BaseException:
            self.stop()
            raise
        return self

    def _place(self, role: str) -> tuple[str, int]:
        """Where a model service listens: its namespace's address (a port of its own there), or loopback."""
        if self.hosts is not None and role in self.hosts.hosts:
            return self.hosts.hosts[role].address, 50051
        return LOOPBACK, free_port()

    def stop(self) -> None:
        """SIGTERM every process by pid (they drain), then SIGKILL whatever is left."""
        stop_processes(self.processes)
        self.processes.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools.local_stack", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target-model", default=str(DEFAULT_PAIR / "target"), help="default: the shipped pair's")
    parser.add_argument("--draft-model", default=str(DEFAULT_PAIR / "draft"), help="default: the shipped pair's")
    parser.add_argument("--no-draft", action="store_true", help="run the target alone")
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--num-speculative-tokens", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--log-dir", type=Path, default=None, help="write each service's log here")
    args = parser.parse_args(argv)
    if args.no_draft:
        args.draft_model = None
    print(
        f"starting target ({args.target_model}), draft ({args.draft_model}) and orchestrator on {LOOPBACK} ...",
        file=sys.stderr,
    )
    # One generation: a small pool (the services take theirs whole at start), so that they start fast.
    small = ["--max-sessions", "4"]
    with (
        LocalStack(args.target_model, args.draft_model, log_dir=args.log_dir, extra_service_args=small) as stack,
        grpc.insecure_channel(stack.orchestrator_address) as channel,
    ):
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        request = orchestrator_pb2.GenerateRequest(
            text=args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=0,
            num_speculative_tokens=args.num_speculative_tokens if args.draft_model else 0,
        )
        generate(stub, request)  # warm-up: first forward passes allocate and compile kernels
        print(f"--- specdec, load_aware, K up to {request.num_speculative_tokens} ---\n{args.prompt}", end="")
        speculative = generate(stub, request, echo=True)
        print("\n\n" + summary(speculative))
        if args.draft_model:
            request.num_speculative_tokens = 0
            baseline = generate(stub, request)
            if args.temperature == 0:
                same = "identical" if baseline.token_ids == speculative.token_ids else "DIFFERENT"
            else:
                same = "sampled from the same distribution"
            speedup = (len(speculative.token_ids) / speculative.wall_seconds) / (
                len(baseline.token_ids) / baseline.wall_seconds
            )
            print(f"target alone (K = 0): {summary(baseline)}")
            print(f"speed-up over the target alone: {speedup:.2f}x; outputs {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
