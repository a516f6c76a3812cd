"""The tuner in the server's event loop.

Every ``interval`` one ``Tuner.decide_and_write`` runs in a worker thread (its database reads and
writes never stall the loop that serves ``/v1``); then, from the loop itself, the policy version it
wrote goes to the ``PolicyService``'s subscribers, so the engine holds it when the tick ends.  No
other thread touches the engine, and nothing waits on another loop's future.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from .job import Tuner

log = logging.getLogger(__name__)


class TunerTask:
    def __init__(self, tuner: Tuner, interval_s: float) -> None:
        self.tuner, self.interval_s = tuner, interval_s
        self._task: asyncio.Task[None] | None = None

    async def tick(self) -> list[dict[str, Any]]:
        """One run: its decisions, and what it wrote in force on every subscriber."""
        run = await asyncio.to_thread(self.tuner.decide_and_write)
        if run.written is not None:
            await self.tuner.policies.publish(run.written)
        return run.decisions

    async def run_forever(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + self.interval_s  # the first run after one interval: the engine's first records
        while True:
            await asyncio.sleep(max(0.0, due - loop.time()))
            try:
                await self.tick()
            except Exception:
                log.exception("tuner run failed; the policy in force stays, next run in %.0f s", self.interval_s)
            # A run longer than the interval is not made up for: the next one starts when it ends.
            due = max(due + self.interval_s, loop.time())

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run_forever(), name="tuner")

    async def stop(self) -> None:
        """Cancels the loop; a run already in its worker thread finishes there, unpublished (the
        next start resumes the stored policy)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
