"""Prometheus metrics for spectune, in the registry vLLM's own metrics use.

Labels stay low-cardinality: prompt class, speculation on/off, draft
position -- never request ids or prompt text.

PromQL:
    acceptance rate per class
        sum by (class) (rate(spectune_accepted_tokens_total[5m]))
      / sum by (class) (rate(spectune_draft_tokens_total[5m]))
    acceptance at position k
        rate(spectune_accepted_tokens_per_position_total{position="k"}[5m])
      / rate(spectune_draft_tokens_per_position_total{position="k"}[5m])
    p95 time to first token
        histogram_quantile(0.95, sum by (le, class) (rate(spectune_time_to_first_token_seconds_bucket[5m])))
    fidelity defects (audited requests whose output speculation changed beyond a numeric near-tie)
        sum by (class) (increase(spectune_fidelity_checks_total{result="defect"}[1h]))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from spectune.engine.schema import FidelityRecord, RequestRecord, RuntimeSettings, StepRecord

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
RATE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


@dataclass
class _ClassSeries:
    on: Any
    off: Any
    output: Any
    drafted: Any
    accepted: Any
    steps: Any
    rate: Any
    ttft: Any
    tpot: Any
    e2e: Any
    positions: list = field(default_factory=list)


class RequestMetrics:
    """A RecordSink that turns request records into Prometheus series."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.requests = Counter("spectune_requests", "Finished requests", ["class", "speculation"], registry=registry)
        self.failures = Counter(
            "spectune_request_failures", "Requests that ended in error or abort", ["class", "reason"], registry=registry
        )
        self.output_tokens = Counter("spectune_output_tokens", "Generated tokens", ["class"], registry=registry)
        self.draft_tokens = Counter("spectune_draft_tokens", "Draft tokens proposed", ["class"], registry=registry)
        self.accepted_tokens = Counter(
            "spectune_accepted_tokens", "Draft tokens accepted", ["class"], registry=registry
        )
        self.spec_steps = Counter(
            "spectune_spec_steps", "Verify steps (steps that checked drafts)", ["class"], registry=registry
        )
        self.accepted_per_position = Counter(
            "spectune_accepted_tokens_per_position",
            "Draft tokens accepted at each draft position",
            ["class", "position"],
            registry=registry,
        )
        self.drafted_per_position = Counter(
            "spectune_draft_tokens_per_position",
            "Draft tokens proposed at each draft position",
            ["class", "position"],
            registry=registry,
        )
        self.ttft = Histogram(
            "spectune_time_to_first_token_seconds",
            "Arrival to first token",
            ["class"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "spectune_time_per_output_token_seconds",
            "Mean time per output token after the first",
            ["class"],
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "spectune_e2e_request_latency_seconds",
            "Arrival to last token",
            ["class"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.acceptance = Histogram(
            "spectune_request_acceptance_rate",
            "Accepted / drafted per request (requests with drafts)",
            ["class"],
            buckets=RATE_BUCKETS,
            registry=registry,
        )
        self.n_in_force = Gauge(
            "spectune_speculative_tokens", "N in force per class (batch size 1)", ["class"], registry=registry
        )
        self.enabled = Gauge(
            "spectune_speculation_enabled", "1 when speculation is on for the class", ["class"], registry=registry
        )
        self.fidelity_checks = Counter(
            "spectune_fidelity_checks",
            "Audited requests compared with their plain replay, by result (match, near_tie, defect)",
            ["class", "result"],
            registry=registry,
        )
        self._by_class: dict[str, _ClassSeries] = {}

    def _children(self, cls: str) -> _ClassSeries:
        # labels() takes a lock and hashes every call; this runs per request on
        # the serving path, so each class's children are looked up once.
        series = self._by_class.get(cls)
        if series is None:
            series = self._by_class[cls] = _ClassSeries(
                on=self.requests.labels(cls, "on"),
                off=self.requests.labels(cls, "off"),
                output=self.output_tokens.labels(cls),
                drafted=self.draft_tokens.labels(cls),
                accepted=self.accepted_tokens.labels(cls),
                steps=self.spec_steps.labels(cls),
                rate=self.acceptance.labels(cls),
                ttft=self.ttft.labels(cls),
                tpot=self.tpot.labels(cls),
                e2e=self.e2e.labels(cls),
            )
        return series

    def submit(self, r: RequestRecord) -> None:
        cls = r.prompt_class
        c = self._children(cls)
        (c.on if r.speculation_enabled else c.off).inc()
        if r.finish_reason in ("error", "abort"):
            self.failures.labels(cls, r.finish_reason).inc()
        c.output.inc(r.output_tokens)
        if r.num_draft_tokens:
            c.drafted.inc(r.num_draft_tokens)
            c.accepted.inc(r.num_accepted_tokens)
            c.steps.inc(r.num_spec_steps)
            c.rate.observe(r.num_accepted_tokens / r.num_draft_tokens)
            for pos, (drafted, accepted) in enumerate(zip(r.drafted_per_position, r.accepted_per_position)):
                if drafted:
                    while len(c.positions) <= pos:
                        k = str(len(c.positions))
                        c.positions.append(
                            (self.drafted_per_position.labels(cls, k), self.accepted_per_position.labels(cls, k))
                        )
                    c.positions[pos][0].inc(drafted)
                    c.positions[pos][1].inc(accepted)
        if r.ttft_s is not None:
            c.ttft.observe(r.ttft_s)
        if r.tpot_s is not None:
            c.tpot.observe(r.tpot_s)
        c.e2e.observe(r.e2e_s)

    def submit_step(self, step: StepRecord) -> None:
        pass

    def submit_fidelity(self, check: FidelityRecord) -> None:
        self.fidelity_checks.labels(check.prompt_class, check.result).inc()

    def close(self) -> None:
        pass

    def settings_applied(self, settings: RuntimeSettings, classes: Iterable[str], capacity: int) -> None:
        for cls in classes:
            for result in ("match", "near_tie", "defect"):  # exported from 0: the first defect is an increase
                self.fidelity_checks.labels(cls, result)
            n = settings.n_for(cls, 1, capacity)
            self.n_in_force.labels(cls).set(n)
            self.enabled.labels(cls).set(1 if n > 0 else 0)


class RecorderCollector:
    """Exports the recorder's counters at scrape time."""

    def __init__(self, stats: Callable[[], object], spool_bytes: Callable[[], int]) -> None:
        self._stats, self._spool_bytes = stats, spool_bytes

    def collect(self):
        s = self._stats()
        for name, doc, value in (
            ("spectune_records_spooled", "Records written to the on-disk spool", s.spooled),
            ("spectune_records_shipped", "Spool items inserted into the database", s.shipped),
            ("spectune_records_dropped", "Records lost because the spool could not be written", s.dropped),
            (
                "spectune_records_dead_lettered",
                "Spool items the database refused, kept in dead_letters (later records flow)",
                s.dead_lettered,
            ),
            ("spectune_database_errors", "Failed database writes (retried from the spool)", s.db_errors),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily(
            "spectune_database_up", "1 when the last database write succeeded", value=1 if s.db_up else 0
        )
        yield GaugeMetricFamily("spectune_spool_bytes", "Bytes in the spool not yet deleted", value=self._spool_bytes())


class TunerMetrics:
    """The tuner's view for alerting: what it predicts for the speculation in force.

    PromQL:
        speculation in force predicted to lose (alert after 10m)
            spectune_predicted_speedup < 1
        seconds since the tuner last changed a class
            time() - spectune_tuner_last_change_timestamp_seconds
    """

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.predicted = Gauge(
            "spectune_predicted_speedup",
            "Goodput model's speedup for the N in force (busiest batch bucket); 1 when speculation is off",
            ["class"],
            registry=registry,
        )
        self.decisions = Counter(
            "spectune_tuner_decisions", "Tuner decisions", ["class", "action", "applied"], registry=registry
        )
        self.last_change = Gauge(
            "spectune_tuner_last_change_timestamp_seconds",
            "Unix time of the tuner's last applied change per class",
            ["class"],
            registry=registry,
        )

    def observe(self, decisions: Iterable[dict[str, Any]]) -> None:
        for d in decisions:
            cls = d["prompt_class"]
            self.decisions.labels(cls, d["action"], "true" if d["applied"] else "false").inc()
            in_force = d["inputs"].get("in_force_speedup")
            n_in_force = d["n_after"] if d["applied"] else d["n_before"]
            if n_in_force == 0:
                self.predicted.labels(cls).set(1.0)
            elif in_force is not None:
                self.predicted.labels(cls).set(in_force)
            if d["applied"]:
                self.last_change.labels(cls).set(d["at"].timestamp())


class FleetCollector:
    """The control plane's view of its engines, read from the instances table at scrape time.

    PromQL:
        engines still on an older settings version than the policy (alert after 2m)
            spectune_instances_behind > 0
        engines that stopped sending heartbeats
            spectune_instances - spectune_instances_live
    """

    def __init__(self, fleet: Callable[[], list[dict]]) -> None:
        self._fleet = fleet

    def collect(self):
        try:
            rows = self._fleet()
        except Exception:  # the database is away: no fleet series this scrape (spectune_database_up says why)
            return
        for name, doc, value in (
            ("spectune_instances", "Engine instances known to this control plane", len(rows)),
            ("spectune_instances_live", "Instances with a heartbeat in the last 60 s", sum(r["live"] for r in rows)),
            (
                "spectune_instances_behind",
                "Live instances on an older settings version than the policy, 30 s after it changed",
                sum(r["behind"] for r in rows),
            ),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
