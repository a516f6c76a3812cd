"""The tuner: a scheduled job that turns records into speculation decisions.

Every ``interval`` it reads acceptance per class (over ``window``, or over the
last interval when acceptance has visibly shifted) and step times per batch
bucket and N (over ``cost_window``), decides per class (``decide_class``,
``decide_batch_table``), records every decision with its inputs, and in
``auto`` mode writes the change into the policy (as actor ``tuner``, so it is
versioned, audited and reversible like an operator's), which propagates to
the engines.  ``advise`` records only; ``frozen`` does nothing.  A class
changed less than ``cooldown_s`` ago is left alone.  When a class goes off
for low acceptance, a draft diagnosis is started.

Each run also closes earlier decisions: the *realised* speedup of a decision
is measured tokens per verify step (records) x t0 / measured step time at the
N it chose (step statistics), over the span until the class's next decision.
t0 is a plain step at that bucket: the measured time of N=0 steps (which run
no draft model) where the cost window has them, else the decision's model t0.
Every decision row states its baseline (``inputs.baseline``).

Decisions are per prompt class across the fleet (records of every instance).
With several control-plane replicas on PostgreSQL only the holder of an
advisory lock decides; SQLite means a single process.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, insert, text

from spectune.engine.schema import n_for_batch
from spectune.store import tuner_inputs as inputs
from spectune.store.models import TunerDecision
from spectune.store.policies import PolicyRepository, StaleVersionError, Versioned

from .decide import MIN_DRAFTS, ClassDecision, decide_batch_table, decide_class
from .goodput import (
    CostFit,
    acceptance_shifted,
    baseline,
    choose_n,
    costs_by_bucket,
    position_acceptance,
    speedup,
)
from .policy import Policy, PolicyDocument, TunerMode, effective_policy

log = logging.getLogger(__name__)

LOCK_KEY = 0x5BEC7E  # pg advisory lock id for the tuner leader
MIN_COST_PROBE_STEPS = 50  # a bucket with fewer steps in the cost window is not worth probing
MIN_REALISED_STEPS = 10  # verify steps needed to call a decision's outcome measured
MIN_PLAIN_STEPS = 20  # N=0 steps at a bucket for its plain step time to count as measured


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


def _table_reason(old: list, new: list, probes: set[int], counts: dict[int, dict[int, int]]) -> str:
    show = lambda t: ", ".join(f"{e.min_batch}-{e.max_batch}:N={e.num_speculative_tokens}" for e in t) or "none"  # noqa: E731
    if probes:
        (bucket,) = probes
        seen = sorted(counts.get(bucket, {}))
        return f"cost probe: batch bucket {bucket} at N=0 for one interval (step times measured only at N={seen})"
    return f"batch table [{show(old)}] -> [{show(new)}]"


@dataclass
class _Reads:
    """What one tuner run reads from the store (the history only when a class needs it)."""

    window: dict[str, tuple[list[int], list[int]]]
    recent: dict[str, tuple[list[int], list[int]]]
    history: Callable[[], dict[str, tuple[list[int], list[int]]]]
    times: dict[int, dict[int, float]]
    counts: dict[int, dict[int, int]]
    steps: dict[int, int]
    busiest: int | None


def _utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass
class Tuner:
    db: Engine
    classes: set[str]
    on_change: Callable[[Versioned], None]
    request_diagnosis: Callable[[str], None] | None = None
    window: timedelta = timedelta(minutes=5)
    interval: timedelta = timedelta(minutes=1)
    cost_window: timedelta = timedelta(hours=1)
    clock: Callable[[], datetime] = _utc_now
    # Called with each run's decisions (e.g. to export the predicted speedup in force).
    on_decisions: Callable[[list[dict[str, Any]]], None] | None = None
    policies: PolicyRepository = field(init=False)

    def __post_init__(self) -> None:
        self.policies = PolicyRepository(self.db, clock=self.clock)
        self.leader = LeaderLock(self.db)

    def run_once(self) -> list[dict[str, Any]]:
        if not self.leader.acquire():
            return []
        now = self.clock()
        self.close_decisions(now)
        current = self.policies.current()
        if current is None:
            return []
        doc = PolicyDocument.model_validate(current.body)
        reads = self._read(now)
        changed_at = inputs.last_applied(self.db)
        explored_at = inputs.last_applied(self.db, "explore")
        body, decisions = doc.body(), []
        for cls in sorted(self.classes):
            policy = effective_policy(doc, None, cls)
            if policy.tuner_mode == TunerMode.FROZEN:
                continue
            if cls in changed_at and now - changed_at[cls] < timedelta(seconds=policy.cooldown_s):
                continue
            if cls in explored_at and now - explored_at[cls] < min(self.window, 3 * self.interval):
                # Explorations are spaced: each needs a few intervals to be measured, and churn costs.
                policy = policy.model_copy(update={"explore_margin": 0.0})
            row, override = self._decide(cls, policy, reads, now, current.version)
            if override is not None:
                body.setdefault("classes", {}).setdefault(cls, {}).update(override)
            decisions.append(row)
        self._write(body, current.version, decisions)
        return decisions

    def _read(self, now: datetime) -> _Reads:
        times, counts = inputs.step_times(self.db, now - self.cost_window, now)
        steps = {b: sum(per.values()) for b, per in counts.items()}
        _, recent_counts = inputs.step_times(self.db, now - self.window, now)
        traffic = {b: sum(per.values()) for b, per in recent_counts.items()} or steps
        return _Reads(
            window=inputs.acceptance_counts(self.db, now - self.window, now),
            recent=inputs.acceptance_counts(self.db, now - self.interval, now),
            history=functools.cache(lambda: inputs.acceptance_counts(self.db, now - self.cost_window, now)),
            times=times,
            counts=counts,
            steps=steps,
            busiest=max(traffic, key=traffic.get) if traffic else None,
        )

    def _acceptance(self, cls: str, reads: _Reads) -> tuple[list[int], list[int], bool]:
        """(drafted, accepted) per position to decide on, and whether a shift made it the last interval's."""
        drafted, accepted = reads.window.get(cls, ([], []))
        if not drafted or drafted[0] < MIN_DRAFTS:
            # Nothing drafted lately (a cost probe, a quiet hour): the last hour's acceptance beats none.
            drafted, accepted = reads.history().get(cls, (drafted, accepted))
        if cls in reads.recent and drafted:
            r_drafted, r_accepted = reads.recent[cls]
            long, recent = position_acceptance(drafted, accepted), position_acceptance(r_drafted, r_accepted)
            if acceptance_shifted(long, recent, MIN_DRAFTS):
                return r_drafted, r_accepted, True
        return drafted, accepted, False

    def _decide(
        self, cls: str, policy: Policy, reads: _Reads, now: datetime, version: int
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """One class: the decision row, and the class override to write (None: nothing to apply)."""
        drafted, accepted, shifted = self._acceptance(cls, reads)
        busiest, steps = reads.busiest, reads.steps
        costs = costs_by_bucket(reads.times, policy.draft_cost_prior, reads.counts)
        here_cost = costs.get(busiest, policy.draft_cost_prior)
        alphas = list(position_acceptance(drafted, accepted).mean) if drafted else None
        pays_elsewhere = alphas is not None and any(
            choose_n(alphas, c, 0, policy.n_min, policy.n_max, min_gain=0).best_speedup > 1
            for b, c in costs.items()
            if b != busiest
        )
        d = decide_class(policy, drafted, accepted, here_cost, pays_elsewhere=pays_elsewhere)
        table, probes = policy.batch_table, set()
        if d.acceptance is None:
            alphas = None
        if d.enabled and alphas is not None:
            in_force = policy.num_speculative_tokens if policy.speculation_enabled else d.n
            unfitted = [
                b
                for b, c in costs.items()
                if c.source != "fit" and steps[b] >= MIN_COST_PROBE_STEPS and n_for_batch(table, b, in_force) > 0
            ]
            probes = {max(unfitted, key=steps.get)} if unfitted else set()
            if busiest in probes:  # one change at a time: the probe, then the decision on its measurement
                d = ClassDecision("keep", True, in_force, d.predicted_speedup, d.acceptance, False, d.reason)
            table = decide_batch_table(policy, alphas, costs, d.n, probes, class_bucket=busiest)
        action, reason = d.action, d.reason
        if action == "keep" and table != policy.batch_table:
            action = "cost_probe" if probes else "set_table"
            reason = _table_reason(policy.batch_table, table, probes, reads.counts)
        before = n_for_batch(policy.batch_table, busiest or 1, policy.num_speculative_tokens)
        before = before if policy.speculation_enabled else 0
        after = n_for_batch(table, busiest or 1, d.n) if d.enabled else 0
        predicted = d.predicted_speedup
        if alphas is not None and action != "off":
            predicted = speedup(alphas, after, here_cost)
        apply = action != "keep" and policy.tuner_mode == TunerMode.AUTO
        override = None
        if apply:
            override = {"speculation_enabled": d.enabled, "num_speculative_tokens": d.n}
            if table or policy.batch_table:
                override["batch_table"] = [e.model_dump() for e in table]
        if d.diagnose and self.request_diagnosis is not None:
            self.request_diagnosis(cls)
        row = dict(
            at=now,
            instance_id="*",
            prompt_class=cls,
            batch_bucket=busiest,
            mode=policy.tuner_mode.value,
            action=action,
            n_before=before,
            n_after=after,
            predicted_speedup=predicted,
            realised_speedup=None,
            applied=apply,
            inputs={
                "drafted_per_position": drafted,
                "accepted_per_position": accepted,
                "acceptance": d.acceptance,
                "recent_window_used": shifted,
                "cost_ratio": here_cost.cost_ratio if isinstance(here_cost, CostFit) else here_cost,
                "costs": {
                    str(b): {
                        "t0_s": c.t0_s,
                        "cost_ratio": c.cost_ratio,
                        "source": c.source,
                        "steps": steps[b],
                        "measured_s": {str(n): t for n, t in c.measured.items()},
                    }
                    for b, c in costs.items()
                },
                "baseline": baseline(here_cost, busiest),
                "batch_table": [e.model_dump() for e in table],
                "cost_probes": sorted(probes),
                "in_force_speedup": None if alphas is None else speedup(alphas, after if apply else before, here_cost),
                "reason": reason,
                "policy_version": version,
                "window_s": self.window.total_seconds(),
            },
        )
        return row, override

    def _write(self, body: dict[str, Any], version: int, decisions: list[dict[str, Any]]) -> None:
        """Applied decisions become one policy version (actor tuner); every decision becomes a row."""
        if any(x["applied"] for x in decisions):
            reason = "; ".join(f"{x['prompt_class']}: {x['inputs']['reason']}" for x in decisions if x["applied"])
            try:
                written = self.policies.write(body, version, "tuner", reason, "tuner")
            except StaleVersionError:
                log.info("policy changed meanwhile; tuner decides again next interval")
                for x in decisions:
                    x["applied"] = False
            else:
                self.on_change(written)
        if decisions:
            with self.db.begin() as conn:
                conn.execute(insert(TunerDecision), decisions)
            if self.on_decisions is not None:
                self.on_decisions(decisions)

    def close_decisions(self, now: datetime) -> int:
        """Fill in the realised speedup of decisions whose span has been measured."""
        closed = 0
        for dec in inputs.decisions_awaiting_outcome(self.db, now, max_age=4 * self.window):
            end = inputs.next_decision_time(self.db, dec["prompt_class"], dec["at"])
            if end is None:
                continue  # still the decision in force: its span is open
            measured = inputs.tokens_per_step(self.db, dec["prompt_class"], dec["at"], end)
            times, _ = inputs.step_times(self.db, dec["at"], end + timedelta(minutes=1))
            t_after = times.get(dec["batch_bucket"], {}).get(dec["n_after"])
            t0 = self._plain_step_time(dec, end)
            if t0 is None or t_after is None or measured is None or measured[1] < MIN_REALISED_STEPS:
                continue
            inputs.set_realised(self.db, dec["id"], measured[0] * t0 / t_after)
            closed += 1
        return closed

    def _plain_step_time(self, dec: dict[str, Any], end: datetime) -> float | None:
        """A plain step at the decision's bucket, measured (N=0 steps run no drafter) where the
        cost window has enough of them, else the t0 the decision was made with."""
        times, counts = inputs.step_times(self.db, end - self.cost_window, end + timedelta(minutes=1))
        bucket = dec["batch_bucket"]
        if counts.get(bucket, {}).get(0, 0) >= MIN_PLAIN_STEPS:
            return times[bucket][0]
        cost = (dec["inputs"].get("costs") or {}).get(str(bucket)) or {}
        return cost.get("t0_s")
