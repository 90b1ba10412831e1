"""--reference: the served model checked against the reference vectors its export wrote (bge_triton.verify),
at start and again whenever Triton was unreachable and came back; /ready stays 503 until the check holds.

The check (13 probe texts through the text endpoint and through the encoder) runs in a daemon thread, off the
event loop: a gateway told to stop mid-check exits at once instead of waiting out the check's timeouts (anyio's
and concurrent.futures' worker threads are joined at exit). Its message is logged exactly as `bge-triton verify`
prints it; /ready carries it in the API's words: the reference file by its name only, and a check that could not
run (Triton's address, grpc's words) only as "could not run, see the gateway's log".
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from bge_triton.gateway.backend import Backend
from bge_triton.gateway.settings import GatewaySettings
from bge_triton.verify import Result, check

__all__ = ["ReferenceGate", "Check"]

log = logging.getLogger("bge_triton.gateway")

#: (url, model, reference, timeout_s) -> the verdict; bge_triton.verify.check by default, a fake in unit tests
Check = Callable[[str, str, str, float], Result]


def _verify(url: str, model: str, reference: str, timeout_s: float) -> Result:
    return check(url, model, reference=reference, protocol="grpc", timeout_s=timeout_s)


class ReferenceGate:
    """The verdict behind /ready: `ok` once the check held since Triton last came up, `message` for /ready."""

    def __init__(self, settings: GatewaySettings, backend: Backend, verify: Check | None = None,
                 on_verdict: Callable[[bool], None] | None = None) -> None:
        assert settings.reference is not None
        self.s, self.backend, self.reference = settings, backend, settings.reference
        self.verify: Check = verify or _verify
        self.on_verdict = on_verdict or (lambda ok: None)
        self.ok = False
        self.message = f"model {settings.model}: not verified yet against the reference vectors (--reference)"
        self.checks = 0  # checks run (the tests count them)
        self._logged = ""
        self._task: asyncio.Task[None] | None = None

    def _public(self, result: Result) -> str:
        if result.fault == "unavailable":  # the details name Triton's address: the log has them
            return (f"model {self.s.model}: the check against the reference vectors could not run (the gateway's "
                    "log says why); retrying")
        return result.message.replace(self.reference, Path(self.reference).name)

    def _record(self, result: Result) -> None:
        self.checks += 1
        self.ok, self.message = result.ok, self._public(result)
        self.on_verdict(result.ok)
        if result.message != self._logged:  # a verdict is logged when it changes, as `bge-triton verify` prints it
            (log.info if result.ok else log.warning)("%s", result.message)
            self._logged = result.message

    async def run_once(self) -> Result:
        """One check, in a daemon thread (it blocks for as long as the probes take)."""
        try:
            result = await _in_daemon_thread(self.verify, f"grpc://{self.s.triton}", self.s.model, self.reference,
                                             self.s.timeout_s)
        except Exception as exc:  # the check never raises for a server fault; anything else is a bug: say so
            log.exception("verify against %s failed", self.reference)
            result = Result(self.s.model, "?", "?", "?", ok=False, fault="unavailable",
                            message=f"verify could not run: {type(exc).__name__}: {exc}")
        self._record(result)
        return result

    async def _loop(self) -> None:
        """Check once Triton answers; again after it was unreachable; a failed verdict every --verify-retry s."""
        loop = asyncio.get_running_loop()
        due, was_up, retry_at = True, False, 0.0
        while True:
            up = self.backend.ready()
            if not up and was_up:  # Triton went away: whatever comes back is verified again before /ready is 200
                self.ok, due = False, True
                self.message = (f"model {self.s.model}: Triton was unreachable; the served model is verified again "
                                "against the reference vectors once it answers")
                self.on_verdict(False)
            elif up and (due or (not self.ok and loop.time() >= retry_at)):
                result = await self.run_once()
                due = result.fault == "unavailable"  # could not run: try again at the next turn
                retry_at = loop.time() + self.s.verify_retry_s
            was_up = up
            await asyncio.sleep(self.s.canary_interval_s)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


async def _in_daemon_thread(fn: Check, url: str, model: str, reference: str, timeout_s: float) -> Result:
    """fn(...) in a new daemon thread, awaited; cancelling the await abandons the thread."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Result] = loop.create_future()

    def settle(result: Result | None, error: BaseException | None) -> None:
        if done.done():  # cancelled meanwhile
            return
        if error is not None:
            done.set_exception(error)
        else:
            assert result is not None
            done.set_result(result)

    def run() -> None:
        result: Result | None = None
        error: BaseException | None = None
        try:
            result = fn(url, model, reference, timeout_s)
        except BaseException as exc:  # handed to the awaiting task, which logs it
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed while the check ran: nobody waits for it
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="gateway-verify", daemon=True).start()
    return await done
