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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

MIN_PAIRED_MINUTES = 3  # paired minutes for an estimate (two degrees of freedom for its spread)
MIN_PAIRED_STEPS = 5  # steps of each side in a minute for that minute to count
CONFIDENCE = 0.95  # one-sided, each end: a 90 % interval, as for acceptance
ESTIMATOR = (
    "paired minutes: weighted geometric mean of each minute's t(N)/t(0) at this bucket, "
    "90 % t-interval from their spread"
)

# One minute at one bucket of one instance: (plain steps, their seconds, steps at N, their seconds,
# and optionally the tokens each side generated: plain, at N) -- ``store.tuner_inputs.paired_of`` (decode
# steps, for the cost) and ``paired_throughput_of`` (every step with its tokens, for the speedup).
MinutePair = tuple[int, float, int, float] | tuple[int, float, int, float, int, int]
SPEEDUP_ESTIMATOR = (
    "paired minutes: weighted geometric mean of each minute's tokens/s at N over plain tokens/s at this "
    "bucket, 90 % t-interval from their spread"
)


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
    """t(N) / t(0), the cost of a step at N, over a window's paired minutes (``ESTIMATOR``), or None
    with too few."""
    return _paired(pairs, lambda p: (p[3] / p[2]) / (p[1] / p[0]))


def paired_speedup(pairs: Iterable[MinutePair]) -> RatioEstimate | None:
    """Tokens/s at N over plain tokens/s, the speedup serving at N measured, over a window's paired
    minutes (``SPEEDUP_ESTIMATOR``: the same estimator, on the minutes' throughput ratios), or None
    with too few.  What the steps delivered, so it holds whatever the model of acceptance assumes."""
    return _paired(pairs, lambda p: (p[5] / p[3]) / (p[4] / p[1]) if p[4] > 0 and p[5] > 0 else 0.0)


def _paired(pairs: Iterable[MinutePair], ratio: Callable[[MinutePair], float]) -> RatioEstimate | None:
    """The weighted geometric mean of ``ratio`` over the minutes with enough steps a side, and its
    90 % t-interval (module docstring); None below ``MIN_PAIRED_MINUTES`` such minutes."""
    xs: list[float] = []
    ws: list[float] = []
    steps_n = 0
    for pair in pairs:
        s0, t0, sn, tn = pair[:4]
        if s0 < MIN_PAIRED_STEPS or sn < MIN_PAIRED_STEPS or t0 <= 0 or tn <= 0 or (r := ratio(pair)) <= 0:
            continue
        xs.append(math.log(r))
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


def paired_ratios(
    pairs: dict[int, dict[int, Sequence[MinutePair]]], estimate: Callable[..., RatioEstimate | None] = paired_ratio
) -> dict[int, dict[int, RatioEstimate]]:
    """{bucket: {N: estimate}} wherever enough minutes were paired (``estimate``: ``paired_ratio``,
    the cost, or ``paired_speedup``, the speedup)."""
    out: dict[int, dict[int, RatioEstimate]] = {}
    for bucket, per_n in pairs.items():
        found = {n: est for n, minutes in per_n.items() if (est := estimate(minutes)) is not None}
        if found:
            out[bucket] = found
    return out


MAX_CONTROL_FRACTION = 0.25  # a class that barely pays (or does not) is measured on a quarter of its requests


def control_share(budget: float, speedup: float) -> float:
    """The share f of a speculating class's requests to serve plain (control requests) so that they
    cost at most ``budget`` of its tokens/s at this ``speedup`` S over plain: serving a share f plain
    runs at S / (1 + f (S - 1)) of plain, a loss of f (S - 1) / (1 + f (S - 1)); so
    f = budget / ((1 - budget)(S - 1)), at most ``MAX_CONTROL_FRACTION``.  The nearer S is to 1 the
    cheaper a control request, and the more the measurement matters: a draft that barely pays gets
    the most of them, one at 3x the fewest."""
    if budget <= 0:
        return 0.0
    if speedup <= 1:
        return MAX_CONTROL_FRACTION  # plain is as fast: control requests cost nothing
    return min(MAX_CONTROL_FRACTION, budget / ((1 - budget) * (speedup - 1)))
