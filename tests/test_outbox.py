"""A request's outbox: rounds put, the writer takes everything gathered, merged, in order."""

from __future__ import annotations

import asyncio

from orchestrator.outbox import Chunk, Outbox


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


def test_a_stream_interval_gathers_tokens_but_never_holds_the_first_or_the_last():
    async def scenario() -> list[tuple[list[int], bool]]:
        outbox = Outbox(interval=3, hold_s=lambda: 60.0)
        taken = [await _put_take(outbox, [1])]  # the first token goes at once
        outbox.put("", [2])
        outbox.put("", [3])
        waiting = asyncio.create_task(outbox.take())
        await asyncio.sleep(0.01)
        assert not waiting.done()  # two tokens of three, and the hold is long
        outbox.put("", [4, 5])
        taken.append(await waiting)
        outbox.put("", [6])
        outbox.close()  # the last message is never held
        taken.append(await outbox.take())
        return [(chunk.token_ids, chunk.closed) for chunk in taken]

    assert asyncio.run(scenario()) == [([1], False), ([2, 3, 4, 5], False), ([6], True)]


def test_a_held_token_waits_no_longer_than_the_hold():
    """Below the interval, a message goes out once its oldest token has waited about one round."""

    async def scenario() -> tuple[list[int], float]:
        outbox = Outbox(interval=8, hold_s=lambda: 0.05)
        await _put_take(outbox, [1])
        started = asyncio.get_running_loop().time()
        outbox.put("", [2])
        chunk = await outbox.take()
        return chunk.token_ids, asyncio.get_running_loop().time() - started

    token_ids, waited = asyncio.run(scenario())
    assert token_ids == [2] and 0.04 <= waited < 1.0


async def _put_take(outbox: Outbox, token_ids: list[int]) -> Chunk:
    outbox.put("", token_ids)
    return await outbox.take()
