"""Tuner replay: the tuner vs static N and the per-phase oracle, side by side.

    python -m benchmarks.tuner_replay [--phase-minutes 20] [--out benchmarks/results/tuner_replay.md]

Phases: chat -> copy-heavy code edit -> domain shift (the draft fails) ->
high concurrency (batch 8), one prompt class throughout, so the tuner has to
follow the workload.  Arms: static N in {0, 1, 3, 5, 8}, the per-phase
oracle (best static arm in each phase) and the tuner.

SIMULATED, CALIBRATED: engine steps come from ``sim.SimEngine``, whose step
times and per-position acceptance were measured on the real engine with the
demo pair (``calibrate.py`` -> ``calibration.json``).  The tuner arm runs the
real tuner (``spectune.tuner.job.Tuner``: store reads, goodput model, batch
table, cost probes, policy writes, realised speedup) against a real SQLite
store, on the simulation's clock.  The report says so and how far the
simulation is from the engine's measured tokens/s.
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import select

from spectune.control import PolicyService
from spectune.engine.schema import RuntimeSettings
from spectune.settings import Settings
from spectune.store.db import insert_records, make_engine, upgrade, upsert_step_stats, utc
from spectune.store.models import TunerDecision
from spectune.store.policies import Versioned
from spectune.store.steps import StepAggregator
from spectune.tuner.job import Tuner
from spectune.tuner.policy import Policy, PolicyDocument, runtime_settings
from spectune.tuner.task import TunerTask

from .sim import Calibration, SimEngine


@dataclass(frozen=True)
class Phase:
    name: str
    workload: str
    concurrency: int


PHASES = (
    Phase("chat", "chat", 1),
    Phase("code edit", "code_edit", 1),
    Phase("domain shift", "domain_shift", 1),
    Phase("high concurrency", "chat", 8),
)
STATIC_NS = (0, 1, 3, 5, 8)
PROMPT_CLASS = "default"
CAPACITY = 8
START = datetime(2026, 1, 1, tzinfo=UTC).timestamp()


@dataclass
class PhaseResult:
    tokens: int
    seconds: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


class _TunerArm:
    """The real tuner on a real store, fed by the simulator, on simulated time."""

    def __init__(self, workdir: Path, interval_s: float, policy: Policy, window_s: float) -> None:
        url = f"sqlite:///{workdir}/replay.db"
        upgrade(url)
        self.db = make_engine(url)
        self.now = START
        clock = lambda: datetime.fromtimestamp(self.now, UTC)  # noqa: E731
        policies = PolicyService(self.db, {PROMPT_CLASS}, clock=clock)
        written = policies.repository.ensure(PolicyDocument(global_=policy).body(), "replay")
        policies.subscribe(self)  # the simulated engine follows the policy as the embedded one does
        self.settings = self._settings(written.body, written.version)
        self.records, self.steps = [], StepAggregator()
        self.diagnoses: list[str] = []
        self.interval = interval_s
        self.next_tick = START + interval_s
        self.tuner = TunerTask(
            Tuner(
                policies,
                request_diagnosis=self.diagnoses.append,
                interval=timedelta(seconds=interval_s),
                window=timedelta(seconds=window_s),
            ),
            interval_s,
        )
        self.loop = asyncio.Runner()  # the server's event loop, as far as the tuner's tick goes
        self.sim: SimEngine | None = None

    @staticmethod
    def _settings(body: dict, version: int) -> RuntimeSettings:
        return runtime_settings(PolicyDocument.model_validate(body), "sim", {PROMPT_CLASS}, version)

    def check(self, doc: PolicyDocument) -> None:
        """The simulator runs any N up to its calibration's; the policy's n_max keeps to that."""

    async def apply(self, written: Versioned) -> None:
        self.settings = self._settings(written.body, written.version)
        if self.sim is not None:
            self.sim.settings = self.settings

    def tick(self, now: float) -> None:
        self.now = now
        if now < self.next_tick:
            return
        self.next_tick += self.interval
        insert_records(self.db, self.records)
        self.records.clear()  # in place: the simulator holds this list's append
        # As the recorder does: open minutes' running totals too, replacing their earlier rows, so a
        # measurement is seen within the interval it ran in, not after its minute closes.
        flushed = self.steps.flush(now=now, snapshot_open=True)
        with self.db.begin() as conn:
            upsert_step_stats(conn, [{**row, "minute": utc(row["minute"]), "writer": "sim"} for row in flushed])
        self.loop.run(self.tuner.tick())

    def decisions(self) -> list[dict]:
        with self.db.connect() as conn:
            return [r._asdict() for r in conn.execute(select(TunerDecision.__table__).order_by(TunerDecision.id))]


def run_arm(
    cal: Calibration,
    settings: RuntimeSettings,
    phase_s: float,
    seed: int,
    arm: _TunerArm | None = None,
    drift_sigma: float = 0.0,
    slower: float = 1.0,
):
    sim = SimEngine(cal, settings, CAPACITY, seed, drift_sigma=drift_sigma, slower=slower)
    if arm is not None:
        arm.sim = sim
    on_record = arm.records.append if arm else (lambda r: None)
    on_step = arm.steps.add if arm else (lambda s: None)
    now, results = START, []
    for phase in PHASES:
        start, tokens_before, end = now, sim.tokens, now + phase_s
        while now < end:
            now += sim.step(now, PROMPT_CLASS, phase.workload, phase.concurrency, on_record, on_step)
            if arm is not None:
                arm.tick(now)
        results.append(PhaseResult(sim.tokens - tokens_before, now - start))
    return results


def static_settings(n: int) -> RuntimeSettings:
    return RuntimeSettings(version=1, speculation_enabled=n > 0, num_speculative_tokens=n)


def fidelity(cal: Calibration, seconds: float = 300.0) -> list[tuple[int, int, float, float]]:
    """(concurrency, N, simulated tok/s, measured tok/s) for every calibrated chat cell."""
    out = []
    for c, per in sorted(cal.tok_s.items()):
        for n, measured in sorted(per.items()):
            sim = SimEngine(cal, static_settings(n), CAPACITY, seed=7)
            now = 0.0
            while now < seconds:
                now += sim.step(now, PROMPT_CLASS, "chat", c, lambda r: None, lambda s: None)
            out.append((c, n, sim.tokens / now, measured))
    return out


def run(
    phase_minutes: float,
    seed: int,
    interval_s: float,
    drift_sigma: float = 0.0,
    control_budget: float = 0.0,
    window_s: float | None = None,
    cooldown_s: float | None = None,
    slower: float = 1.0,
) -> dict:
    """Every arm over the phases; ``drift_sigma``: the machine's minute-to-minute speed (``sim.DRIFT_SIGMA``
    is this machine's); ``control_budget``, ``cooldown_s``: the tuner policy's; ``window_s``: the tuner's
    acceptance window (None: what ``spectune serve`` uses by default); ``slower``: every step that many
    times as long as calibrated (a slower machine: fewer steps and requests per tuner interval)."""
    window_s = Settings.model_fields["tuner_window_s"].default if window_s is None else window_s
    cooldown_s = Policy.model_fields["cooldown_s"].default if cooldown_s is None else cooldown_s
    cal = Calibration.load()
    phase_s = phase_minutes * 60
    machine = dict(drift_sigma=drift_sigma, slower=slower)
    static = {n: run_arm(cal, static_settings(n), phase_s, seed, **machine) for n in STATIC_NS}
    policy = Policy(
        num_speculative_tokens=3, n_min=0, n_max=CAPACITY, control_budget=control_budget, cooldown_s=cooldown_s
    )
    with tempfile.TemporaryDirectory() as tmp:
        arm = _TunerArm(Path(tmp), interval_s, policy, window_s)
        try:
            tuned = run_arm(cal, arm.settings, phase_s, seed, arm, **machine)
            decisions, diagnoses = arm.decisions(), list(arm.diagnoses)
        finally:
            arm.loop.close()
            arm.db.dispose()
    return dict(
        cal=cal,
        static=static,
        tuned=tuned,
        decisions=decisions,
        diagnoses=diagnoses,
        policy=policy,
        drift=drift_sigma,
        slower=slower,
        interval_s=interval_s,
        window_s=window_s,
        phase_s=phase_s,
    )
