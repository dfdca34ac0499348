"""`--workers N`: N orchestrator processes serving one port.

gRPC's core binds with SO_REUSEPORT, so every worker binds the same port (and health port) and the
kernel spreads new TCP connections over them: balancing is per connection, so a client must open
several channels to use several workers (identical channels share one connection unless each has
`grpc.use_local_subchannel_pool`). Each worker keeps its own links to the model services (the
services batch the steps of every link together), its own routing index and its share of admission
(`--max-running-requests` and `--max-queued-requests` divided among the workers).

The workers are spawned before this process creates any gRPC object (gRPC's state does not survive
a fork) and write their metrics in prometheus_client's multiprocess mode; this process serves them
summed on `--metrics-port`, so one scrape target still covers the pod. SIGTERM and SIGINT are passed on,
and a worker that dies takes the others down with it, for the supervisor to restart the whole.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import socket
import tempfile
import time
from dataclasses import replace
from multiprocessing.process import BaseProcess
from typing import Any

import structlog

from orchestrator.config import OrchestratorConfig
from serving.cpus import available_cpus

log = structlog.get_logger(__name__)

_POLL_S = 0.2


def worker_count(spec: str) -> int:
    """`auto`: the CPU quota (cgroup quota and affinity), at least 1; else a count of at least 1."""
    if spec == "auto":
        return max(1, available_cpus())
    count = int(spec)
    if count < 1:
        raise ValueError(spec)
    return count


def share(total: int, workers: int) -> int:
    """One worker's share of an admission limit (0 stays 0: derived by each worker, then divided)."""
    return math.ceil(total / workers) if total else 0


def run_workers(config: OrchestratorConfig, workers: int) -> int:
    """Spawn the workers and wait for them; returns the exit status."""
    port = config.port or _free_port(config.host)
    metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or tempfile.mkdtemp(prefix="specdec-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # the workers inherit it: set before they import
    # Each worker knows the count (its admission share); none serves metrics itself.
    worker_config = replace(config, port=port, metrics_port=0, workers=str(workers))
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=_worker, args=(worker_config, index), name=f"orchestrator-{index}", daemon=False)
        for index in range(workers)
    ]
    for process in processes:
        process.start()
    log.info("workers_started", workers=workers, port=port, pids=[p.pid for p in processes])
    _serve_metrics(config.host, config.metrics_port)
    stopping = False

    def stop(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for process in processes:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    status, ended = 0, set[int]()
    while len(ended) < len(processes):
        time.sleep(_POLL_S)
        for index, process in enumerate(processes):
            if process.exitcode is None or index in ended:
                continue
            ended.add(index)
            _mark_dead(process)
            if process.exitcode != 0 and not stopping:
                log.error("worker_died", worker=index, exitcode=process.exitcode)
                status = 1
                stop(signal.SIGTERM, None)
    return status


def _worker(config: OrchestratorConfig, index: int) -> None:
    import asyncio

    from orchestrator.app import serve
    from orchestrator.pair import PairMismatch
    from serving.log_setup import configure_logging

    configure_logging(config.log_level)
    structlog.contextvars.bind_contextvars(worker=index)
    try:
        asyncio.run(serve(config))
    except (PairMismatch, ConnectionError) as exc:
        raise SystemExit(f"orchestrator worker {index}: {exc}") from exc


def _serve_metrics(host: str, port: int) -> None:
    """Every worker's metrics, summed, on one port (0: none)."""
    if not port:
        return
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    start_http_server(port, addr=host, registry=registry)
    log.info("metrics_listening", host=host, port=port, workers="all")


def _mark_dead(process: BaseProcess) -> None:
    """A worker's live gauges leave the sums when it exits."""
    from prometheus_client import multiprocess

    if process.pid is not None:
        multiprocess.mark_process_dead(process.pid)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
