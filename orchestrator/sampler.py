"""Accept/reject over the batch: the last tokens of every sampled round whose rows arrived in the same
turn of the event loop are sampled in one `last_tokens` call.

A link's answer resolves the steps of every session it carries at once, so their requests resume in
the same turn; each hands its round here and waits, and the batch is decided in the next turn, after
all of them (the link writer's coalescing, for verdicts). A round that arrives alone is a batch of
one. Each round carries its own uniforms, so the batch never changes a verdict; should the batched
call fail, every round is decided alone, so that a bad round fails only its own request.
"""

from __future__ import annotations

import asyncio

from orchestrator.rejection import CompactRound, Verdict, last_tokens


class BatchSampler:
    """Shared by the requests of one orchestrator (one event loop)."""

    def __init__(self) -> None:
        self._pending: list[tuple[CompactRound, asyncio.Future[Verdict]]] = []

    async def verdict(self, round_: CompactRound) -> Verdict:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Verdict] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._decide)
        self._pending.append((round_, future))
        return await future

    def _decide(self) -> None:
        pending, self._pending = self._pending, []
        waiting = [(round_, future) for round_, future in pending if not future.done()]  # not cancelled
        try:
            verdicts = last_tokens([round_ for round_, _ in waiting])
        except Exception:  # noqa: BLE001 - decided alone below, where the failing round gets its own error
            for round_, future in waiting:
                try:
                    future.set_result(last_tokens([round_])[0])
                except Exception as exc:  # noqa: BLE001 - that request's failure, delivered to it
                    future.set_exception(exc)
            return
        for (_, future), verdict in zip(waiting, verdicts, strict=True):
            future.set_result(verdict)
