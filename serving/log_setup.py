"""structlog configuration: JSON lines when not on a terminal, readable lines on one."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(level: str = "info") -> None:
    """Configure structlog once per process, at start-up (never at import time)."""
    # Tokenizers' own thread pool fights gRPC's threads and warns after a fork; the services don't need it.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer() if sys.stderr.isatty() else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        # One write per line: with unbuffered streams (PYTHONUNBUFFERED, as the image sets) print() writes
        # the line and its newline apart, and the lines of processes sharing stderr (--workers) ran together.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
