"""A session's call lock: first come, first served, for threads and coroutines alike.

Calls on one session are serialized. A waiting thread blocks on a condition; a waiting
coroutine awaits a future and never occupies a thread. Release hands the lock directly to
the oldest waiter, so a caller that arrived first is served first.

Cancellation safety, which a plain `threading.Lock` taken from `asyncio.to_thread` lacks
(the thread would take the lock after its coroutine was cancelled, and nobody would ever
release it):

* a coroutine cancelled while it waits leaves the queue; if the lock had just been handed
  to it, it passes the lock on before the cancellation propagates;
* a hand-over to a coroutine whose event loop is gone is passed on at once;
* `close()` wakes every waiter with `SandboxClosed`; the holder still releases normally.
"""

from __future__ import annotations

import collections
import threading
from typing import TYPE_CHECKING

from agent_sandbox._errors import SandboxClosed

if TYPE_CHECKING:
    import asyncio  # imported where used: a program that never awaits does not load it

__all__ = ["CallLock"]


class _Waiter:
    __slots__ = ("future", "loop")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None = None,
        future: asyncio.Future[None] | None = None,
    ) -> None:
        self.loop = loop
        self.future = future


class CallLock:
    """A FIFO lock; `acquire`/`release` from threads, `acquire_async` from coroutines."""

    def __init__(self, closed_message: str = "the session is closed") -> None:
        self._cond = threading.Condition(threading.Lock())
        self._holder: _Waiter | None = None
        self._queue: collections.deque[_Waiter] = collections.deque()
        self._closed = False
        self._closed_message = closed_message

    # -- state -----------------------------------------------------------------------------

    def locked(self) -> bool:
        with self._cond:
            return self._holder is not None

    def waiting(self) -> int:
        with self._cond:
            return len(self._queue)

    # -- threads ---------------------------------------------------------------------------

    def acquire(self, timeout: float | None = None) -> bool:
        """Wait for the lock (True), until `timeout` (False); SandboxClosed once closed."""
        me = _Waiter()
        with self._cond:
            if self._closed:
                raise SandboxClosed(self._closed_message)
            if self._holder is None and not self._queue:
                self._holder = me
                return True
            self._queue.append(me)
            granted = self._cond.wait_for(
                lambda: self._holder is me or self._closed, timeout=timeout
            )
            if self._holder is me:
                return True
            if me in self._queue:
                self._queue.remove(me)
            if self._closed:
                raise SandboxClosed(self._closed_message)
            assert not granted
            return False

    def release(self) -> None:
        with self._cond:
            if self._holder is None:
                raise RuntimeError("release of an unlocked CallLock")
            self._holder = None
            self._hand_over()

    def _hand_over(self) -> None:
        """Give the free lock to the oldest waiter that can still take it (cond held)."""
        while self._queue and self._holder is None:
            nxt = self._queue.popleft()
            if nxt.future is None:
                self._holder = nxt
                self._cond.notify_all()
                return
            if nxt.future.done():
                continue  # cancelled meanwhile
            self._holder = nxt
            try:
                assert nxt.loop is not None
                nxt.loop.call_soon_threadsafe(_grant, nxt.future)
            except RuntimeError:
                self._holder = None  # its event loop is closed: nobody will ever take it

    # -- coroutines ------------------------------------------------------------------------

    async def acquire_async(self) -> None:
        """Wait for the lock without a thread; cancellation never leaves it taken."""
        import asyncio  # loaded already: this runs in its loop

        loop = asyncio.get_running_loop()
        me = _Waiter(loop, loop.create_future())
        with self._cond:
            if self._closed:
                raise SandboxClosed(self._closed_message)
            if self._holder is None and not self._queue:
                self._holder = me
                return
            self._queue.append(me)
        assert me.future is not None
        try:
            await me.future
        except BaseException:
            with self._cond:
                if self._holder is me:
                    self._holder = None  # handed to us as we were cancelled: pass it on
                    self._hand_over()
                elif me in self._queue:
                    self._queue.remove(me)
            raise

    # -- end -------------------------------------------------------------------------------

    def close(self) -> None:
        """Refuse new waiters and wake the current ones with SandboxClosed."""
        with self._cond:
            self._closed = True
            queue = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for waiter in queue:
            if waiter.future is not None and waiter.loop is not None:
                try:
                    waiter.loop.call_soon_threadsafe(_fail, waiter.future, self._closed_message)
                except RuntimeError:
                    pass


def _grant(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _fail(future: asyncio.Future[None], message: str) -> None:
    if not future.done():
        future.set_exception(SandboxClosed(message))
