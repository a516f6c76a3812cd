"""Goodput model and the N decision (pure functions).

Acceptance: per draft position k, the conditional acceptance alpha_k =
P(accept k | positions < k accepted).  Counts come from the records
(drafted / accepted per position); a Beta(a, b) prior keeps a handful of
requests from swinging a decision.

    E(N)       = 1 + sum_{j=1..N} prod_{k<j} alpha_k      (expected tokens per target step)
    speedup(N) = E(N) * t(batch, 0) / t(batch, N)   (t(batch, 0): a plain step, no drafter)
    N*         = argmax over the allowed N, 0 (off) included

Cost: t(batch, N) / t(batch, 0) per batch bucket, from ``cost.CostFit`` (measured, paired, fitted,
borrowed or the prior).  Prompts cost u per generated token on top (``PrefillCost``).  Time
per generated token at batch b is t(b, N) / (b E(N)) + u(N), so

    speedup(N) = E(N) (t(b, 0) + b u_off) / (t(b, N) + b E(N) u_on)

(``wall_speedup``): the prompts' share dilutes what speculation gains, and the
drafter's prefill can turn a decode-step gain into a loss (this CPU, batch 8).
Demoted requests: a request whose draft KV went stale never drafts again but still runs
through the drafter in every step that speculates; with a share s of the requests in steps at
N drafting (measured per bucket and N from the steps' draft tokens), E(N) becomes
1 + s (E(N) - 1) -- at 8 concurrent on this CPU, after load ramps, most were demoted.
Stability: move only for a predicted gain >= ``min_gain`` and where the move's lower bound
beats the upper bound of what runs now (paired cost intervals); increases at most
``max_step`` at a time, decreases straight to the argmax.  Off is free (the drafter does
not run), so speculation that no longer beats plain serving by ``stay_margin`` (half of
``min_gain``) goes off: hysteresis must not keep a break-even guess running.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .cost import CostFit, PrefillCost

MIN_TRIALS = 30  # trials below which a position's acceptance counts as not measured


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


def remembered(
    window: PositionAcceptance, history: PositionAcceptance, min_trials: int = MIN_TRIALS
) -> PositionAcceptance:
    """The window's acceptance, continued past its data with what the longer history measured.

    An N above the one in force is drafted only while it is explored; a window shorter than the
    history forgets it a window later, and the model then extrapolates that position from the last
    one it has (``expected_tokens``) -- on the live run (2026-12-06) the tuner explored the same N
    every 30-110 s as "not measured yet", never settling.  So each position the window measured
    fewer than ``min_trials`` times takes the history's estimate where the history measured it
    ``min_trials`` times; positions stop at the first that neither measured (beyond it the model
    extrapolates, as before).  The window wins wherever it has the trials: it is the newer regime.
    And the history is another regime, not remembered, where it disagrees with the window at a
    position both measured (their ~90 % intervals do not overlap): after a domain shift the hour's
    code edits say nothing about the new traffic's later positions.  Nor where the window measured
    too little to tell (under ``min_trials`` at its first position: an off class's probes).
    """
    if not window.samples or window.samples[0] < min_trials:
        return window  # too little of the present to tell whether the history is the same regime
    for k in range(min(len(window.mean), len(history.mean))):
        both = window.samples[k] >= min_trials and history.samples[k] >= min_trials
        if both and (window.high[k] < history.low[k] or history.high[k] < window.low[k]):
            return window
    out: list[tuple[float, float, float, int]] = []
    for k in range(max(len(window.mean), len(history.mean))):
        if k < len(window.mean) and window.samples[k] >= min_trials:
            out.append((window.mean[k], window.low[k], window.high[k], window.samples[k]))
        elif k < len(history.mean) and history.samples[k] >= min_trials:
            out.append((history.mean[k], history.low[k], history.high[k], history.samples[k]))
        elif k < len(window.mean):
            out.append((window.mean[k], window.low[k], window.high[k], window.samples[k]))
        else:
            break
    mean, low, high, samples = zip(*out) if out else ((), (), (), ())
    return PositionAcceptance(tuple(mean), tuple(low), tuple(high), tuple(samples))


def expected_tokens(alphas: Sequence[float], n: int) -> float:
    """E(N) = 1 + sum_{j=1..N} prod_{k<j} alpha_k; positions past the data reuse the last alpha."""
    total, product = 1.0, 1.0
    for j in range(n):
        alpha = alphas[j] if j < len(alphas) else (alphas[-1] if alphas else 0.0)
        product *= alpha
        total += product
    return total


def wall_speedup(tokens_per_step: float, t0: float, t_n: float, prefill: PrefillCost | None = None) -> float:
    """Generated tokens per second relative to plain serving, prompts included.

    ``tokens_per_step`` E, ``t0`` a plain decode step, ``t_n`` a decode step at N; without
    ``prefill`` this is E * t0 / t_n, the decode steps alone.
    """
    if prefill is None:
        return tokens_per_step * t0 / t_n
    b = prefill.batch
    return tokens_per_step * (t0 + b * prefill.per_token(False)) / (t_n + b * tokens_per_step * prefill.per_token(True))


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


def busiest_bucket(step_counts: dict[int, dict[int, int]]) -> int | None:
    """The batch bucket that served the most sequence-steps (steps x bucket size): where the class
    decides.  A step at batch 8 serves eight requests; counting steps alone, the window's last
    minutes of batch-1 steps outvoted load that had just arrived (live run, 2026-12-03)."""
    served = {b: b * sum(per_n.values()) for b, per_n in step_counts.items()}
    return max(served, key=lambda b: (served[b], b)) if served else None


def bucket_sizes(bucket: int) -> tuple[int, int]:
    """Batch sizes a power-of-two bucket covers: 1 -> (1, 1), 2 -> (2, 2), 4 -> (3, 4), 8 -> (5, 8)."""
    return (bucket // 2 + 1, bucket) if bucket > 1 else (1, 1)


def speedup(alphas: Sequence[float], n: int, cost: float | CostFit, cost_side: str = "mean") -> float:
    """Predicted tokens/s at N over plain serving; ``cost`` is a cost ratio c (linear model: decode
    steps alone, E(N) / (1 + cN)) or a bucket's ``CostFit`` (with its prompts' cost where measured);
    ``cost_side`` "high" / "low" takes that end of a paired cost interval (``CostFit.ratio``)."""
    if n == 0:
        return 1.0
    if not isinstance(cost, CostFit):
        return expected_tokens(alphas, n) / (1.0 + cost * n)
    t0 = cost.measured.get(0, cost.t0_s)
    prefill = cost.prefill if t0 else None
    tokens = 1.0 + cost.share(n) * (expected_tokens(alphas, n) - 1.0)
    return wall_speedup(tokens, t0 or 1.0, (t0 or 1.0) * cost.ratio(n, cost_side), prefill)


def speedup_interval(alphas: Sequence[float], n: int, cost: float | CostFit) -> tuple[float, float] | None:
    """(low, high) of the predicted speedup at N from its paired cost interval; None where the cost
    at N has no interval (not paired, or N = 0, which is plain serving itself)."""
    if n == 0 or not isinstance(cost, CostFit) or n not in cost.paired:
        return None
    return speedup(alphas, n, cost, "high"), speedup(alphas, n, cost, "low")


def speedup_bounds(alphas: Sequence[float], n: int, cost: float | CostFit) -> tuple[float, float]:
    """(pessimistic, optimistic) speedup at N: its interval, or the point twice where it has none
    (plain: exactly 1)."""
    interval = speedup_interval(alphas, n, cost)
    if interval is None:
        point = speedup(alphas, n, cost)
        return point, point
    return interval


def stay_margin(min_gain: float) -> float:
    """Predicted gain over plain serving that keeps speculation running (switching on needs ``min_gain``)."""
    return min_gain / 2


def unmeasured(n: int, cost: CostFit, position_samples: Sequence[int]) -> bool:
    """Whether N is still the model's guess: its step time (``CostFit.measured``) or its last draft
    position (fewer than ``MIN_TRIALS`` trials) not measured.  What an exploration of N measures."""
    return n not in cost.measured or n > len(position_samples) or position_samples[n - 1] < MIN_TRIALS


def exploration_loss(alphas: Sequence[float], explored: int, replaced: int, cost: float | CostFit) -> float:
    """Share of tokens/s that running ``explored`` instead of ``replaced`` cost (0: none, or a gain), by
    the model as it stands -- after the exploration, with what it measured of ``explored``."""
    return max(0.0, 1.0 - speedup(alphas, explored, cost) / speedup(alphas, replaced, cost))


@dataclass(frozen=True)
class Decision:
    n: int
    predicted_speedup: float
    best_n: int
    best_speedup: float
    reason: str
    explore: bool = False  # a one-interval measurement of an N the model only extrapolates
    best_low: float | None = None  # the lower bound of best_speedup (paired cost interval; else the point)


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

    First, do no harm: a move to another N > 0 (back on from off included) also needs the lower
    bound of its speedup (``speedup_bounds``: its paired cost interval's dear end) to beat the upper
    bound of what runs now (plain: 1), so a cost stream that is merely noisy widens the intervals
    and keeps N; a real change separates them.  Going off needs no
    bound: plain serving is the baseline itself, and off is free.
    """
    if alphas is None or len(alphas) == 0:
        return Decision(current, 1.0, current, 1.0, "no data: policy N stands")
    candidates = sorted({0, *range(max(1, n_min), n_max + 1)})
    scores = {n: speedup(alphas, n, cost) for n in candidates}
    best = max(candidates, key=lambda n: (round(scores[n], 9), -n))  # ties: the smaller N
    best_low = speedup_bounds(alphas, best, cost)[0]
    here = scores.get(current, speedup(alphas, current, cost))
    if current > 0 and max(scores[n] for n in candidates if n > 0) < 1 + stay_margin(min_gain):
        # Nothing beats plain by the stay margin: the model's error is larger than such a gain.
        why = f"no N beats plain by {stay_margin(min_gain):.1%}: off"
        return Decision(0, 1.0, best, scores[best], why, best_low=best_low)
    if scores[best] < here * (1 + min_gain):
        if explore_margin > 0 and isinstance(cost, CostFit) and current > 0 and here > 1:
            guessed = [
                n
                for n in (current - 1, current + 1)
                if n in scores
                and n > 0
                and unmeasured(n, cost, position_samples)
                and scores[n] >= here * (1 - explore_margin)
                and scores[n] > 1.0  # an N the model puts below plain would switch its batches off
            ]
            if guessed:
                n = max(guessed, key=lambda k: scores[k])
                why = f"explore N={n}: not measured yet, model {scores[n]:.2f}x vs {here:.2f}x at N={current}"
                return Decision(n, scores[n], best, scores[best], why, explore=True, best_low=best_low)
        return Decision(current, here, best, scores[best], f"gain below {min_gain:.0%}: stay", best_low=best_low)
    if best == 0 or current == 0 or best < current:
        # Off, back on, and down are one move: speculating too much loses now; only increases walk.
        target = best
    else:
        target = current + max(-max_step, min(max_step, best - current))
    predicted = scores.get(target, speedup(alphas, target, cost))
    low, high = speedup_bounds(alphas, target, cost)[0], speedup_bounds(alphas, current, cost)[1]
    if target > 0 and low <= high:
        why = (f"N={target} predicts {predicted:.2f}x, but its lower bound {low:.2f}x does not beat "
               f"{high:.2f}x, the upper bound at N={current}: stay")  # fmt: skip
        return Decision(current, here, best, scores[best], why, best_low=best_low)
    return Decision(
        target,
        predicted,
        best,
        scores[best],
        f"goodput argmax N={best} ({scores[best]:.2f}x vs {here:.2f}x)",
        best_low=best_low,
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
