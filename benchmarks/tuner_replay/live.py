"""The tuner live on the real engine (not simulated), against plain serving and static settings.

    python -m benchmarks.tuner_replay.live [--phase-minutes 5] [--repeats 3]   # plain vs tuner
    python -m benchmarks.tuner_replay.live --static 1,3                         # plain vs static N
    python -m benchmarks.tuner_replay.live --report-from var/live-logs/tuner_live.json

Two `spectune serve` processes on the demo pair are up at once (three do not fit
in 24 GiB; N capacity 8, SQLite store each): a plain engine (``--method none``,
the baseline) and a speculative one, which is either the tuner (``auto``, every
``--interval`` s over a ``--window`` s window, ``--cooldown`` s cooldown, a
``--control-budget``) or, with ``--static``, the tuner frozen and N set per turn.
The replay's phases (chat -> code edit -> domain shift -> high concurrency, one
prompt class) run ``--repeats`` times through the OpenAI API (streamed, so each
request's time to first token is measured); within each phase the arms take 30 s
turns in rounds (plain, then the others) until the phase's minutes are full, so
every arm sees the same machine at nearly the same time (its speed moves by 2x
within minutes).  Static arms run in a sitting of their own (their step times
would otherwise feed the tuner's cost model); compare sittings by their ratios
to plain.

The report (``live_report.render``) gives each phase's tokens/s ratio to plain as
the median over repetitions with its range, TTFT per arm, and for the tuner its
convergence per phase, its predicted speedup in force and the realised speedup
its decision rows report against the measured ratio, and every change it
applied.  The raw measurements go to var/live-logs/<out>.json after every
repetition (``--report-from`` renders them again).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from .live_report import render, tok_s
from .replay import PHASES, Phase
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

    def decisions(self) -> list[dict]:
        """Every decision row, page by page (the API returns at most 1000 at a time)."""
        rows: list[dict] = []
        while True:
            page = httpx.get(f"{self.base}/api/v1/decisions", params={"limit": 1000, "offset": len(rows)},
                             headers=HEADERS)  # fmt: skip
            page.raise_for_status()
            rows += page.json()
            if len(page.json()) < 1000:  # rows written meanwhile shift the pages: each row once
                return list({row["id"]: row for row in rows}.values())


def _serve(root: Path, name: str, port: int, settings: dict, extra: list[str]) -> Server:
    home = root / name
    home.mkdir()
    env = dict(
        os.environ,
        SPECTUNE_DB=f"sqlite:///{home}/live.db",
        SPECTUNE_SPOOL_DIR=str(home / "spool"),
        SPECTUNE_API_TOKENS=json.dumps({"live": {"token": TOKEN, "role": "operator"}}),
        SPECTUNE_TUNER_INTERVAL_S=str(settings["interval"]),
        SPECTUNE_TUNER_WINDOW_S=str(settings["window"]),
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


def _request(client: httpx.Client, base: str, body: dict) -> tuple[float, int]:
    """One streamed completion: (seconds to the first text, completion tokens from the usage chunk)."""
    began, first, tokens = time.time(), None, None
    with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c.get("text") for c in chunk.get("choices") or ()):
                first = time.time()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if first is None or tokens is None:
        raise RuntimeError(f"a streamed completion ended without text or usage: {body['prompt'][:40]!r}")
    return first - began, tokens


def _load(base: str, model: str, workload: str, concurrency: int, seconds: float, requests: list, tag: dict) -> int:
    """Closed-loop streamed load for ``seconds``; returns generated tokens. Any failed request aborts
    the run.  Each completed request goes to ``requests`` (``tag`` plus start, ttft, end, tokens)."""
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
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    }
                    began = time.time()
                    first, got = _request(client, base, body)
                    tokens[i] += got
                    requests.append({**tag, "start": began, "ttft": first, "end": time.time(), "tokens": got,
                                     "concurrency": concurrency})  # fmt: skip
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


def main(settings: dict, statics: list[int], out: Path, phases: tuple[Phase, ...] = PHASES) -> None:
    arms = ["plain", *([f"static N={n}" for n in statics] if statics else ["tuner"])]
    spec = "static" if statics else "tuner"
    raw = {"began": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "settings": settings, "arms": arms,
           "phases": [{"name": p.name, "concurrency": p.concurrency} for p in phases], "turns": [],
           "requests": [], "phase_spans": [], "decisions": []}  # fmt: skip
    raw_path = LOGS / f"{out.stem}.json"
    LOGS.mkdir(parents=True, exist_ok=True)
    # Every arm takes one turn a round; a phase is the rounds that fill its minutes.
    rounds = max(1, round(settings["phase_minutes"] * 60 / (TURN_S * len(arms))))
    with tempfile.TemporaryDirectory() as tmp:
        root, port = Path(tmp), 18000 + os.getpid() % 1000
        servers = {
            "plain": _serve(root, "plain", port, settings, ["--method", "none", "-n", "0"]),
            spec: _serve(root, spec, port + 1, settings, []),
        }
        try:
            for server in servers.values():
                wait_ready(server.proc, f"{server.base}/readyz", root / server.name / "server.log", 600,
                           ready=lambda r: r.json().get("ready"))  # fmt: skip
            servers[spec].patch_policy({"global": {
                "tuner_mode": "frozen", "cooldown_s": settings["cooldown"], "n_min": 0, "n_max": 8,
                "control_budget": settings["control_budget"]}})  # fmt: skip
            model = httpx.get(f"{servers['plain'].base}/v1/models").json()["data"][0]["id"]
            for server in servers.values():  # the first requests on a fresh engine are slow on this CPU
                _load(server.base, model, "chat", 1, WARM_UP_S, [], {})
            if not statics:  # the tuner starts with the run (it has the warm-up's records and steps)
                servers["tuner"].patch_policy({"global": {"tuner_mode": "auto"}})
            raw["start"] = time.time()
            for rep in range(1, settings["repeats"] + 1):
                for phase in phases:
                    phase_start = time.time()
                    # Short turns, arms interleaved: this shared machine's speed moves by 2x within minutes.
                    for round_ in range(rounds):
                        for arm in arms:
                            server = servers[arm if arm in servers else "static"]
                            if arm.startswith("static"):
                                n = int(arm.split("=")[1])
                                server.patch_policy({"global": {"num_speculative_tokens": n,
                                                                "speculation_enabled": n > 0}})  # fmt: skip
                            tag = {"rep": rep, "phase": phase.name, "arm": arm}
                            t0 = time.time()
                            tokens = _load(server.base, model, phase.workload, phase.concurrency, TURN_S,
                                           raw["requests"], tag)  # fmt: skip
                            raw["turns"].append({**tag, "round": round_, "t0": t0, "t1": time.time(), "tokens": tokens})
                    raw["phase_spans"].append({"rep": rep, "phase": phase.name, "start": phase_start,
                                               "end": time.time()})  # fmt: skip
                    speeds = (f"{a} {tok_s(raw['turns'], rep, phase.name, a):.2f} tok/s" for a in arms)
                    print(f"rep {rep} / {phase.name}: " + ", ".join(speeds), flush=True)
                raw_path.write_text(json.dumps(raw, default=str))  # a crash later keeps the repetitions done
            time.sleep(2 * settings["interval"])  # let the last decisions close
            raw["decisions"] = servers[spec].decisions()
        finally:
            for server in servers.values():
                server.proc.terminate()
            for server in servers.values():
                server.proc.wait(timeout=120)
            for server in servers.values():  # kept: the temporary directory goes
                # The database with its write-ahead log (recent rows live there until a checkpoint); a
                # run stopped early may not have written every file yet, and an older run's must not
                # stay beside this one's.
                for name, kept in (("server.log", ".log"), ("live.db", ".db"), ("live.db-wal", ".db-wal")):
                    (LOGS / f"{server.name}{kept}").unlink(missing_ok=True)
                    if (root / server.name / name).exists():
                        shutil.copy(root / server.name / name, LOGS / f"{server.name}{kept}")
    raw_path.write_text(json.dumps(raw, default=str))  # to re-render without re-running
    _write(render(raw), out)


def _write(lines: list[str], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase-minutes", type=float, default=5.0, help="wall clock per phase, all arms' turns")
    parser.add_argument("--repeats", type=int, default=3, help="times the four phases run, one after another")
    parser.add_argument("--interval", type=float, default=10.0, help="tuner interval (s)")
    parser.add_argument("--window", type=float, default=60.0, help="tuner acceptance window (s)")
    parser.add_argument("--cooldown", type=float, default=30.0, help="policy cooldown (s)")
    parser.add_argument("--control-budget", type=float, default=0.02, help="policy control_budget")
    parser.add_argument("--static", default="", help="static arms instead of the tuner: comma-separated N")
    parser.add_argument(
        "--phases",
        default=",".join(p.name for p in PHASES),
        help="comma-separated phases to run, in this order (default: all four)",
    )
    parser.add_argument("--out", type=Path, default=None, help="default benchmarks/results/tuner_live[_static].md")
    parser.add_argument(
        "--report-from", type=Path, default=None, help="render the report again from a run's var/live-logs/*.json"
    )
    args = parser.parse_args()
    statics = [int(n) for n in args.static.split(",") if n]
    by_name = {p.name: p for p in PHASES}
    unknown = [name for name in args.phases.split(",") if name not in by_name]
    if unknown:
        parser.error(f"unknown phase {unknown[0]!r}; choose among {', '.join(by_name)}")
    out = args.out or Path("benchmarks/results/" + ("tuner_live_static.md" if statics else "tuner_live.md"))
    if args.report_from is not None:
        _write(render(json.loads(args.report_from.read_text())), out)
        raise SystemExit(0)
    # A SIGTERM ends the run as an exception would: the servers it started are ended with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    settings = {k: getattr(args, k) for k in ("phase_minutes", "repeats", "interval", "window", "cooldown",
                                              "control_budget")}  # fmt: skip
    main({**settings, "turn_s": TURN_S}, statics, out, tuple(by_name[name] for name in args.phases.split(",")))
