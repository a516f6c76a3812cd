"""Noise-proof cost: paired-minute ratios, their interval, and "first, do no harm" (pure)."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spectune.store.tuner_inputs import StepMinute, paired_of
from spectune.tuner.cost import CostFit, fit_cost
from spectune.tuner.decide import decide_class
from spectune.tuner.goodput import choose_n, speedup, speedup_bounds, speedup_interval
from spectune.tuner.paired_cost import MIN_PAIRED_MINUTES, paired_ratio, paired_ratios, t_quantile
from spectune.tuner.policy import Policy

ALPHAS = [0.8, 0.75, 0.7, 0.65, 0.6, 0.55]
T0 = 0.1


def _minute(true_ratio: float, drift: float, rng: random.Random, steps: int = 200, jitter: float = 0.0):
    """One paired minute: plain and N-steps both slowed by the machine's ``drift`` that minute, each
    side's mean off by up to ``jitter`` (what a minute's own steps leave)."""
    plain = T0 * drift * (1 + rng.uniform(-jitter, jitter))
    at_n = T0 * true_ratio * drift * (1 + rng.uniform(-jitter, jitter))
    return (steps, plain * steps, steps, at_n * steps)


def test_t_quantile_matches_students_t():
    from scipy.stats import t

    for df in (2, 3, 4, 6, 10, 20, 30, 60, 200):
        assert t_quantile(0.95, df) == pytest.approx(t.ppf(0.95, df), rel=0.015)
    with pytest.raises(ValueError):
        t_quantile(0.95, 0)


def test_drift_common_to_a_minute_cancels_exactly():
    rng = random.Random(1)
    pairs = [_minute(1.3, drift, rng) for drift in (0.25, 1.0, 4.0, 2.2, 0.6)]  # 16x between minutes
    est = paired_ratio(pairs)
    assert est.ratio == pytest.approx(1.3) and est.low == pytest.approx(1.3) and est.high == pytest.approx(1.3)
    assert (est.minutes, est.steps) == (5, 1000)


def test_too_few_minutes_or_steps_give_no_estimate():
    rng = random.Random(2)
    two = [_minute(1.2, 1.0, rng), _minute(1.2, 2.0, rng)]
    assert paired_ratio(two) is None
    thin = (4, 0.4, 200, 24.0)  # 4 plain steps: not a measured minute
    assert paired_ratio([*two, thin]) is None
    assert paired_ratio([*two, _minute(1.2, 0.5, rng)]).minutes == MIN_PAIRED_MINUTES
    assert paired_ratios({1: {3: two}, 8: {1: [*two, _minute(1.2, 3.0, rng)]}}).keys() == {8}


def test_disagreeing_minutes_widen_the_interval_and_more_minutes_narrow_it():
    rng = random.Random(3)
    calm = paired_ratio([_minute(1.2, rng.uniform(0.3, 3), rng, jitter=0.02) for _ in range(6)])
    rough = paired_ratio([_minute(1.2, rng.uniform(0.3, 3), rng, jitter=0.25) for _ in range(6)])
    many = paired_ratio([_minute(1.2, rng.uniform(0.3, 3), rng, jitter=0.25) for _ in range(60)])
    width = lambda e: math.log(e.high / e.low)  # noqa: E731
    assert calm.low < 1.2 < calm.high and width(calm) < width(rough)
    assert width(many) < width(rough) and many.low < 1.2 < many.high


def test_the_interval_covers_the_true_ratio_about_as_often_as_it_says():
    rng = random.Random(4)
    trials, covered = 400, 0
    for _ in range(trials):
        est = paired_ratio([_minute(1.25, rng.uniform(0.25, 4), rng, jitter=0.15) for _ in range(5)])
        covered += est.low <= 1.25 <= est.high
    assert 0.82 <= covered / trials <= 0.97  # a 90 % interval


def _rows(minute: int, instance: str, bucket: int, n: int, steps: int, time_s: float) -> StepMinute:
    at = datetime(2026, 1, 1, 12, tzinfo=UTC) + timedelta(minutes=minute)
    return StepMinute(at, instance, bucket, n, steps, time_s, bucket * steps, 0, 0, 0, 0.0, 0)


def test_pairs_are_same_minute_same_instance_same_bucket():
    rows = [
        _rows(0, "a", 1, 0, 10, 1.0), _rows(0, "a", 1, 3, 20, 2.6),  # a pair
        _rows(0, "b", 1, 3, 30, 9.0),  # b ran no plain step that minute: not paired with a's
        _rows(1, "a", 1, 0, 10, 1.0), _rows(2, "a", 1, 3, 10, 1.3),  # different minutes
        _rows(3, "a", 8, 0, 10, 2.0), _rows(3, "a", 1, 3, 10, 1.3),  # different buckets
        _rows(4, "b", 8, 0, 10, 2.0), _rows(4, "b", 8, 1, 10, 2.4), _rows(4, "b", 8, 2, 5, 1.4),
    ]  # fmt: skip
    since = datetime(2026, 1, 1, 12, tzinfo=UTC)
    at_8 = {1: [(10, 2.0, 10, 2.4)], 2: [(10, 2.0, 5, 1.4)]}
    assert paired_of(rows, since) == {1: {3: [(10, 1.0, 20, 2.6)]}, 8: at_8}
    assert paired_of(rows, since + timedelta(minutes=1)) == {8: at_8}


def _cost(true_c: float, paired_ns, drifts, jitter: float, seed: int) -> CostFit:
    """A bucket whose cost at each N in ``paired_ns`` was measured in paired minutes with these drifts."""
    rng = random.Random(seed)
    paired = {n: paired_ratio([_minute(1 + true_c * n, d, rng, jitter=jitter) for d in drifts]) for n in paired_ns}
    # The linear model says off (c = 5): only the paired minutes can keep N where it is.
    return CostFit(T0, 5.0, "fit", {0: T0}, paired={n: e for n, e in paired.items() if e is not None})


def _best_n(c: float) -> int:
    return max(range(1, 7), key=lambda n: speedup(ALPHAS, n, c))


def _streams(least_minutes: int) -> dict:
    """A window of paired minutes: the machine's speed each minute (25x apart at most), what a minute's
    own steps leave in each side's mean (up to 5 %), and the seed that draws those."""
    return dict(drifts=st.lists(st.floats(0.2, 5.0), min_size=least_minutes, max_size=30),
                jitter=st.floats(0.0, 0.05), seed=st.integers(0, 10_000))  # fmt: skip


