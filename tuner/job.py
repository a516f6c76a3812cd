"""The tuner: a periodic job (``tuner/task.py`` runs it) that turns records into speculation decisions.

Every ``interval`` it reads acceptance per class (over ``window``, or over the
last interval when acceptance has visibly shifted) and step times per batch
bucket and N (over ``cost_window``; the hour of acceptance it falls back on
and the steps that drafted only from when the draft in force came in -- a
policy change of method or draft model -- since the old draft's say nothing
about the new one), decides per class (``decide_class``,
``decide_batch_table``), records every decision with its inputs, and in
``auto`` mode writes the change into the policy through the ``PolicyService``
(as actor ``tuner``, so it is versioned, audited and reversible like an
operator's), whose subscribers put it in force on the engines.  ``advise``
records only; ``frozen`` does nothing.  A class changed less than
``cooldown_s`` ago is left alone -- except by the guard: where serving at the
class's N measured slower than plain in the same minutes
(``paired_cost.paired_speedup``, whole interval below 1; the plain side comes
from control requests, cost probes and probes), its busiest bucket runs plain
from the next interval.  So does a class's TTFT budget: where its speculating
requests' p95 time to first token is above it and plain ones are faster, the
class goes off, and stays off until its probes are within it
(``decide.ttft_over_budget``).  An explored N in force is held, guard aside, until
it is measured (``decide.exploring``), for at most a window; explorations are paid
from the policy's ``explore_budget`` (``decide.exploration_unpaid``).  When a class goes
off for low acceptance, a draft diagnosis is started.

Each run also closes earlier decisions: the *realised* speedup of a decision
is what its setting delivered against plain while it was in force, in tokens/s
(``outcomes.py``): from paired minutes (plain and N steps in the same minutes)
with a 90 % interval where the span had them, else unpaired against the cost
window's plain steps; each row says which (``realised_estimator``).  Where
neither can be had (under 3 paired minutes, and under 30 steps on a side for
the unpaired ratio) a decision stays open (for up to four windows), never
closed against the model's own t0.  With it come the TTFT and time per token of
the setting's requests against plain ones over the same span (``realised_latency``).
Every decision row states its baseline (``inputs.baseline``).

Decisions are per prompt class across the fleet (records of every instance).
With several control-plane replicas on PostgreSQL only the holder of the
leader lease decides (``store/leader.py``): it is re-checked every run, and a
run's policy write and decision rows go in one transaction fenced by the
lease epoch, so a tuner that lost its lease writes nothing.  Decision rows
carry the epoch.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import Engine, insert

from spectune.control.service import PolicyService
from spectune.engine.schema import n_for_batch
from spectune.store import tuner_inputs as inputs
from spectune.store.leader import LeaderLease, StaleLeaderError
from spectune.store.models import TunerDecision
from spectune.store.policies import StaleVersionError, Versioned

from .cost import CostFit, baseline, costs_by_bucket
from .decide import (
    MIN_DRAFTS,
    ClassDecision,
    decide_batch_table,
    decide_class,
    drafts_at,
    exploration_unpaid,
    exploring,
    guard,
    open_for_probes,
    ttft_guard,
    ttft_over_budget,
)
from .goodput import (
    PositionAcceptance,
    acceptance_shifted,
    bucket_sizes,
    choose_n,
    exploration_loss,
    position_acceptance,
    remembered,
    speedup,
    speedup_interval,
)
from .outcomes import LANDED, latency, realised
from .paired_cost import ESTIMATOR, SPEEDUP_ESTIMATOR, control_share
from .policy import Policy, TunerMode, draft_key, effective_policy
from .reads import RunReads, read_run

log = logging.getLogger(__name__)

MIN_COST_PROBE_STEPS = 50  # a bucket with fewer steps in the cost window is not worth probing
# A probe's steps are in the store within the recorder's open-minute snapshot interval (5 s) plus shipping.
PROBE_SETTLE = timedelta(seconds=10)


def _table_reason(old: list, new: list, probes: set[int], counts: dict[int, dict[int, int]]) -> str:
    show = lambda t: ", ".join(f"{e.min_batch}-{e.max_batch}:N={e.num_speculative_tokens}" for e in t) or "none"  # noqa: E731
    if probes:
        (bucket,) = probes
        seen = sorted(counts.get(bucket, {}))
        return (
            f"cost probe: batch bucket {bucket} at N=0 for one interval (its cost not fitted or no plain step "
            f"measured there; steps seen at N={seen})"
        )
    return f"batch table [{show(old)}] -> [{show(new)}]"


def _positions(estimate: PositionAcceptance | None, window: PositionAcceptance | None) -> dict[str, list] | None:
    """Per draft position, the acceptance the decision used, its trials, and which positions the
    cost window's history supplied (``goodput.remembered``)."""
    if estimate is None or window is None:
        return None
    from_history = [k + 1 for k, trials in enumerate(estimate.samples)
                    if k >= len(window.samples) or trials != window.samples[k]]  # fmt: skip
    return {"alpha": list(estimate.mean), "trials": list(estimate.samples), "from_history": from_history}


