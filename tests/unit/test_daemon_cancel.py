"""The daemon's stop cancels its root tasks until each has ended (supervisor/root_tasks.py):
on Python 3.11 a cancellation that arrives as an awaited MQTT acknowledgement does is
dropped inside ``asyncio.wait_for``, and a `run` whose outbox task kept publishing never
stopped."""

from __future__ import annotations

import asyncio

from supervisor.root_tasks import cancelled


async def _publishing_on(dropped: list[int]) -> None:
    """An outbox that loses the first cancellation it is sent, as wait_for lost it."""
    while True:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            if dropped:
                raise
            dropped.append(1)  # dropped: goes on publishing


def test_a_root_task_that_drops_a_cancellation_is_cancelled_again_until_it_ends() -> None:
    async def scenario() -> tuple[bool, bool]:
        dropped: list[int] = []
        once = asyncio.create_task(_publishing_on([]))
        await asyncio.sleep(0.1)  # publishing
        once.cancel()
        await asyncio.wait([once], timeout=0.5)
        held = not once.done()  # one cancel, as the stop sent it before: still running
        task = asyncio.create_task(_publishing_on(dropped))
        await asyncio.sleep(0.1)
        async with asyncio.timeout(5):
            await cancelled([task, once])
        return held, task.cancelled() and once.cancelled() and dropped == [1]

    held, ended = asyncio.run(scenario())
    assert held, "the stand-in must drop its first cancellation"
    assert ended


def test_tasks_already_ended_or_failed_are_taken_as_they_are() -> None:
    async def scenario() -> bool:
        async def fails() -> None:
            raise RuntimeError("died")

        done = asyncio.create_task(asyncio.sleep(0))
        failed = asyncio.create_task(fails())
        await asyncio.sleep(0.01)
        await cancelled([done, failed])
        return done.done() and failed.done()

    assert asyncio.run(scenario())
