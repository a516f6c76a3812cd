"""Goodput model and the N decision (pure functions).

Acceptance: per draft position k, the conditional acceptance alpha_k =
P(accept k | positions < k accepted).  Counts come from the records
(drafted / accepted per position); a Beta(a, b) prior keeps a handful of
requests from swinging a decision.

    E(N)       = 1 + sum_{j=1..N} prod_{k<j} alpha_k      (expected tokens per target step)
    speedup(N) = E(N) * t(batch, 0) / t(batch, N)   (t(batch, 0): a plain step, no drafter)
    N*         = argmax over the allowed N, 0 (off) included

Cost: t(batch, N) = t0(batch) * (1 + c(batch) * N) with c the cost of one
drafted and verified token relative to a plain decode step, fitted per batch
bucket from step statistics at two or more N.  A bucket seen at one N only
borrows c from the nearest fitted bucket, else the policy's prior c is used
(documented fallback); the tuner runs a *cost probe* (one interval at N=0 in
that bucket) to get the second point.  Stability: move only for a predicted gain >= ``min_gain``; increases at
most ``max_step`` at a time, decreases straight to the argmax.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

MIN_TRIALS = 30  # trials below which a position's acceptance counts as not measured
MIN_COST_RATIO = 0.02  # floor on the cost of one drafted + verified token, relative to a plain step


@dataclass(frozen=True)
class PositionAcceptance:
    mean: tuple[float, ...]
    low: tuple[float, ...]
    high: tuple[float, ...]
    samples: tuple[int, ...]


def position_acceptance(
    drafted: Sequence[int], accepted: Sequence[int], prior: tuple[float, float] = (2.0, 2.0), z: float = 1.645
) -> PositionAcceptance:
    """Posterior mean and ~90 % interval of each alpha_k.

    Position k is reached only when k-1 was accepted, so the trials at k are
    min(drafted_k, accepted_{k-1}) (exact when every step drafts the same N).
    """
    a0, b0 = prior
    means, lows, highs, samples = [], [], [], []
    previous_accepted = None
    for k, (d, acc) in enumerate(zip(drafted, accepted)):
        trials = d if k == 0 else min(d, previous_accepted)
        successes = min(acc, trials)
        a, b = a0 + successes, b0 + trials - successes
        mean = a / (a + b)
        sd = math.sqrt(a * b / ((a + b) ** 2 * (a + b + 1)))
        means.append(mean)
        lows.append(max(0.0, mean - z * sd))
        highs.append(min(1.0, mean + z * sd))
        samples.append(trials)
        previous_accepted = acc
    return PositionAcceptance(tuple(means), tuple(lows), tuple(highs), tuple(samples))


def expected_tokens(alphas: Sequence[float], n: int) -> float:
    """E(N) = 1 + sum_{j=1..N} prod_{k<j} alpha_k; positions past the data reuse the last alpha."""
    total, product = 1.0, 1.0
    for j in range(n):
        alpha = alphas[j] if j < len(alphas) else (alphas[-1] if alphas else 0.0)
        product *= alpha
        total += product
    return total


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

    def ratio(self, n: int) -> float:
        """t(N) / t(0): measured where both were measured, else the linear model.

        Never below 1 + MIN_COST_RATIO * N: drafting and verifying is never free, and step-time noise
        must not make a draft that accepts nothing look like it pays.
        """
        if n == 0:
            return 1.0
        t0 = self.measured.get(0, self.t0_s)
        if t0 and n in self.measured:
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
) -> dict[int, CostFit]:
    """A cost model for every bucket that has steps.

    Step times measured with at least ``min_steps`` steps are used as they are
    (``CostFit.ratio``); the linear fit covers the N not measured.

    A bucket whose steps ran at one N only borrows c from the nearest fitted
    bucket (ties: the larger, since verification gets dearer with batch size),
    else uses the prior; its t0 then follows from its own observed step time.
    """
    fits = {b: fit for b, t in times.items() if (fit := fit_cost(t)) is not None}
    out: dict[int, CostFit] = {}

    def measured(bucket: int) -> dict[int, float]:
        seen = (counts or {}).get(bucket, {})
        return {n: t for n, t in times[bucket].items() if counts is None or seen.get(n, 0) >= min_steps}

    for bucket, per_n in times.items():
        if bucket in fits:
            t0, c = fits[bucket]
            out[bucket] = CostFit(t0, c, "fit", measured(bucket))
            continue
        if fits:
            near = min(fits, key=lambda b: (abs(math.log2(b) - math.log2(bucket)), -b))
            c, source = fits[near][1], f"bucket {near}"
        else:
            c, source = prior, "prior"
        observed = [(n, t) for n, t in per_n.items() if t > 0]
        t0 = None
        if observed:
            n, t = min(observed)
            t0 = t / (1 + c * n)
        out[bucket] = CostFit(t0, c, source, measured(bucket))
    return out


def bucket_sizes(bucket: int) -> tuple[int, int]:
    """Batch sizes a power-of-two bucket covers: 1 -> (1, 1), 2 -> (2, 2), 4 -> (3, 4), 8 -> (5, 8)."""
    return (bucket // 2 + 1, bucket) if bucket > 1 else (1, 1)


def speedup(alphas: Sequence[float], n: int, cost: float | CostFit) -> float:
    """E(N) * t(0) / t(N); ``cost`` is a cost ratio c (linear model) or a bucket's ``CostFit``."""
    ratio = cost.ratio(n) if isinstance(cost, CostFit) else 1.0 + cost * n
    return expected_tokens(alphas, n) / ratio


