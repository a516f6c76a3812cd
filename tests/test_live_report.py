"""The live benchmark's report (pure): ratios per repetition, spread, TTFT, convergence, table shape."""

from __future__ import annotations

from benchmarks.tuner_replay.live_report import (
    Spread,
    convergence,
    percentile,
    phase_ratios,
    render,
    ttft,
    whole_run_ratios,
)

PHASES = [{"name": "chat", "concurrency": 1}, {"name": "batch", "concurrency": 8}]


def _turn(rep: int, phase: str, arm: str, t0: float, seconds: float, tokens: int) -> dict:
    return {"rep": rep, "phase": phase, "arm": arm, "round": 0, "t0": t0, "t1": t0 + seconds, "tokens": tokens}


def _turns() -> list[dict]:
    """Three repetitions; the tuner runs 1.5x, 1.2x and 2.0x plain at chat, 0.9x at batch (two turns each)."""
    out, t = [], 0.0
    for rep, chat in ((1, 1.5), (2, 1.2), (3, 2.0)):
        for phase, ratio, plain in (("chat", chat, 10), ("batch", 0.9, 80)):
            for _ in range(2):
                out.append(_turn(rep, phase, "plain", t, 30, plain * 30))
                out.append(_turn(rep, phase, "tuner", t + 30, 30, round(plain * ratio * 30)))
                t += 60
    return out


def test_each_phase_ratio_is_the_median_over_repetitions_with_its_range() -> None:
    ratios = phase_ratios(_turns(), ["chat", "batch"], ["plain", "tuner"])
    assert ratios[("chat", "tuner")].median == 1.5
    assert (ratios[("chat", "tuner")].low, ratios[("chat", "tuner")].high) == (1.2, 2.0)
    assert ratios[("batch", "tuner")].median == 0.9
    assert ratios[("chat", "plain")].values == (1.0, 1.0, 1.0)


def test_the_whole_run_weighs_every_phase_by_the_same_time_whatever_each_arm_spent_in_it() -> None:
    # Repetition 1: the tuner at 15 and 72 tok/s, plain at 10 and 80; the tuner's batch-8 turns ran
    # on for 3x as long (requests finishing after the turn): that must not weigh its batch phase more.
    turns = [{**t, "t1": t["t0"] + 90} if t["arm"] == "tuner" and t["phase"] == "batch" else t for t in _turns()]
    turns = [{**t, "tokens": t["tokens"] * 3} if t["arm"] == "tuner" and t["phase"] == "batch" else t for t in turns]
    whole = whole_run_ratios(turns, ["chat", "batch"], ["plain", "tuner"])
    assert abs(whole["tuner"].values[0] - (15 + 72) / (10 + 80)) < 1e-9


def test_a_phase_without_the_plain_arm_gets_no_ratio() -> None:
    turns = [t for t in _turns() if not (t["phase"] == "batch" and t["arm"] == "plain")]
    assert ("batch", "tuner") not in phase_ratios(turns, ["chat", "batch"], ["plain", "tuner"])
    assert Spread.of([]) is None


def test_percentiles_are_nearest_rank_as_the_store_computes_them() -> None:
    values = [float(v) for v in range(1, 21)]
    assert percentile(values, 0.95) == 19.0
    assert percentile(values, 0.5) == 10.0
    assert percentile([3.0], 0.95) == 3.0
    assert percentile([], 0.5) is None
    requests = [{"phase": "chat", "arm": "tuner", "ttft": v} for v in values]
    assert ttft(requests, "chat", "tuner") == (10.0, 19.0, 20)
    assert ttft(requests, "chat", "plain") == (None, None, 0)


def test_convergence_is_the_last_applied_change_inside_the_phase() -> None:
    decisions = [
        {"at": 5.0, "applied": True},
        {"at": 40.0, "applied": True},
        {"at": 90.0, "applied": False},  # a keep row is no change
        {"at": 130.0, "applied": True},  # the next phase's
    ]
    c = convergence(decisions, 0.0, 120.0)
    assert (c.changes, c.last_change_s, c.settled) == (2, 40.0, True)
    late = convergence([*decisions, {"at": 100.0, "applied": True}], 0.0, 120.0)
    assert (late.changes, late.last_change_s, late.settled) == (3, 100.0, False)
    assert convergence([], 0.0, 120.0) == type(c)(0, 0.0, 120.0)


def _raw(arms: list[str]) -> dict:
    turns = [t for t in _turns() if t["arm"] in ("plain", "tuner")]
    if arms != ["plain", "tuner"]:
        turns = [{**t, "arm": arms[1]} if t["arm"] == "tuner" else t for t in turns]
    spans, reps = [], sorted({t["rep"] for t in turns})
    for rep in reps:
        for p in ("chat", "batch"):
            mine = [t for t in turns if t["rep"] == rep and t["phase"] == p]
            spans.append({"rep": rep, "phase": p, "start": mine[0]["t0"], "end": mine[-1]["t1"]})
    requests = [{"rep": t["rep"], "phase": t["phase"], "arm": t["arm"], "ttft": 0.5} for t in turns]
    decisions = [
        {"at": spans[0]["start"] + 10, "applied": True, "action": "set_n", "n_before": 3, "n_after": 2,
         "predicted_speedup": 1.4, "realised_speedup": 1.45, "inputs": {"reason": "a | b", "in_force_speedup": 1.4}}
    ]  # fmt: skip
    settings = {"phase_minutes": 2, "turn_s": 30, "interval": 10, "window": 60, "cooldown": 30, "control_budget": 0.02}
    return {"began": "2026-12-06 10:00 UTC", "settings": settings, "arms": arms, "phases": PHASES, "turns": turns,
            "requests": requests, "phase_spans": spans, "decisions": decisions}  # fmt: skip


def test_every_table_row_has_as_many_cells_as_its_header() -> None:
    for arms in (["plain", "tuner"], ["plain", "static N=1"]):
        lines = render(_raw(arms))
        tables: list[list[str]] = []
        for line in lines:
            if line.startswith("|"):
                if not tables or not tables[-1]:
                    tables.append([])
                tables[-1].append(line)
            elif tables and tables[-1]:
                tables.append([])
        tables = [t for t in tables if t]
        assert tables
        for table in tables:
            widths = {row.count("|") for row in table}
            assert len(widths) == 1, table
    tuner = "\n".join(render(_raw(["plain", "tuner"])))
    assert "1.500x (1.200-2.000)" in tuner
    assert "a / b" in tuner  # a reason's pipe cannot break the table
