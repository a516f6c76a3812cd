"""Noise-proof step cost: t(N) / t(0) from steps measured in the same minutes (pure).

The machine under an engine changes speed by minutes (other tenants, thermal limits, prompt
lengths): a plain step measured at 12:00 and a step at N measured at 12:07 differ by that
drift as much as by N (here the same plain engine ran at 2.5, 4.5, 4.7 and 11 tok/s in four
sittings).  So the cost of speculating is estimated from **paired minutes** only: a minute in
which one batch bucket ran both plain steps (N = 0) and steps at N.  Drift common to both sides
of a minute cancels in its ratio r_m = mean t(N) / mean t(0).

Estimator (``ESTIMATOR``), over the paired minutes m of a window:

    x_m   = log r_m,   w_m = 1 / (1 / s0_m + 1 / sN_m)        (s: steps of each side that minute)
    log r = sum w x / sum w
    se    = sqrt(v * sum w^2) / sum w,  v = sum w (x - log r)^2 / (sum w - sum w^2 / sum w)
    r     in exp(log r -+ t_{0.95, m-1} * se)                     (a 90 % interval)

The interval comes from how much the minutes' ratios disagree, so a noisy stream widens it
rather than moving the estimate.  Fewer than ``MIN_PAIRED_MINUTES`` paired minutes (each with
``MIN_PAIRED_STEPS`` steps a side) give no estimate: the caller falls back to unpaired means.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

MIN_PAIRED_MINUTES = 3  # paired minutes for an estimate (two degrees of freedom for its spread)
MIN_PAIRED_STEPS = 5  # steps of each side in a minute for that minute to count
CONFIDENCE = 0.95  # one-sided, each end: a 90 % interval, as for acceptance
ESTIMATOR = (
    "paired minutes: weighted geometric mean of each minute's t(N)/t(0) at this bucket, "
    "90 % t-interval from their spread"
)

# (plain steps, plain seconds, steps at N, seconds at N) of one minute at one bucket.
MinutePair = tuple[int, float, int, float]


@dataclass(frozen=True)
class RatioEstimate:
    """t(N) / t(0) at one bucket from paired minutes, with its 90 % interval."""

    ratio: float
    low: float
    high: float
    minutes: int  # paired minutes that counted
    steps: int  # steps at N in them

    def bound(self, side: str) -> float:
        return {"mean": self.ratio, "low": self.low, "high": self.high}[side]


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile by the Cornish-Fisher expansion in 1/df (Abramowitz & Stegun 26.7.5):
    within 1.5 % of the exact value from df = 2 on, exact as df grows."""
    if df < 1:
        raise ValueError(f"t quantile needs df >= 1, got {df}")
    z = NormalDist().inv_cdf(p)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / df + g2 / df**2 + g3 / df**3


def paired_ratio(pairs: Iterable[MinutePair]) -> RatioEstimate | None:
    """The estimate over a window's paired minutes (``ESTIMATOR``), or None with too few."""
    xs: list[float] = []
    ws: list[float] = []
    steps_n = 0
    for s0, t0, sn, tn in pairs:
        if s0 < MIN_PAIRED_STEPS or sn < MIN_PAIRED_STEPS or t0 <= 0 or tn <= 0:
            continue
        xs.append(math.log((tn / sn) / (t0 / s0)))
        ws.append(1 / (1 / s0 + 1 / sn))
        steps_n += sn
    if len(xs) < MIN_PAIRED_MINUTES:
        return None
    total = sum(ws)
    squares = sum(w * w for w in ws)
    mean = sum(w * x for w, x in zip(ws, xs)) / total
    spread = sum(w * (x - mean) ** 2 for w, x in zip(ws, xs)) / (total - squares / total)
    half = t_quantile(CONFIDENCE, len(xs) - 1) * math.sqrt(spread * squares) / total
    return RatioEstimate(math.exp(mean), math.exp(mean - half), math.exp(mean + half), len(xs), steps_n)


def paired_ratios(pairs: dict[int, dict[int, Sequence[MinutePair]]]) -> dict[int, dict[int, RatioEstimate]]:
    """{bucket: {N: estimate}} wherever enough minutes were paired."""
    out: dict[int, dict[int, RatioEstimate]] = {}
    for bucket, per_n in pairs.items():
        found = {n: est for n, minutes in per_n.items() if (est := paired_ratio(minutes)) is not None}
        if found:
            out[bucket] = found
    return out
