"""The one way a policy changes: ``PolicyService``.

API routes and the tuner both write through it; what it writes goes to its subscribers in the
server's event loop (the embedded engine's ``EmbeddedControl``; a remote engine follows over HTTP,
``PolicyFollower``, reading the same service through ``/api/v1/engines/{instance}/settings``).

    routes ----validate, write---->  PolicyService --publish--> EmbeddedControl --settings--> engine
    tuner (TunerTask) --commit---->        |
                                  store/policies (versions, audit)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Protocol

from fastapi.concurrency import run_in_threadpool
from sqlalchemy import Connection, Engine

from spectune.store.policies import PolicyRepository, Versioned
from spectune.tuner.policy import PolicyDocument, validate_document

log = logging.getLogger(__name__)


class PolicySubscriber(Protocol):
    """Something that runs the policy: it refuses what it cannot do, and applies what was written."""

    def check(self, doc: PolicyDocument) -> None:
        """Raise ValueError for a document this subscriber cannot run (e.g. N above its capacity)."""

    async def apply(self, current: Versioned) -> Any:
        """Put ``current`` in force; returns once it is."""


def _utc_now() -> datetime:
    return datetime.now(UTC)


class PolicyService:
    """Reads, validation and writes of the one policy document, and its change feed.

    ``startup_classes``: the engines' classes where the policy names none (its classifier replaces them).
    ``clock``: the time versions are stamped with (simulated in the tuner's replay and tests).
    """

    def __init__(
        self, db: Engine, startup_classes: set[str] | frozenset[str], clock: Callable[[], datetime] = _utc_now
    ) -> None:
        self.db, self.clock = db, clock
        self.startup_classes = frozenset(startup_classes)
        self.repository = PolicyRepository(db, clock=clock)
        self._subscribers: list[PolicySubscriber] = []

    def subscribe(self, subscriber: PolicySubscriber) -> None:
        self._subscribers.append(subscriber)

    # -- reads (blocking: routes call them from the thread pool) --

    def current(self) -> Versioned:
        current = self.repository.current()
        if current is None:
            raise LookupError("no policy yet: the server creates version 1 at start (PolicyService.resume)")
        return current

    def document(self, current: Versioned | None = None) -> PolicyDocument:
        return PolicyDocument.model_validate((current or self.current()).body)

    def known_classes(self, doc: PolicyDocument | None = None) -> set[str]:
        """The classes in force: the policy's classifier where it has one, else the start-up classes."""
        if doc is None:
            current = self.repository.current()
            doc = self.document(current) if current is not None else PolicyDocument()
        return doc.known_classes(self.startup_classes)

    # -- validation --

    def validated(self, body: dict[str, Any]) -> PolicyDocument:
        """``body`` as a document every subscriber can run; pydantic's ValidationError or ValueError otherwise."""
        doc = PolicyDocument.model_validate(body)
        validate_document(doc, set(self.startup_classes))
        for subscriber in self._subscribers:
            subscriber.check(doc)
        return doc

    # -- writes --

    def commit(
        self,
        body: dict[str, Any],
        expected: int,
        actor: str,
        reason: str | None,
        action: str,
        conn: Connection | None = None,
    ) -> Versioned:
        """The new version, validated (``validated``: no subscriber is handed what it cannot run)
        and written (in ``conn``'s transaction where given), not yet published: the caller
        publishes it once that transaction has committed (the tuner: ``TunerTask``)."""
        self.validated(body)
        return self.repository.write(body, expected, actor, reason, action, conn)

    async def write(self, doc: PolicyDocument, expected: int, actor: str, reason: str | None, action: str) -> Versioned:
        """Write ``doc`` (returned by ``validated``: it is not validated again) after version
        ``expected`` (StaleVersionError if it is not current) and return once every subscriber
        runs it.  The database work runs in the thread pool."""
        written = await run_in_threadpool(self.repository.write, doc.body(), expected, actor, reason, action)
        await self.publish(written)
        return written

    async def publish(self, written: Versioned) -> None:
        for subscriber in self._subscribers:
            await subscriber.apply(written)

    async def resume(self, initial: PolicyDocument, actor: str) -> Versioned:
        """At start: version 1 from ``initial`` if the store has none, then the stored policy in force.
        The stored policy wins over start-up flags (a restart keeps operators' changes); one a
        subscriber cannot run is logged and left out, and the subscriber keeps its start-up settings."""
        current = await run_in_threadpool(self.repository.ensure, initial.body(), actor)
        for subscriber in self._subscribers:
            try:
                subscriber.check(self.document(current))
                await subscriber.apply(current)
            except ValueError as exc:
                log.error("stored policy v%d not applied: %s", current.version, exc)
        return current
