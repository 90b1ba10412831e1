"""A virtual-time asyncio event loop for unit tests of pure-asyncio code (no sockets, no threads).

loop.time() is a counter that moves only when every task waits on a timer: the loop then jumps to the next
timer at once instead of sleeping. asyncio.sleep(0.05), wait_for(..., 0.05) and a code's own loop.time()
arithmetic behave as on a real loop, but a preempted process (a busy CI machine) cannot make a window expire
early or late: what a test asserts about windows holds by construction. A loop with nothing ready and no timer
would wait forever on a real loop; here it fails at once (a deadlock, named)."""
from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class _Map(Mapping[Any, selectors.SelectorKey]):
    def __init__(self, keys: dict[Any, selectors.SelectorKey]) -> None:
        self._keys = keys

    def __getitem__(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys[fileobj]

    def __iter__(self) -> Any:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class _VirtualSelector(selectors.BaseSelector):
    """Keeps the loop's registrations (its self-pipe) and never reports I/O; select(timeout) advances time."""

    def __init__(self) -> None:
        self.loop: VirtualTimeLoop | None = None
        self._keys: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, selectors._fileobj_to_fd(fileobj), events, data)  # type: ignore[attr-defined]
        self._keys[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        assert self.loop is not None
        if timeout is None:
            raise RuntimeError("virtual-time loop: every task waits and no timer is set (a deadlock)")
        self.loop.advance(timeout)
        return []

    def close(self) -> None:
        self._keys.clear()

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return _Map(self._keys)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        selector = _VirtualSelector()
        self._now = 0.0
        super().__init__(selector)
        selector.loop = self

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += max(0.0, seconds)


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(coro) on a VirtualTimeLoop."""
    loop = VirtualTimeLoop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