@dataclass(frozen=True)
class Decision:
    n: int
    predicted_speedup: float
    best_n: int
    best_speedup: float
    reason: str
    explore: bool = False  # a one-interval measurement of an N the model only extrapolates


def choose_n(
    alphas: Sequence[float] | None,
    cost: float | CostFit,
    current: int,
    n_min: int,
    n_max: int,
    min_gain: float = 0.05,
    max_step: int = 2,
    explore_margin: float = 0.0,
    position_samples: Sequence[int] = (),
) -> Decision:
    """The N to run: the goodput argmax, damped by hysteresis and step bounds.

    ``alphas`` None (no data) keeps ``current``.  N = 0 (off) is always a
    candidate; ``n_min``..``n_max`` bound the others.  With a ``CostFit`` and
    ``explore_margin`` > 0, a neighbour of ``current`` whose step time was
    never measured is tried when the model puts it within the margin of
    ``current`` (the linear cost model is least reliable where it
    extrapolates; one interval there replaces the guess with a measurement).
    """
    if alphas is None or len(alphas) == 0:
        return Decision(current, 1.0, current, 1.0, "no data: policy N stands")
    candidates = sorted({0, *range(max(1, n_min), n_max + 1)})
    scores = {n: speedup(alphas, n, cost) for n in candidates}
    best = max(candidates, key=lambda n: (round(scores[n], 9), -n))  # ties: the smaller N
    here = scores.get(current, speedup(alphas, current, cost))
    if scores[best] < here * (1 + min_gain):
        if explore_margin > 0 and isinstance(cost, CostFit) and current > 0 and here > 1:
            unmeasured = [
                n
                for n in (current - 1, current + 1)
                if n in scores
                and n > 0
                and (n not in cost.measured or n > len(position_samples) or position_samples[n - 1] < MIN_TRIALS)
                and scores[n] >= here * (1 - explore_margin)
            ]
            if unmeasured:
                n = max(unmeasured, key=lambda k: scores[k])
                why = f"explore N={n}: not measured yet, model {scores[n]:.2f}x vs {here:.2f}x at N={current}"
                return Decision(n, scores[n], best, scores[best], why, explore=True)
        return Decision(current, here, best, scores[best], f"gain below {min_gain:.0%}: stay")
    if best == 0 or current == 0 or best < current:
        # Off, back on, and down are one move: speculating too much loses now; only increases walk.
        target = best
    else:
        target = current + max(-max_step, min(max_step, best - current))
    return Decision(
        target,
        scores.get(target, speedup(alphas, target, cost)),
        best,
        scores[best],
        f"goodput argmax N={best} ({scores[best]:.2f}x vs {here:.2f}x)",
    )


def acceptance_shifted(long: PositionAcceptance, recent: PositionAcceptance, min_trials: int) -> bool:
    """A change point: the recent first-position interval excludes the long window's mean.

    Then the long window mixes two regimes and the tuner decides on the
    recent data alone, so a draft that starts failing is caught within an
    interval instead of a window.
    """
    if not long.samples or not recent.samples or recent.samples[0] < min_trials:
        return False
    return recent.high[0] < long.mean[0] or recent.low[0] > long.mean[0]
