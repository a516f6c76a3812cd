"""The step-cost model per batch bucket (pure): what a step at N costs relative to a plain step.

t(batch, N) = t0(batch) * (1 + c(batch) * N) with c the cost of one drafted and verified token
relative to a plain decode step, fitted per batch bucket from step statistics at two or more N.
Where a bucket's step time at N was measured it is used as it is (``CostFit.ratio``), and where
minutes that ran both plain steps and steps at N were measured, their paired ratio wins
(``paired_cost``: drift between minutes cancels, and it carries an interval).  A bucket seen at
one N only borrows c from the nearest fitted bucket -- scaled by how much one more sequence
costs a plain step, where plain steps were measured at both -- else the policy's prior c is used
(documented fallback); the tuner runs a *cost probe* (one interval at N=0 in that bucket) to get
the second point.

Prompts: steps that also prefill are not decode steps; what they cost on top, per generated
token, is u (``PrefillCost``: measured apart with speculation off and on, since the drafter
prefills every speculating request too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .paired_cost import RatioEstimate

MIN_COST_RATIO = 0.02  # floor on the cost of one drafted + verified token, relative to a plain step


@dataclass(frozen=True)
class PrefillCost:
    """What steps that also prefill cost on top of decoding, in seconds per generated token, with
    speculation off and on (None: not measured), at a bucket whose mean batch size is ``batch``."""

    batch: float
    off: float | None = None
    on: float | None = None

    def per_token(self, speculating: bool) -> float:
        """u for one side; a side not measured takes the other's (no drafter prefill charged)."""
        first, other = (self.on, self.off) if speculating else (self.off, self.on)
        return first if first is not None else (other if other is not None else 0.0)


@dataclass(frozen=True)
class CostFit:
    """Step cost at one batch bucket: t(N) = t0_s * (1 + cost_ratio * N).

    ``source`` says where it came from: ``fit`` (this bucket's steps at two or
    more N), ``bucket B`` (borrowed from the nearest fitted bucket) or ``prior``.
    """

    t0_s: float | None
    cost_ratio: float
    source: str
    measured: dict[int, float] = field(default_factory=dict)  # mean step time per N seen at this bucket
    prefill: PrefillCost | None = None  # what prompts cost on top, where steps that prefill were measured
    # Share of the requests in steps at N that drafted (measured per N at this bucket): requests
    # demoted for good (their draft KV went stale) still run through the drafter, verify nothing.
    drafting_share: dict[int, float] = field(default_factory=dict)
    # t(N) / t(0) from minutes that ran both (``paired_cost``): drift between minutes cancels.
    paired: dict[int, RatioEstimate] = field(default_factory=dict)

    def share(self, n: int) -> float:
        """The drafting share at N: its own where measured, else the nearest measured N's (ties: the
        smaller), else 1 (every request drafts)."""
        if not self.drafting_share or n == 0:
            return 1.0
        return self.drafting_share[min(self.drafting_share, key=lambda m: (abs(m - n), m))]

    def ratio(self, n: int, side: str = "mean") -> float:
        """t(N) / t(0): from paired minutes where enough were measured (``side`` picks the estimate or
        an end of its interval), else from both sides' means where both were measured, else the
        linear model (those have no interval: every side is the point).

        Never below 1 + MIN_COST_RATIO * N: drafting and verifying is never free, and step-time noise
        must not make a draft that accepts nothing look like it pays.
        """
        if n == 0:
            return 1.0
        t0 = self.measured.get(0, self.t0_s)
        if n in self.paired:
            r = self.paired[n].bound(side)
        elif t0 and n in self.measured:
            r = self.measured[n] / t0
        else:
            r = 1.0 + self.cost_ratio * n
        return max(r, 1.0 + MIN_COST_RATIO * n)


def baseline(cost: float | CostFit, bucket: int | None) -> dict[str, object]:
    """What ``speedup`` divides by: the plain step at this bucket, and where its time came from.

    N = 0 runs no draft model (the engine skips the drafter when no request in a step
    speculates), so steps measured at N = 0 are plain-serving steps.
    """
    if not isinstance(cost, CostFit):
        return {"kind": "prior", "batch_bucket": bucket, "t0_s": None,
                "note": f"no step times: cost prior c = {cost}"}  # fmt: skip
    if 0 in cost.measured:
        return {"kind": "measured_plain_steps", "batch_bucket": bucket, "t0_s": cost.measured[0],
                "note": "mean step time of N=0 steps (no draft model runs) at this bucket"}  # fmt: skip
    return {"kind": "extrapolated", "batch_bucket": bucket, "t0_s": cost.t0_s,
            "note": f"no N=0 steps measured at this bucket: t0 from the cost model ({cost.source})"}  # fmt: skip


