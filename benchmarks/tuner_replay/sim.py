"""A step-level engine simulator calibrated from measurements of the real engine.

Every engine step: the running requests (closed loop: a finished request is
replaced at once, so the batch stays at the phase's concurrency) each get the
N that ``RuntimeSettings.n_for`` gives their class at this batch size (the
same function the real scheduler uses); the step takes the *measured* mean
step time at (batch, step N) times lognormal noise and, with ``drift_sigma``,
times the machine's speed that simulated minute; each request accepts a
prefix of its drafts, drawn position by position with the *measured*
conditional acceptance alpha_k of the phase's workload, and emits 1 + accepted
tokens.  Finished requests become ``RequestRecord``s, steps ``StepRecord``s,
exactly the shapes the real engine reports.  Probes and control requests are
drawn at admission as the engine draws them (``engine/core.py``).

Not simulated: prefill (every arm pays it equally), memory limits, TTFT.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from spectune.engine.schema import RequestRecord, RuntimeSettings, StepRecord

CALIBRATION = Path(__file__).parent / "calibration.json"
STEP_NOISE_SIGMA = 0.05  # lognormal sigma on step time (the measured cells' spread is of this order)
# The machine's speed by the minute (other tenants): lognormal sigma of a factor on every step time,
# drawn afresh each simulated minute and the same for every arm at the same minute.  Here the same
# plain engine ran at 2.5, 4.5, 4.7 and 11 tok/s in four sittings.
DRIFT_SIGMA = 0.3


@dataclass(frozen=True)
class Calibration:
    step_time: dict[int, dict[int, float]]  # batch -> N -> mean seconds
    alphas: dict[str, list[float]]  # workload -> conditional acceptance per position
    tok_s: dict[int, dict[int, float]]  # concurrency -> N -> measured end-to-end tokens/s (chat)
    measured_at: str
    source: str

    @classmethod
    def load(cls, path: Path = CALIBRATION) -> Calibration:
        doc = json.loads(path.read_text())
        step_time = {
            int(b): {int(n): cell["mean"] for n, cell in per.items() if cell["count"] >= 5}
            for b, per in doc["step_time_s"].items()
        }
        alphas = {}
        for name, acc in doc["acceptance"].items():
            drafted, accepted = acc["drafted_per_position"], acc["accepted_per_position"]
            reached = [drafted[0], *accepted[:-1]]  # trials at k = accepted at k-1
            alphas[name] = [a / r if r else 0.0 for a, r in zip(accepted, reached)]
        tok_s = {int(c): {int(n): v for n, v in per.items()} for c, per in doc["tok_s"].items()}
        return cls(
            step_time, alphas, tok_s, doc["measured_at"], f"{path.name} ({doc['pair']['target']}, {doc['engine']})"
        )

    def step_seconds(self, batch: int, n: int) -> float:
        """Measured mean at this batch size; an N between measured values is interpolated."""
        if batch not in self.step_time:
            raise ValueError(f"batch {batch} was not calibrated (have {sorted(self.step_time)})")
        per = self.step_time[batch]
        if n in per:
            t = per[n]
        else:
            lower = max((k for k in per if k < n), default=min(per))
            upper = min((k for k in per if k > n), default=max(per))
            t = per[lower] if upper == lower else per[lower] + (per[upper] - per[lower]) * (n - lower) / (upper - lower)
        return t


@dataclass
class _Request:
    rid: str
    prompt_class: str
    arrival: float
    probe: bool
    control: bool = False  # served plain beside its speculating class (``control_fraction``)
    tokens: int = 0
    first_token: float | None = None
    spec_steps: int = 0
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)


class SimEngine:
    def __init__(
        self,
        calibration: Calibration,
        settings: RuntimeSettings,
        capacity: int,
        seed: int,
        max_tokens: int = 48,
        drift_sigma: float = 0.0,
        slower: float = 1.0,
    ) -> None:
        self.cal, self.settings, self.capacity, self.max_tokens = calibration, settings, capacity, max_tokens
        self.rng = random.Random(seed)
        self.seed, self.drift_sigma, self.slower = seed, drift_sigma, slower
        self._speed: dict[int, float] = {}
        self.running: list[_Request] = []
        self.count = 0
        self.tokens = 0

    def _admit(self, prompt_class: str, now: float) -> None:
        off = self.settings.n_for(prompt_class, 1, self.capacity) == 0
        probe = off and self.rng.random() < self.settings.probe_fraction_for(prompt_class)
        share = 0.0 if off or self.running else self.settings.control_fraction_for(prompt_class)  # alone only
        control = share > 0 and self.rng.random() < share
        self.count += 1
        self.running.append(_Request(f"sim-{self.count}", prompt_class, now, probe, control))

    def step(
        self, now: float, prompt_class: str, workload: str, concurrency: int, on_record: Callable, on_step: Callable
    ) -> float:
        """One engine step at ``now``; returns its duration."""
        while len(self.running) < concurrency:
            self._admit(prompt_class, now)
        batch = len(self.running)
        ns = [self._n(r, batch) for r in self.running]
        step_n = max(ns)
        dt = self.cal.step_seconds(batch, step_n) * self.rng.lognormvariate(0.0, STEP_NOISE_SIGMA) * self.slowdown(now)
        alphas = self.cal.alphas[workload]
        drafted_total = accepted_total = 0
        per_position = [0] * step_n
        for r, n in zip(self.running, ns):
            accepted = 0
            while accepted < n and self.rng.random() < alphas[min(accepted, len(alphas) - 1)]:
                accepted += 1
            if n:
                r.spec_steps += 1
                r.drafted += [0] * (n - len(r.drafted))
                r.accepted += [0] * (n - len(r.accepted))
                for k in range(n):
                    r.drafted[k] += 1
                for k in range(accepted):
                    r.accepted[k] += 1
                    per_position[k] += 1
                drafted_total += n
                accepted_total += accepted
            emitted = min(1 + accepted, self.max_tokens - r.tokens)
            r.tokens += emitted
            self.tokens += emitted
            if r.first_token is None:
                r.first_token = now + dt
        on_step(
            StepRecord(
                instance_id="sim",
                time=now + dt,
                batch_size=batch,
                num_prefill_requests=0,
                num_decode_requests=batch,
                num_scheduled_tokens=batch + sum(ns),
                step_time_s=dt,
                num_speculative_tokens=step_n,
                num_drafts=sum(1 for n in ns if n),
                num_draft_tokens=drafted_total,
                num_accepted_tokens=accepted_total,
                accepted_per_position=per_position,
            )
        )
        for r in [r for r in self.running if r.tokens >= self.max_tokens]:
            self.running.remove(r)
            on_record(self._record(r, now + dt))
        return dt

    def slowdown(self, now: float) -> float:
        """The machine's step-time factor in the simulated minute of ``now`` (``slower`` without drift)."""
        minute = int(now // 60)
        if minute not in self._speed:
            drift = random.Random(self.seed * 1_000_003 + minute).lognormvariate(0.0, self.drift_sigma)
            self._speed[minute] = self.slower * drift
        return self._speed[minute]

    def _n(self, r: _Request, batch: int) -> int:
        return 0 if r.control else self.settings.n_for(r.prompt_class, batch, self.capacity, probing=r.probe)

    def _record(self, r: _Request, finish: float) -> RequestRecord:
        n = self._n(r, 1)
        return RequestRecord(
            request_id=r.rid,
            instance_id="sim",
            model="sim",
            prompt_class=r.prompt_class,
            arrival_time=r.arrival,
            first_token_time=r.first_token,
            finish_time=finish,
            prompt_tokens=32,
            output_tokens=r.tokens,
            ttft_s=(r.first_token or finish) - r.arrival,
            tpot_s=(finish - (r.first_token or finish)) / max(1, r.tokens - 1),
            e2e_s=finish - r.arrival,
            speculation_method="draft_model",
            speculation_enabled=n > 0,
            num_speculative_tokens=n,
            settings_version=self.settings.version,
            num_spec_steps=r.spec_steps,
            num_draft_tokens=sum(r.drafted),
            num_accepted_tokens=sum(r.accepted),
            drafted_per_position=r.drafted,
            accepted_per_position=r.accepted,
            finish_reason="length",
        )
