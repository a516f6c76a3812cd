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
borrows c from the nearest fitted bucket -- scaled by how much one more
sequence costs a plain step, where plain steps were measured at both -- else
the policy's prior c is used (documented fallback); the tuner runs a *cost
probe* (one interval at N=0 in that bucket) to get the second point.

Prompts: steps that also prefill are not decode steps; what they cost on top,
per generated token, is u (``PrefillCost``: measured apart with speculation
off and on, since the drafter prefills every speculating request too).  Time
per generated token at batch b is t(b, N) / (b E(N)) + u(N), so

    speedup(N) = E(N) (t(b, 0) + b u_off) / (t(b, N) + b E(N) u_on)

(``wall_speedup``): the prompts' share dilutes what speculation gains, and the
drafter's prefill can turn a decode-step gain into a loss (this CPU, batch 8).
Demoted requests: a request whose draft KV went stale never drafts again but still runs
through the drafter in every step that speculates; with a share s of the requests in steps at
N drafting (measured per bucket and N from the steps' draft tokens), E(N) becomes
1 + s (E(N) - 1) -- at 8 concurrent on this CPU, after load ramps, most were demoted.
Stability: move only for a predicted gain >= ``min_gain``; increases at most
``max_step`` at a time, decreases straight to the argmax.  Off is free (the drafter does
not run), so speculation that no longer beats plain serving by ``stay_margin`` (half of
``min_gain``) goes off: hysteresis must not keep a break-even guess running.
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


def wall_speedup(tokens_per_step: float, t0: float, t_n: float, prefill: PrefillCost | None = None) -> float:
    """Generated tokens per second relative to plain serving, prompts included.

    ``tokens_per_step`` E, ``t0`` a plain decode step, ``t_n`` a decode step at N; without
    ``prefill`` this is E * t0 / t_n, the decode steps alone.
    """
    if prefill is None:
        return tokens_per_step * t0 / t_n
    b = prefill.batch
    return tokens_per_step * (t0 + b * prefill.per_token(False)) / (t_n + b * tokens_per_step * prefill.per_token(True))


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

    def share(self, n: int) -> float:
        """The drafting share at N: its own where measured, else the nearest measured N's (ties: the
        smaller), else 1 (every request drafts)."""
        if not self.drafting_share or n == 0:
            return 1.0
        return self.drafting_share[min(self.drafting_share, key=lambda m: (abs(m - n), m))]

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


MIN_THROUGHPUT_STEPS = 30  # steps per side for a measured speedup at a bucket


def measured_speedups(
    speculating: dict[int, dict[int, tuple]], plain: dict[int, dict[int, tuple]], min_steps: int = MIN_THROUGHPUT_STEPS
) -> dict[int, dict[int, float]]:
    """{bucket: {N: tokens/s at N / tokens/s at N=0}} from (tokens, seconds, steps) per bucket and N:
    the N > 0 side from ``speculating`` (a decision's span), the plain side from ``plain`` (the last
    cost window). Only where both sides ran ``min_steps`` steps.  Every step counts, prompts'
    and demoted requests' included: this is what serving at N delivered.  The bucket's batch sizes
    (5-8 for bucket 8) may differ a little between the sides."""
    out: dict[int, dict[int, float]] = {}
    for bucket, per_n in speculating.items():
        base = plain.get(bucket, {}).get(0)
        if base is None or base[2] < min_steps or base[1] <= 0:
            continue
        rate0 = base[0] / base[1]
        ratios = {n: (tok / sec) / rate0 for n, (tok, sec, steps) in per_n.items()
                  if n > 0 and steps >= min_steps and sec > 0}  # fmt: skip
        if ratios:
            out[bucket] = ratios
    return out


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
) -> dict[int, CostFit]:
    """A cost model for every bucket that has steps.

    Step times measured with at least ``min_steps`` steps are used as they are
    (``CostFit.ratio``); the linear fit covers the N not measured.

    A bucket whose steps ran at one N only borrows c from the nearest fitted
    bucket (ties: the larger, since verification gets dearer with batch size),
    scaled by the plain steps' per-sequence slope where both buckets have plain
    steps (``scaled_cost_ratio``), else uses the prior; its t0 then follows
    from its own observed step time.  ``prefill`` (per bucket) is what prompts cost on top;
    ``drafting`` (per bucket and N) the share of requests in those steps that drafted.
    """
    fits = {b: fit for b, t in times.items() if (fit := fit_cost(t)) is not None}
    out: dict[int, CostFit] = {}

    def measured(bucket: int) -> dict[int, float]:
        seen = (counts or {}).get(bucket, {})
        return {n: t for n, t in times[bucket].items() if counts is None or seen.get(n, 0) >= min_steps}

    plain = {b: m[0] for b in times if 0 in (m := measured(b))}
    slope = plain_step_slope(plain)
    for bucket, per_n in times.items():
        if bucket in fits:
            t0, c = fits[bucket]
            out[bucket] = CostFit(
                t0, c, "fit", measured(bucket), (prefill or {}).get(bucket), (drafting or {}).get(bucket, {})
            )
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
        out[bucket] = CostFit(
            t0, c, source, measured(bucket), (prefill or {}).get(bucket), (drafting or {}).get(bucket, {})
        )
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


