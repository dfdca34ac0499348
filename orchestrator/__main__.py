"""python -m orchestrator --target HOST:PORT [--draft HOST:PORT] --port N"""

import asyncio

from orchestrator.app import serve
from orchestrator.config import parse_orchestrator_config
from orchestrator.pair import PairMismatch
from orchestrator.workers import run_workers, worker_count
from serving.log_setup import configure_logging


def main() -> None:
    config = parse_orchestrator_config()
    configure_logging(config.log_level)
    workers = worker_count(config.workers)
    if workers > 1:  # before any gRPC object exists in this process
        raise SystemExit(run_workers(config, workers))
    try:
        asyncio.run(serve(config))
    except (PairMismatch, ConnectionError) as exc:
        raise SystemExit(f"orchestrator: {exc}") from exc


if __name__ == "__main__":
    main()