def fit_cost(step_times: dict[int, float]) -> tuple[float, float] | None:
    """(t0, c) by least squares over the observed N at one bucket, or None.

    Needs at least two distinct N; a non-positive intercept or a falling
    slope (noise, or too few steps) is no fit.
    """
    points = sorted((n, t) for n, t in step_times.items() if t > 0)
    if len(points) < 2:
        return None
    mean_n = sum(n for n, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    var = sum((n - mean_n) ** 2 for n, _ in points)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / var
    t0 = mean_t - slope * mean_n
    if t0 <= 0 or slope < 0:
        return None
    return t0, slope / t0


def costs_by_bucket(
    times: dict[int, dict[int, float]],
    prior: float,
    counts: dict[int, dict[int, int]] | None = None,
    min_steps: int = 20,
    prefill: dict[int, PrefillCost] | None = None,
    drafting: dict[int, dict[int, float]] | None = None,
    paired: dict[int, dict[int, RatioEstimate]] | None = None,
) -> dict[int, CostFit]:
    """A cost model for every bucket that has steps.

    Step times measured with at least ``min_steps`` steps are used as they are
    (``CostFit.ratio``); the linear fit covers the N not measured.

    A bucket whose steps ran at one N only borrows c from the nearest fitted
    bucket (ties: the larger, since verification gets dearer with batch size),
    scaled by the plain steps' per-sequence slope where both buckets have plain
    steps (``scaled_cost_ratio``), else uses the prior; its t0 then follows
    from its own observed step time.  ``prefill`` (per bucket) is what prompts cost on top;
    ``drafting`` (per bucket and N) the share of requests in those steps that drafted; ``paired``
    (per bucket and N) t(N) / t(0) from paired minutes, which ``CostFit.ratio`` prefers.
    """
    fits = {b: fit for b, t in times.items() if (fit := fit_cost(t)) is not None}
    out: dict[int, CostFit] = {}

    def measured(bucket: int) -> dict[int, float]:
        seen = (counts or {}).get(bucket, {})
        return {n: t for n, t in times[bucket].items() if counts is None or seen.get(n, 0) >= min_steps}

    def cost_fit(bucket: int, t0: float | None, c: float, source: str) -> CostFit:
        return CostFit(t0, c, source, measured(bucket), (prefill or {}).get(bucket),
                       (drafting or {}).get(bucket, {}), (paired or {}).get(bucket, {}))  # fmt: skip

    plain = {b: m[0] for b in times if 0 in (m := measured(b))}
    slope = plain_step_slope(plain)
    for bucket, per_n in times.items():
        if bucket in fits:
            out[bucket] = cost_fit(bucket, *fits[bucket], "fit")
            continue
        if fits:
            near = min(fits, key=lambda b: (abs(math.log2(b) - math.log2(bucket)), -b))
            c, source = fits[near][1], f"bucket {near}"
            if slope is not None and bucket in plain and near in plain:
                c = scaled_cost_ratio(c, near, plain[near], bucket, plain[bucket], slope)
                source += " + plain-step slope"
        else:
            c, source = prior, "prior"
        observed = [(n, t) for n, t in per_n.items() if t > 0]
        t0 = None
        if observed:
            n, t = min(observed)
            t0 = t / (1 + c * n)
        out[bucket] = cost_fit(bucket, t0, c, source)
    return out


def plain_step_slope(plain: dict[int, float]) -> float | None:
    """Seconds one more sequence adds to a plain step (least squares of t(b, 0) over the bucket size b).

    Needs plain steps measured at two or more buckets; a negative slope (noise) counts as flat.
    """
    if len(plain) < 2:
        return None
    mean_b = sum(plain) / len(plain)
    mean_t = sum(plain.values()) / len(plain)
    var = sum((b - mean_b) ** 2 for b in plain)
    return max(0.0, sum((b - mean_b) * (t - mean_t) for b, t in plain.items()) / var)


def scaled_cost_ratio(c_ref: float, ref: int, t0_ref: float, bucket: int, t0: float, slope: float) -> float:
    """c at ``bucket`` from a fitted bucket ``ref`` and the plain steps' per-sequence slope.

    One drafted token per sequence costs the target what one more sequence costs a plain step
    (``slope``), relative to that bucket's plain step; what the reference's c leaves over that is
    the drafter's share, taken as batch-independent.  On a compute-bound device (this CPU) the
    target's share grows with the batch; on a GPU at small batches the slope is near zero and c
    stays the reference's.  A larger bucket is never cheaper than its reference.
    """
    drafter = max(0.0, c_ref - slope * ref / t0_ref)
    c = drafter + slope * bucket / t0
    return max(c, c_ref) if bucket > ref else c