def busiest_bucket(step_counts: dict[int, dict[int, int]]) -> int | None:
    """The batch bucket that served the most sequence-steps (steps x bucket size): where the class
    decides.  A step at batch 8 serves eight requests; counting steps alone, the window's last
    minutes of batch-1 steps outvoted load that had just arrived (live run, 2026-12-03)."""
    served = {b: b * sum(per_n.values()) for b, per_n in step_counts.items()}
    return max(served, key=lambda b: (served[b], b)) if served else None


def bucket_sizes(bucket: int) -> tuple[int, int]:
    """Batch sizes a power-of-two bucket covers: 1 -> (1, 1), 2 -> (2, 2), 4 -> (3, 4), 8 -> (5, 8)."""
    return (bucket // 2 + 1, bucket) if bucket > 1 else (1, 1)


def speedup(alphas: Sequence[float], n: int, cost: float | CostFit) -> float:
    """Predicted tokens/s at N over plain serving; ``cost`` is a cost ratio c (linear model: decode
    steps alone, E(N) / (1 + cN)) or a bucket's ``CostFit`` (with its prompts' cost where measured)."""
    if n == 0:
        return 1.0
    if not isinstance(cost, CostFit):
        return expected_tokens(alphas, n) / (1.0 + cost * n)
    t0 = cost.measured.get(0, cost.t0_s)
    prefill = cost.prefill if t0 else None
    tokens = 1.0 + cost.share(n) * (expected_tokens(alphas, n) - 1.0)
    return wall_speedup(tokens, t0 or 1.0, (t0 or 1.0) * cost.ratio(n), prefill)


def stay_margin(min_gain: float) -> float:
    """Predicted gain over plain serving that keeps speculation running (switching on needs ``min_gain``)."""
    return min_gain / 2


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
    ``current`` and above plain serving (the linear cost model is least reliable where it
    extrapolates; one interval there replaces the guess with a measurement).
    """
    if alphas is None or len(alphas) == 0:
        return Decision(current, 1.0, current, 1.0, "no data: policy N stands")
    candidates = sorted({0, *range(max(1, n_min), n_max + 1)})
    scores = {n: speedup(alphas, n, cost) for n in candidates}
    best = max(candidates, key=lambda n: (round(scores[n], 9), -n))  # ties: the smaller N
    here = scores.get(current, speedup(alphas, current, cost))
    if current > 0 and max(scores[n] for n in candidates if n > 0) < 1 + stay_margin(min_gain):
        # Nothing beats plain by the stay margin: the model's error is larger than such a gain.
        return Decision(0, 1.0, best, scores[best], f"no N beats plain by {stay_margin(min_gain):.1%}: off")
    if scores[best] < here * (1 + min_gain):
        if explore_margin > 0 and isinstance(cost, CostFit) and current > 0 and here > 1:
            unmeasured = [
                n
                for n in (current - 1, current + 1)
                if n in scores
                and n > 0
                and (n not in cost.measured or n > len(position_samples) or position_samples[n - 1] < MIN_TRIALS)
                and scores[n] >= here * (1 - explore_margin)
                and scores[n] > 1.0  # an N the model puts below plain would switch its batches off
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
