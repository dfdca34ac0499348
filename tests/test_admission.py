"""Queueing, not refusing: the admission gate in front of Generate."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from orchestrator.admission import Admission
from serving.errors import ServiceError


def test_requests_queue_in_order_and_are_refused_only_past_the_bounds():
    async def scenario() -> list[str]:
        gate = Admission(max_running=1, max_queued=2, max_wait_s=5.0)
        order: list[str] = []
        await gate.acquire()  # the one running request

        async def queued(name: str) -> None:
            await gate.acquire()
            order.append(name)

        first, second = asyncio.create_task(queued("a")), asyncio.create_task(queued("b"))
        await asyncio.sleep(0.01)
        assert gate.queued == 2
        with pytest.raises(ServiceError) as error:
            await gate.acquire()  # the queue is full
        assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "full" in error.value.message
        gate.release()
        await first
        gate.release()
        await second
        gate.release()
        assert gate.running == 0
        return order

    assert asyncio.run(scenario()) == ["a", "b"]


def test_a_wait_is_bounded_and_a_cancelled_waiter_gives_up_its_place():
    async def scenario() -> None:
        gate = Admission(max_running=1, max_queued=4, max_wait_s=0.05)
        await gate.acquire()
        with pytest.raises(ServiceError) as error:
            await gate.acquire()
        assert "waited" in error.value.message and gate.queued == 0
        gate.max_wait_s = 5.0
        waiter = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        gate.release()
        assert gate.running == 0 and gate.queued == 0

    asyncio.run(scenario())
