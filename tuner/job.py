"""The tuner: a scheduled job that turns records into speculation decisions.

Every ``interval`` it reads acceptance per class and step times per N over a
window, decides per class (``decide_class``), records every decision with
its inputs, and in ``auto`` mode writes the change into the policy (as actor
``tuner``, so it is versioned, audited and reversible like an operator's),
which propagates to the engines.  ``advise`` records only; ``frozen`` does
nothing.  A class changed less than ``cooldown_s`` ago is left alone.  When
a class goes off for low acceptance, a draft diagnosis is started.

Decisions are per prompt class across the fleet (records of every instance).
With several control-plane replicas on PostgreSQL only the holder of an
advisory lock decides; SQLite means a single process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, insert, text

from spectune.store.models import TunerDecision
from spectune.store.policies import PolicyRepository, StaleVersionError, Versioned
from spectune.store.tuner_inputs import acceptance_counts, last_applied, step_times

from .decide import decide_class
from .goodput import fit_cost_ratio
from .policy import PolicyDocument, TunerMode, effective_policy

log = logging.getLogger(__name__)

LOCK_KEY = 0x5BEC7E  # pg advisory lock id for the tuner leader


class LeaderLock:
    def __init__(self, db: Engine) -> None:
        self.db, self._conn, self.held = db, None, db.dialect.name == "sqlite"

    def acquire(self) -> bool:
        if self.held:
            return True
        try:
            self._conn = self._conn or self.db.connect()
            self.held = bool(self._conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": LOCK_KEY}).scalar())
            self._conn.commit()
        except Exception:  # no leader this round; try again next interval
            log.exception("tuner leader lock unavailable")
            self._conn = None
        return self.held


@dataclass
class Tuner:
    db: Engine
    classes: set[str]
    on_change: Callable[[Versioned], None]
    request_diagnosis: Callable[[str], None] | None = None
    window: timedelta = timedelta(minutes=5)

    def __post_init__(self) -> None:
        self.policies = PolicyRepository(self.db)
        self.leader = LeaderLock(self.db)

    def run_once(self) -> list[dict[str, Any]]:
        if not self.leader.acquire():
            return []
        current = self.policies.current()
        if current is None:
            return []
        doc = PolicyDocument.model_validate(current.body)
        counts = acceptance_counts(self.db, self.window)
        bucket, times = step_times(self.db, self.window)
        changed_at = last_applied(self.db)
        now = datetime.now(UTC)
        body, decisions = doc.body(), []
        for cls in sorted(self.classes):
            policy = effective_policy(doc, None, cls)
            if policy.tuner_mode == TunerMode.FROZEN:
                continue
            if cls in changed_at and now - changed_at[cls] < timedelta(seconds=policy.cooldown_s):
                continue
            drafted, accepted = counts.get(cls, ([], []))
            cost = fit_cost_ratio(times, fallback=policy.draft_cost_prior)
            d = decide_class(policy, drafted, accepted, cost)
            apply = d.action != "keep" and policy.tuner_mode == TunerMode.AUTO
            if apply:
                override = body.setdefault("classes", {}).setdefault(cls, {})
                override.update(speculation_enabled=d.enabled, num_speculative_tokens=d.n)
            decisions.append(
                dict(
                    at=now,
                    instance_id="*",
                    prompt_class=cls,
                    batch_bucket=bucket,
                    mode=policy.tuner_mode.value,
                    action=d.action,
                    n_before=policy.num_speculative_tokens if policy.speculation_enabled else 0,
                    n_after=d.n if d.enabled else 0,
                    predicted_speedup=d.predicted_speedup,
                    realised_speedup=None,
                    applied=apply,
                    inputs={
                        "drafted_per_position": drafted,
                        "accepted_per_position": accepted,
                        "acceptance": d.acceptance,
                        "cost_ratio": cost,
                        "step_times": {str(k): v for k, v in times.items()},
                        "reason": d.reason,
                        "policy_version": current.version,
                        "window_s": self.window.total_seconds(),
                    },
                )
            )
            if d.diagnose and self.request_diagnosis is not None:
                self.request_diagnosis(cls)
        if any(x["applied"] for x in decisions):
            try:
                written = self.policies.write(
                    body,
                    current.version,
                    "tuner",
                    "; ".join(f"{x['prompt_class']}: {x['inputs']['reason']}" for x in decisions if x["applied"]),
                    "tuner",
                )
            except StaleVersionError:
                log.info("policy changed meanwhile; tuner decides again next interval")
                for x in decisions:
                    x["applied"] = False
            else:
                self.on_change(written)
        if decisions:
            with self.db.begin() as conn:
                conn.execute(insert(TunerDecision), decisions)
        return decisions
