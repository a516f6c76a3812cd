"""The replay's report: tokens/s per phase and arm, the acceptance criteria,
the tuner's decisions (predicted vs realised) and the simulator's fidelity."""

from __future__ import annotations

import statistics
from datetime import UTC

from .replay import PHASES, START, STATIC_NS, PhaseResult, fidelity


def _total(results: list[PhaseResult]) -> float:
    return sum(r.tokens for r in results) / sum(r.seconds for r in results)


def summarise(run: dict, phase_minutes: float) -> tuple[list[str], dict[str, bool]]:
    cal, static, tuned = run["cal"], run["static"], run["tuned"]
    oracle = [max((static[n][i] for n in STATIC_NS), key=lambda r: r.tok_s) for i in range(len(PHASES))]
    oracle_n = [max(STATIC_NS, key=lambda n: static[n][i].tok_s) for i in range(len(PHASES))]
    arms = [(f"static N={n}", static[n]) for n in STATIC_NS] + [("oracle (best static per phase)", oracle)]
    arms.append(("**tuner**", tuned))
    slower = f", every step {run['slower']:g}x as long as calibrated" if run.get("slower", 1.0) != 1.0 else ""
    lines = [
        "**SIMULATED, CALIBRATED.** Engine steps are simulated (`benchmarks/tuner_replay/sim.py`) from step times",
        f"and per-position acceptance measured on the real engine ({cal.source}, measured {cal.measured_at});",
        "the tuner arm runs the real tuner (store, goodput model, batch table, cost probes, policy writes) on the",
        f"simulation's clock. {len(PHASES)} phases of {phase_minutes:g} min, one prompt class, policy start N=3; "
        f"machine speed by the minute: lognormal sigma {run.get('drift', 0.0):g} (the same for every arm)"
        f"{slower}; tuner every {run['interval_s']:g} s over a {run['window_s']:g} s window, cooldown "
        f"{run['policy'].cooldown_s:g} s, control_budget {run['policy'].control_budget:g}.",
        "",
        "| arm | " + " | ".join(f"{p.name} (batch {p.concurrency})" for p in PHASES) + " | whole run |",
        "|---|" + "---|" * (len(PHASES) + 1),
    ]
    base = static[0]
    for name, res in arms:
        cells = [f"{r.tok_s:.2f} ({r.tok_s / b.tok_s:.2f}x)" for r, b in zip(res, base)]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_total(res):.2f} ({_total(res) / _total(base):.2f}x) |")
    lines.append("")
    lines.append("Tokens/s (speedup vs no speculation). Oracle N per phase: " + ", ".join(map(str, oracle_n)) + ".")
    closed = [d for d in run["decisions"] if d["predicted_speedup"] and d["realised_speedup"] is not None]
    errors = [d["realised_speedup"] / d["predicted_speedup"] - 1 for d in closed]
    by_estimator = {
        kind: [abs(e) for d, e in zip(closed, errors) if d["realised_estimator"] == kind]
        for kind in ("paired", "unpaired")
    }
    median_error = statistics.median(errors) if errors else float("nan")
    median_abs = statistics.median(abs(e) for e in errors) if errors else float("nan")
    phase_floor = min(t.tok_s / b.tok_s for t, b in zip(tuned, base))
    criteria = {
        "tuner >= 95% of the oracle over the run": _total(tuned) >= 0.95 * _total(oracle),
        "tuner >= 1.15x static N=5 over the run": _total(tuned) >= 1.15 * _total(static[5]),
        "no phase below 0.97x no speculation": phase_floor >= 0.97,
        "predicted vs realised speedup within 15% (median abs error)": bool(errors) and median_abs <= 0.15,
    }
    values = [
        f"{_total(tuned) / _total(oracle):.1%} of oracle",
        f"{_total(tuned) / _total(static[5]):.2f}x static N=5",
        f"worst phase {phase_floor:.2f}x",
        f"median error {median_error:+.1%}, median abs {median_abs:.1%} over {len(errors)} decisions ("
        + ", ".join(f"{k} {statistics.median(v):.1%} over {len(v)}" for k, v in by_estimator.items() if v)
        + ")",
    ]
    lines += ["", "| criterion | measured | met |", "|---|---|---|"]
    lines += [f"| {k} | {v} | {'yes' if ok else '**no**'} |" for (k, ok), v in zip(criteria.items(), values)]
    applied = [d for d in run["decisions"] if d["applied"]]
    lines += [
        "",
        f"Tuner changes ({len(applied)} applied of {len(run['decisions'])} decisions; "
        f"diagnoses requested: {len(run['diagnoses'])}):",
        "",
        "| t (min) | action | N before -> after (busiest bucket) | predicted | realised | reason |",
        "|---|---|---|---|---|---|",
    ]
    start = run["decisions"][0]["at"] if run["decisions"] else None
    for d in applied:
        minutes = (d["at"] - start).total_seconds() / 60 + 1 if start else 0
        real = _realised(d)
        pred = "-" if d["predicted_speedup"] is None else f"{d['predicted_speedup']:.2f}x"
        reason = d["inputs"]["reason"].replace("|", "/")
        lines.append(
            f"| {minutes:.1f} | {d['action']} | {d['n_before']} -> {d['n_after']} | {pred} | {real} | {reason} |"
        )
    lines += ["", *_convergence(run, applied)]
    lines += [
        "",
        "Simulator vs engine (chat, end-to-end tokens/s; the engine's numbers include prefill):",
        "",
        "| batch | N | simulated | measured | ratio |",
        "|---|---|---|---|---|",
    ]
    for c, n, sim, measured in fidelity(cal):
        lines.append(f"| {c} | {n} | {sim:.2f} | {measured:.2f} | {sim / measured:.2f} |")
    return lines, criteria


def _convergence(run: dict, applied: list[dict]) -> list[str]:
    """Per phase: the changes the tuner applied in it (explorations and probes among them) and how far
    into the phase its last one came -- after it, the phase ran on one setting."""
    lines = [
        "Convergence per phase (applied changes; the last one's time into the phase):",
        "",
        "| phase | applied changes | of them explore / probe | last change (min into phase) |",
        "|---|---|---|---|",
    ]
    phase_s = run["phase_s"]
    since = [(d, d["at"].replace(tzinfo=UTC).timestamp() - START) for d in applied]  # stored naive, in UTC
    for i, phase in enumerate(PHASES):
        mine = [(d, t) for d, t in since if min(len(PHASES) - 1, int(t // phase_s)) == i]
        measuring = sum(d["action"] in ("explore", "cost_probe", "reprobe") for d, _ in mine)
        last = f"{(mine[-1][1] - i * phase_s) / 60:.1f}" if mine else "-"
        lines.append(f"| {phase.name} | {len(mine)} | {measuring} | {last} |")
    return lines


def _realised(d: dict) -> str:
    if d["realised_speedup"] is None:
        return "-"
    if d["realised_estimator"] == "paired":
        return f"{d['realised_speedup']:.2f}x ({d['realised_low']:.2f}-{d['realised_high']:.2f}, paired)"
    return f"{d['realised_speedup']:.2f}x (unpaired)"
