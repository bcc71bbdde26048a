"""Lifecycle edges: cancellation, closing while others wait, and what a closed sandbox says.

Every wait in these tests is bounded (a hang is a failure, not a stuck run).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from agent_sandbox import Policy, Sandbox, SandboxClosed
from agent_sandbox._calllock import CallLock


async def test_an_arun_cancelled_while_it_waits_for_the_lock_does_not_lock_the_session(
    policy: Policy,
) -> None:
    """It leaves the session usable after a waiting `arun` is cancelled (asyncio.wait_for)."""
    with Sandbox(policy, warm=0) as sb:
        session = sb.session("s")
        await session.arun("x = 1")
        running = asyncio.ensure_future(session.arun("import time\ntime.sleep(0.5)\nx = 2"))
        await asyncio.sleep(0.1)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(session.arun("x = 3"), 0.05)
        assert (await asyncio.wait_for(running, 10)).ok
        result = await asyncio.wait_for(session.arun("x"), 10)
        assert result.value == 2
        assert not session._lock.locked()
        # the sync path too, with its own timeout
        done = await asyncio.to_thread(session.run, "x + 1", timeout=5)
        assert done.value == 3


async def test_arun_cancelled_at_every_await_point_leaves_the_session_usable(
    policy: Policy,
) -> None:
    """It cancels one call after 0, 1, 2, ... loop steps until it completes on its own; after
    each cancellation the lock is free and the next call runs."""
    with Sandbox(policy, warm=0) as sb:
        session = sb.session("steps")
        await session.arun("n = 0")
        completed = False
        steps = 0
        while not completed and steps < 400:
            task = asyncio.ensure_future(session.arun("n += 1\nn"))
            for _ in range(steps):
                await asyncio.sleep(0)
            completed = task.done()
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            after = await asyncio.wait_for(session.arun("'still here'"), 10)
            assert after.value == "still here", (steps, after.error)
            assert not session._lock.locked()
            steps += 1
        assert completed, "the call never completed within 400 loop steps"


async def test_arun_cancelled_while_its_worker_starts(policy: Policy) -> None:
    """It hands the lock to the starting thread: the cancelled call returns at once, the
    worker it started is the session's, and the next call runs in it."""
    with Sandbox(policy, warm=0) as sb:
        session = sb.session("fresh")
        task = asyncio.ensure_future(session.arun("1"))
        for _ in range(3):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        result = await asyncio.wait_for(session.arun("2"), 15)
        assert result.value == 2 and not result.state_lost
        assert not session._lock.locked()


def test_closing_a_session_wakes_every_waiter(policy: Policy) -> None:
    """It answers every call waiting for a session's lock with SandboxClosed on close()."""
    with Sandbox(policy, warm=0) as sb:
        session = sb.session("busy")
        session.run("1")
        out: dict[str, object] = {}

        def runner() -> None:
            out["running"] = session.run("import time\ntime.sleep(30)", timeout=30)

        def waiter() -> None:
            try:
                session.run("1")
            except SandboxClosed as exc:
                out["waiter"] = exc

        async def async_waiter() -> None:
            try:
                await session.arun("1")
            except SandboxClosed as exc:
                out["async"] = exc

        threads = [threading.Thread(target=runner)]
        threads[0].start()
        while not session._lock.locked():
            threading.Event().wait(0.01)
        threads.append(threading.Thread(target=waiter))
        threads.append(threading.Thread(target=asyncio.run, args=(async_waiter(),)))
        threads[1].start()
        threads[2].start()
        while session._lock.waiting() < 2:
            threading.Event().wait(0.01)
        session.close()
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads)
        assert isinstance(out["waiter"], SandboxClosed)
        assert isinstance(out["async"], SandboxClosed)
        running = out["running"]
        assert running.error is not None and running.error.type == "SandboxClosed"  # type: ignore[attr-defined]


async def test_sandbox_arun_says_sandbox_closed_when_closed_mid_call(policy: Policy) -> None:
    """It reports a stateless async call cut short by close() as SandboxClosed, not a crash."""
    sb = Sandbox(policy, warm=0)
    task = asyncio.ensure_future(sb.arun("import time\nprint('go', flush=True)\ntime.sleep(30)"))
    while not sb._active:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    sb.close()
    result = await asyncio.wait_for(task, 10)
    assert result.error is not None and result.error.type == "SandboxClosed"
    with pytest.raises(SandboxClosed):
        await sb.arun("1")


def test_call_lock_is_first_come_first_served() -> None:
    """It hands the lock to waiters in arrival order."""
    lock = CallLock()
    lock.acquire()
    order: list[int] = []
    threads = []
    for i in range(5):
        t = threading.Thread(target=lambda i=i: (lock.acquire(), order.append(i), lock.release()))
        t.start()
        while lock.waiting() < i + 1:
            threading.Event().wait(0.001)
        threads.append(t)
    lock.release()
    for t in threads:
        t.join(5)
    assert order == [0, 1, 2, 3, 4]


def test_call_lock_passes_on_a_grant_to_a_closed_event_loop() -> None:
    """It never leaves the lock taken by a coroutine whose event loop is gone."""
    lock = CallLock()
    lock.acquire()
    loop = asyncio.new_event_loop()
    task = loop.create_task(lock.acquire_async())
    loop.run_until_complete(asyncio.sleep(0))  # the coroutine is now queued
    assert lock.waiting() == 1
    task.cancel()
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    lock.release()
    assert not lock.locked()
    assert lock.acquire(timeout=1)
