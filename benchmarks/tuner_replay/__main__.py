"""python -m benchmarks.tuner_replay --help"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.markdown import Markdown

from . import replay
from .report import summarise
from .sim import DRIFT_SIGMA

parser = argparse.ArgumentParser(
    prog="python -m benchmarks.tuner_replay",
    description=replay.__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
)
parser.add_argument("--phase-minutes", type=float, default=20.0, help="simulated minutes per phase")
parser.add_argument("--interval", type=float, default=60.0, help="tuner interval, simulated seconds")
parser.add_argument("--window", type=float, default=None, help="tuner acceptance window, simulated seconds "
                    "(default: spectune serve's)")  # fmt: skip
parser.add_argument(
    "--cooldown", type=float, default=None, help="the tuner policy's cooldown_s (default: the policy's)"
)
parser.add_argument("--seed", type=int, default=1)
parser.add_argument(
    "--drift",
    type=float,
    default=0.0,
    help=f"lognormal sigma of the machine's speed by the minute (this machine: about {DRIFT_SIGMA}; 0: steady)",
)
parser.add_argument(
    "--slower",
    type=float,
    default=1.0,
    help="every simulated step this many times as long as calibrated (this machine since 2026-12-07, "
    "AVX2 without bf16: about 3.5)",
)
parser.add_argument("--control-budget", type=float, default=0.0, help="the tuner policy's control_budget")
parser.add_argument("--out", type=Path, default=Path("benchmarks/results/tuner_replay.md"))
args = parser.parse_args()
result = replay.run(
    args.phase_minutes,
    args.seed,
    args.interval,
    args.drift,
    args.control_budget,
    args.window,
    args.cooldown,
    slower=args.slower,
)
lines, criteria = summarise(result, args.phase_minutes)
Console().print(Markdown("\n".join(lines)))
args.out.parent.mkdir(parents=True, exist_ok=True)
args.out.write_text("\n".join(lines) + "\n")
print(f"written {args.out}; criteria met: {sum(criteria.values())}/{len(criteria)}")