# Derandomized: the intervals are 90 % ones, so a search long enough finds the rare minutes that
# mislead them; these fix the examples and say what holds for them.
@settings(max_examples=80, deadline=None, derandomize=True)
@given(c=st.floats(0.05, 0.3), **_streams(3))
def test_a_noisy_cost_stream_does_not_move_n(c, drifts, jitter, seed):
    """The machine's speed swings up to 25x between minutes; nothing about speculation changed."""
    current = _best_n(c)
    cost = _cost(c, range(1, 7), drifts, jitter, seed)
    d = choose_n(ALPHAS, cost, current, 1, 6)
    assert d.n == current, d.reason


@settings(max_examples=60, deadline=None, derandomize=True)
@given(c=st.floats(0.05, 0.15), **_streams(5))
def test_a_real_change_in_cost_moves_n(c, drifts, jitter, seed):
    """The draft got dearer (another draft, a slower device) until N in force gives up at least 15 %
    against the new best: the same drifts cannot hide that."""
    current = _best_n(c)
    dearer = c
    while speedup(ALPHAS, current, dearer) > 0.85 * speedup(ALPHAS, _best_n(dearer), dearer):
        dearer *= 1.1
    d = choose_n(ALPHAS, _cost(dearer, range(1, 7), drifts, jitter, seed), current, 1, 6)
    assert d.n < current, d.reason


def test_unpaired_means_are_fooled_by_drift_where_paired_minutes_are_not():
    """Plain steps measured in a fast minute, steps at N=3 in a slow one: their means say N=3 costs
    3.6x a plain step (off); the minutes that ran both say 1.2x."""
    rng = random.Random(5)
    c = fit_cost({0: T0, 3: 3 * 0.12})[1]  # what the means fit: 0.87 per drafted token
    unpaired = CostFit(T0, c, "fit", {0: T0, 3: 3 * 0.12})
    assert choose_n(ALPHAS, unpaired, 3, 1, 6).n == 0
    paired = CostFit(T0, c, "fit", {0: T0, 3: 3 * 0.12},
                     paired={3: paired_ratio([_minute(1.2, d, rng) for d in (1, 3, 0.5)])})  # fmt: skip
    assert choose_n(ALPHAS, paired, 3, 1, 6).n == 3


def test_a_move_needs_its_lower_bound_to_beat_what_runs():
    rng = random.Random(6)
    # N=4 is cheaper than the linear model says, but measured in three minutes that disagree by 2x.
    wild = paired_ratio([(200, 20.0, 200, 20.0 * r) for r in (1.0, 2.0, 1.1)])
    narrow = paired_ratio([_minute(1.36, d, rng, jitter=0.01) for d in (1, 2, 0.5, 3)])
    point = CostFit(T0, 0.25, "fit", {0: T0}, paired={})
    here = speedup(ALPHAS, 2, point)
    assert speedup(ALPHAS, 4, CostFit(T0, 0.25, "fit", {0: T0}, paired={4: wild})) > here * 1.05  # it looks better
    stay = choose_n(ALPHAS, CostFit(T0, 0.25, "fit", {0: T0}, paired={4: wild}), 2, 1, 4)
    assert stay.n == 2 and "lower bound" in stay.reason
    low, high = speedup_interval(ALPHAS, 4, CostFit(T0, 0.25, "fit", {0: T0}, paired={4: wild}))
    assert low < here < high
    go = choose_n(ALPHAS, CostFit(T0, 0.25, "fit", {0: T0}, paired={4: narrow}), 2, 1, 4)
    assert go.n == 4
    assert speedup_bounds(ALPHAS, 2, point) == (here, here)  # no interval: the point, both ends


def test_an_off_class_comes_back_on_only_when_the_lower_bound_beats_plain():
    policy = Policy(speculation_enabled=False, num_speculative_tokens=2, n_min=1, n_max=2)
    drafted, accepted = [400, 400], [340, 300]
    wild = paired_ratio([(200, 20.0, 200, 20.0 * r) for r in (1.0, 2.4, 1.1)])
    d = decide_class(policy, drafted, accepted, CostFit(T0, 0.1, "fit", {0: T0}, paired={1: wild, 2: wild}))
    assert d.action == "keep" and not d.enabled and "lower bound" in d.reason
    steady = paired_ratio([(200, 20.0, 200, 20.0 * r) for r in (1.2, 1.21, 1.19)])
    d = decide_class(policy, drafted, accepted, CostFit(T0, 0.1, "fit", {0: T0}, paired={1: steady, 2: steady}))
    assert d.action == "on" and d.n == 2
