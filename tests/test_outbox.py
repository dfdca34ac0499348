"""A request's outbox: rounds put, the writer takes everything gathered, merged, in order."""

from __future__ import annotations

import asyncio

from orchestrator.outbox import Outbox


def test_deltas_put_during_a_write_merge_into_the_next_message():
    async def scenario() -> list[tuple[str, list[int], bool]]:
        outbox = Outbox()
        taken = []
        outbox.put("a", [1])
        taken.append(await outbox.take())
        outbox.put("b", [2])  # while the first message is being written
        outbox.put("", [3])  # a token whose text is not final yet
        outbox.put("cd", [4, 5])
        taken.append(await outbox.take())
        outbox.close()
        taken.append(await outbox.take())
        return [(chunk.text, chunk.token_ids, chunk.closed) for chunk in taken]

    assert asyncio.run(scenario()) == [("a", [1], False), ("bcd", [2, 3, 4, 5], False), ("", [], True)]


def test_a_take_waits_for_the_next_round_or_the_close():
    async def scenario() -> bool:
        outbox = Outbox()
        waiting = asyncio.create_task(outbox.take())
        await asyncio.sleep(0.01)
        if waiting.done():
            return False
        outbox.close()
        return (await waiting).closed

    assert asyncio.run(scenario())
