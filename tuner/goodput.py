"""Goodput model and the N decision (pure functions).

Acceptance: per draft position k, the conditional acceptance alpha_k =
P(accept k | positions < k accepted).  Counts come from the records
(drafted / accepted per position); a Beta(a, b) prior keeps a handful of
requests from swinging a decision.

    E(N)       = 1 + sum_{j=1..N} prod_{k<j} alpha_k      (expected tokens per target step)
    speedup(N) = E(N) * t(batch, 0) / t(batch, N)
    N*         = argmax over the allowed N, 0 (off) included

Cost: t(batch, N) = t0 * (1 + c * N) with c the cost of one drafted and
verified token relative to a plain decode step, fitted from step
statistics; with no usable fit, the policy's prior c is used (documented
fallback).  Stability: move only for a predicted gain >= ``min_gain``, at most
``max_step`` at a time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


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


def fit_cost_ratio(step_times: dict[int, float], fallback: float) -> float:
    """c from mean step time per N at one batch bucket: t(N) = t0 (1 + c N).

    Least squares on the observed N values; needs at least two distinct N,
    one of them small, else ``fallback`` (the policy's prior).
    """
    points = sorted((n, t) for n, t in step_times.items() if t > 0)
    if len(points) < 2:
        return fallback
    mean_n = sum(n for n, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    var = sum((n - mean_n) ** 2 for n, _ in points)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / var
    t0 = mean_t - slope * mean_n
    if t0 <= 0 or slope < 0:
        return fallback
    return slope / t0


def speedup(alphas: Sequence[float], n: int, cost_ratio: float) -> float:
    return expected_tokens(alphas, n) / (1.0 + cost_ratio * n)


@dataclass(frozen=True)
class Decision:
    n: int
    predicted_speedup: float
    best_n: int
    best_speedup: float
    reason: str


def choose_n(
    alphas: Sequence[float] | None,
    cost_ratio: float,
    current: int,
    n_min: int,
    n_max: int,
    min_gain: float = 0.05,
    max_step: int = 2,
) -> Decision:
    """The N to run: the goodput argmax, damped by hysteresis and step bounds.

    ``alphas`` None (no data) keeps ``current``.  N = 0 (off) is always a
    candidate; ``n_min``..``n_max`` bound the others.
    """
    if alphas is None or len(alphas) == 0:
        return Decision(current, 1.0, current, 1.0, "no data: policy N stands")
    candidates = sorted({0, *range(max(1, n_min), n_max + 1)})
    scores = {n: speedup(alphas, n, cost_ratio) for n in candidates}
    best = max(candidates, key=lambda n: (round(scores[n], 9), -n))  # ties: the smaller N
    here = scores.get(current, speedup(alphas, current, cost_ratio))
    if scores[best] < here * (1 + min_gain):
        return Decision(current, here, best, scores[best], f"gain below {min_gain:.0%}: stay")
    if best == 0 or current == 0:
        target = best  # switching off (or back on) is one move, not a walk through N
    else:
        target = current + max(-max_step, min(max_step, best - current))
    return Decision(
        target,
        scores.get(target, speedup(alphas, target, cost_ratio)),
        best,
        scores[best],
        f"goodput argmax N={best} ({scores[best]:.2f}x vs {here:.2f}x)",
    )