class TunerRun(NamedTuple):
    decisions: list[dict[str, Any]]
    written: Versioned | None  # the policy version the run wrote, not yet published


@dataclass
class Tuner:
    """Decides and writes through ``policies`` (its clock is the tuner's); ``TunerTask`` runs it."""

    policies: PolicyService
    request_diagnosis: Callable[[str], None] | None = None
    window: timedelta = timedelta(minutes=5)
    interval: timedelta = timedelta(minutes=1)
    cost_window: timedelta = timedelta(hours=1)
    # Called with each run's decisions (e.g. to export the predicted speedup in force).
    on_decisions: Callable[[list[dict[str, Any]]], None] | None = None
    holder: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    # (policy version, its draft, when that draft came in -- None: before any cost window): spares
    # each run a walk through every version since the last draft change.
    _draft_seen: tuple[int, tuple[str | None, str | None], datetime | None] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.db: Engine = self.policies.db
        self.clock: Callable[[], datetime] = self.policies.clock
        self.leader = LeaderLease(self.db, self.holder)

    def run_once(self) -> list[dict[str, Any]]:
        """One run's decisions; what it wrote is in the store, not yet published (``TunerTask`` does that)."""
        return self.decide_and_write().decisions

    def decide_and_write(self) -> TunerRun:
        """Blocking (the database): ``TunerTask`` runs it in a worker thread."""
        epoch = self.leader.acquire()
        if epoch is None:
            return TunerRun([], None)
        now = self.clock()
        self.close_decisions(now)
        current = self.policies.repository.current()
        if current is None:
            return TunerRun([], None)
        doc = self.policies.document(current)
        reads = self._read(now, self._draft_since(current, now - self.cost_window))
        applied = inputs.last_applied(self.db)
        body, decisions = doc.body(), []
        for cls in sorted(self.policies.known_classes(doc)):  # the policy's classifier, where it has one
            policy = effective_policy(doc, None, cls)
            if policy.tuner_mode == TunerMode.FROZEN:
                continue
            cooling = applied.age(cls, now) < timedelta(seconds=policy.cooldown_s)
            # No second probe before the first one's steps are in the store.
            settling = applied.age(cls, now, "cost_probe") < PROBE_SETTLE + self.interval
            decided = self._decide(cls, policy, reads, now, current.version, may_probe=not settling, cooling=cooling,
                                   last_explore=applied.last(cls, "explore"))  # fmt: skip
            if decided is None:
                continue  # changed less than a cooldown ago, and the guard has nothing against it
            row, override = decided
            row["leader_epoch"] = epoch
            if override is not None:
                body.setdefault("classes", {}).setdefault(cls, {}).update(override)
            decisions.append(row)
        return TunerRun(decisions, self._write(body, current.version, decisions))

    def _versions(self, page: int = 100) -> Iterator[Versioned]:
        """Every policy version, newest first, read a page at a time."""
        offset = 0
        while batch := self.policies.repository.versions(page, offset):
            yield from batch
            if len(batch) < page:
                return
            offset += page

    def _draft_since(self, current: Versioned, floor: datetime) -> datetime:
        """When the draft in force (``draft_key``) came in, but not before ``floor``: the oldest
        version of the newest unbroken run of versions with that draft (``floor`` when every
        version has it)."""
        key, seen = draft_key(current.body), self._draft_seen
        start: datetime | None = None
        for v in self._versions():
            if seen is not None and v.version == seen[0] and seen[1] == key:
                start = seen[2]  # known from an earlier run
                break
            if draft_key(v.body) != key:
                break  # the version before the change
            if v.at < floor:
                start = None  # this draft was in force before the cost window
                break
            start = v.at
        else:
            start = None  # every version has this draft: no change to start from
        self._draft_seen = (current.version, key, start)
        return floor if start is None else max(start, floor)

    def _read(self, now: datetime, since: datetime) -> RunReads:
        return read_run(self.db, now, since, window=self.window, interval=self.interval, cost_window=self.cost_window)

    def _acceptance(self, cls: str, reads: RunReads) -> tuple[list[int], list[int], bool]:
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

    def _exploration_unpaid(
        self, policy: Policy, alphas: list[float], cost: float | CostFit, last: inputs.Applied | None, now: datetime
    ) -> str | None:
        """``decide.exploration_unpaid`` for the class's last applied exploration: its loss by the model
        as it stands, for as long as it ran but at most the window it may be held (an explored N the
        tuner keeps once measured is its choice, no longer an exploration).  Explorations are also
        spaced by three intervals (at most a window): each needs a few to be measured."""
        spacing = min(self.window, 3 * self.interval).total_seconds()
        if last is None:
            return exploration_unpaid(policy.explore_budget, None, 0.0, 0.0)
        loss = exploration_loss(alphas, last.n_after, last.n_before, cost)
        held = min(last.in_force_for(now), self.window).total_seconds()
        return exploration_unpaid(policy.explore_budget, loss, held, (now - last.at).total_seconds(), spacing)

    @staticmethod
    def _reprobe(d: ClassDecision, busiest: int) -> bool:
        """Whether a busiest bucket that drafts nothing opens to probes: where nothing of the draft in
        force is measured (else the class keeps "too little data" for good, off or on), and for an off
        class at batch 1, where a probe runs alone and costs only itself (a cost probe's plain entry
        there, then off: its probes never drafted again and it stayed off on a drift-fooled cost).
        At larger batches one probe makes the drafter run over the whole batch: the table stands."""
        return d.acceptance is None or (not d.enabled and bucket_sizes(busiest)[1] == 1)

    def _decide(
        self,
        cls: str,
        policy: Policy,
        reads: RunReads,
        now: datetime,
        version: int,
        may_probe: bool = True,
        cooling: bool = False,
        last_explore: inputs.Applied | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
        """One class: the decision row, and the class override to write (None: nothing to apply).
        ``cooling`` (changed less than a cooldown ago): only the guard may act; None when it does not.
        ``last_explore``: the class's last applied exploration.  While nothing replaced it, it is in
        force and held until measured (``decide.exploring``), for at most a window, unless acceptance
        shifted; the next one waits until it is repaid from the explore budget
        (``decide.exploration_unpaid``)."""
        drafted, accepted, shifted = self._acceptance(cls, reads)
        busiest, steps = reads.busiest, reads.steps
        costs = costs_by_bucket(
            reads.times,
            policy.draft_cost_prior,
            reads.counts,
            prefill=reads.prefill,
            drafting=reads.drafting,
            paired=reads.paired,
        )
        here_cost = costs.get(busiest, policy.draft_cost_prior)
        # What the cost window measured continues the window's acceptance (an explored N stays
        # measured), unless acceptance just shifted: then the older regime says nothing.
        memory = None if shifted or not drafted else position_acceptance(*reads.history().get(cls, ([], [])))
        window_estimate = estimate = position_acceptance(drafted, accepted) if drafted else None
        if estimate is not None and memory is not None:
            estimate = remembered(estimate, memory)
        alphas = list(estimate.mean) if estimate is not None else None
        pays_elsewhere = alphas is not None and any(
            choose_n(alphas, c, 0, policy.n_min, policy.n_max, min_gain=0).best_speedup > 1
            for b, c in costs.items()
            if b != busiest
        )
        d = decide_class(policy, drafted, accepted, here_cost, pays_elsewhere=pays_elsewhere, estimate=estimate)
        if d.action == "explore" and alphas is not None:
            unpaid = self._exploration_unpaid(policy, alphas, here_cost, last_explore, now)
            if unpaid is not None:  # what the class decides without exploring, and why it did not explore
                policy = policy.model_copy(update={"explore_margin": 0.0})
                kept = decide_class(policy, drafted, accepted, here_cost, pays_elsewhere=pays_elsewhere,
                                    estimate=estimate)  # fmt: skip
                d = replace(kept, reason=f"{kept.reason}; not exploring N={d.n}: {unpaid}")
        table, probes = policy.batch_table, set()
        if d.acceptance is None:
            alphas = None
        budget = policy.ttft_budget_s
        over = None if budget is None else ttft_over_budget(budget, reads.latency(cls))
        if over is not None and not policy.speculation_enabled and d.enabled:
            # Off, and what it would gain does not buy the latency back.
            d = replace(d, action="keep", enabled=False, n=policy.num_speculative_tokens, reason=f"{d.reason}; {over}")
        reprobe = busiest is not None and not drafts_at(policy, busiest) and self._reprobe(d, busiest)
        guarded = guard(policy, reads.measured, busiest, d.acceptance) or ttft_guard(policy, over, d.acceptance)
        # The N serving the busiest bucket now (0: plain there).
        before = n_for_batch(policy.batch_table, busiest or 1, policy.num_speculative_tokens)
        before = before if policy.speculation_enabled else 0
        held = None
        explored = last_explore if last_explore is not None and last_explore.in_force else None
        if explored is not None and estimate is not None and not shifted and busiest is not None:
            if before > 0 and before == explored.n_after:  # the explored N still runs there
                held = exploring(before, here_cost, estimate.samples, (now - explored.at).total_seconds(),
                                 self.window.total_seconds())  # fmt: skip
        if guarded is not None:
            d, table = guarded
        elif cooling:
            return None
        elif held is not None:
            d = ClassDecision("keep", True, policy.num_speculative_tokens, d.predicted_speedup, d.acceptance, False,
                              held)  # fmt: skip
        elif d.enabled and alphas is not None:
            in_force = policy.num_speculative_tokens if policy.speculation_enabled else d.n
            # A bucket gets a probe when its plain step was never measured: every speedup is
            # relative to a plain step, and an extrapolated one overstates it (running the drafter at
            # all costs more than the linear fit's intercept shows).  A bucket whose plain step is
            # measured and whose N > 0 is not measures that by running at N: a probe to N = 0 there
            # would measure nothing new and demote every request in flight for good.
            unmeasured = [
                b
                for b, c in costs.items()
                if 0 not in c.measured
                and steps[b] >= MIN_COST_PROBE_STEPS
                and n_for_batch(table, b, in_force) > 0
                and may_probe
            ]
            probes = {max(unmeasured, key=steps.get)} if unmeasured else set()
            if busiest in probes:  # one change at a time: the probe, then the decision on its measurement
                d = ClassDecision("keep", True, in_force, d.predicted_speedup, d.acceptance, False, d.reason)
            table = decide_batch_table(
                policy, alphas, costs, d.n, probes, class_bucket=busiest, measured=reads.measured
            )
        elif reprobe:
            table = open_for_probes(policy, busiest)
        action, reason = d.action, d.reason
        if action == "keep" and table != policy.batch_table and reprobe:
            action = "reprobe"
            reason = f"{reason}; probes measure the draft in force at batch bucket {busiest} (N={d.n})"
        elif action == "keep" and table != policy.batch_table:
            action = "cost_probe" if probes else "set_table"
            reason = _table_reason(policy.batch_table, table, probes, reads.counts)
        after = n_for_batch(table, busiest or 1, d.n) if d.enabled else 0
        predicted = d.predicted_speedup
        if alphas is not None and action != "off":
            predicted = speedup(alphas, after, here_cost)
        interval = None if alphas is None else speedup_interval(alphas, after, here_cost)
        apply = action != "keep" and policy.tuner_mode == TunerMode.AUTO
        override = None
        if apply:
            override = {"speculation_enabled": d.enabled, "num_speculative_tokens": d.n}
            if after > 0 and predicted is not None and policy.control_budget > 0:  # paid from the budget
                override["control_fraction"] = round(control_share(policy.control_budget, predicted), 4)
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
                "position_acceptance": _positions(estimate, window_estimate),
                "recent_window_used": shifted,
                "cost_ratio": here_cost.cost_ratio if isinstance(here_cost, CostFit) else here_cost,
                "costs": {
                    str(b): {
                        "t0_s": c.t0_s,
                        "cost_ratio": c.cost_ratio,
                        "source": c.source,
                        "steps": steps[b],
                        "measured_s": {str(n): t for n, t in c.measured.items()},
                        "prefill_s_per_token": None if c.prefill is None else asdict(c.prefill),
                        "drafting_share": {str(n): k for n, k in c.drafting_share.items()},
                        "paired_ratio": {str(n): asdict(e) for n, e in c.paired.items()},
                    }
                    for b, c in costs.items()
                },
                "baseline": baseline(here_cost, busiest),
                "batch_table": [e.model_dump() for e in table],
                "cost_probes": sorted(probes),
                "predicted_interval": interval,
                "speedup_estimator": ESTIMATOR if interval else "point: no paired minutes at this N (see costs)",
                "in_force_speedup": None if alphas is None else speedup(alphas, after if apply else before, here_cost),
                "measured_speedup": {
                    str(b): {str(n): asdict(e) for n, e in per.items()} for b, per in reads.measured.items()
                },
                "measured_estimator": SPEEDUP_ESTIMATOR,
                "reason": reason,
                "policy_version": version,
                "window_s": self.window.total_seconds(),
            },
        )
        return row, override

    def _write(self, body: dict[str, Any], version: int, decisions: list[dict[str, Any]]) -> Versioned | None:
        """Applied decisions become one policy version (actor tuner), returned; every decision becomes a row.

        One transaction, fenced by the leader lease: a tuner that lost its lease writes neither.
        """
        written = None
        try:
            with self.db.begin() as conn:
                self.leader.fence(conn)
                if any(x["applied"] for x in decisions):
                    reason = "; ".join(
                        f"{x['prompt_class']}: {x['inputs']['reason']}" for x in decisions if x["applied"]
                    )
                    try:
                        with conn.begin_nested():
                            written = self.policies.commit(body, version, "tuner", reason, "tuner", conn)
                    except (StaleVersionError, ValueError) as exc:  # ValueError: a subscriber refused it
                        level = logging.INFO if isinstance(exc, StaleVersionError) else logging.WARNING
                        log.log(level, "tuner's policy not written (%s); it decides again next interval", exc)
                        for x in decisions:
                            x["applied"] = False
                if decisions:
                    conn.execute(insert(TunerDecision), decisions)
        except StaleLeaderError as exc:
            log.warning("tuner run refused: %s", exc)
            decisions.clear()
            return None
        if decisions and self.on_decisions is not None:
            self.on_decisions(decisions)
        return written

    def close_decisions(self, now: datetime) -> int:
        """Fill in the realised speedup of decisions whose setting has been measured
        (``outcomes.realised``: paired minutes where the span had them, else unpaired).

        The store is read once per run, not per open decision: decisions that cannot be closed
        stay open for ``4 * window`` and are looked at every run.
        """
        awaiting = inputs.decisions_awaiting_outcome(self.db, now, max_age=4 * self.window)
        if not awaiting:
            return 0
        first = awaiting[0]["at"]
        changes = inputs.ChangeTimes(self.db, first)
        minutes = inputs.step_minutes(self.db, first - self.cost_window, now + LANDED)
        plain = inputs.throughput_of(minutes, now - self.cost_window, now + LANDED)
        closed = {}
        for dec in awaiting:
            changed = changes.next_after(dec["prompt_class"], dec["at"])
            outcome = realised(minutes, dec["at"], dec["batch_bucket"], dec["n_after"], changed, now, plain,
                               settle=self.window, patience=2 * self.window)  # fmt: skip
            if outcome is not None:
                cls, bucket = dec["prompt_class"], dec["batch_bucket"]
                arms = {} if bucket is None else inputs.span_latency(self.db, cls, bucket, dec["at"], changed or now)
                closed[dec["id"]] = replace(outcome, latency=latency(arms, bucket, dec["n_after"]))
        inputs.set_realised(self.db, closed)
        return len(closed)
