"""The decision math: estimators, goodput, and the N choice (pure, property-tested)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spectune.tuner.goodput import choose_n, costs_by_bucket, expected_tokens, position_acceptance, speedup

alpha = st.floats(0.0, 0.99)
cost = st.floats(0.0, 1.0)
n_bounds = st.tuples(st.integers(0, 3), st.integers(3, 8))


def test_expected_tokens_matches_the_closed_form():
    for a in (0.0, 0.3, 0.6, 0.9):
        for n in range(0, 8):
            assert expected_tokens([a] * n, n) == pytest.approx((1 - a ** (n + 1)) / (1 - a))
    assert expected_tokens([1.0] * 5, 5) == 6
    assert expected_tokens([0.9, 0.5], 4) == pytest.approx(1 + 0.9 + 0.45 + 0.225 + 0.1125)  # last alpha reused


def test_position_acceptance_shrinks_small_samples_and_follows_large_ones():
    few = position_acceptance([2, 2], [2, 2])  # 2 of 2 accepted: not "100 %"
    assert few.mean[0] == pytest.approx(4 / 6) and few.low[0] < few.mean[0] < few.high[0] <= 1
    many = position_acceptance([1000, 1000, 1000], [800, 400, 100])
    assert many.mean[0] == pytest.approx(0.8, abs=0.01)
    assert many.mean[1] == pytest.approx(0.5, abs=0.01)  # conditional: 400 of the 800 that reached it
    assert many.mean[2] == pytest.approx(0.25, abs=0.01)
    assert many.samples == (1000, 800, 400)


def test_cost_ratio_fit_and_fallback():
    assert costs_by_bucket({1: {0: 0.10, 2: 0.13, 4: 0.16}}, prior=0.5)[1].cost_ratio == pytest.approx(0.15)
    assert costs_by_bucket({1: {3: 0.2}}, prior=0.5)[1].cost_ratio == 0.5  # one point: prior
    assert costs_by_bucket({1: {1: 0.2, 3: 0.1}}, prior=0.5)[1].cost_ratio == 0.5  # nonsense slope: prior


def test_off_when_speculation_does_not_pay():
    d = choose_n([0.05] * 8, cost=0.4, current=3, n_min=1, n_max=8)
    assert d.n == 0 and d.best_n == 0
    d = choose_n([0.95] * 8, cost=0.05, current=0, n_min=1, n_max=8)
    assert d.n == d.best_n >= 5  # back on in one move


@given(a=alpha, c=cost, bounds=n_bounds, start=st.integers(0, 8))
@settings(max_examples=300, deadline=None)
def test_stationary_inputs_never_oscillate(a, c, bounds, start):
    n_min, n_max = bounds
    seen, current = [], start
    for _ in range(12):
        current = choose_n([a] * 8, c, current, n_min, n_max).n
        seen.append(current)
    settled = seen[-1]
    assert seen[-4:] == [settled] * 4
    # once it leaves a value it never comes back to it
    changes = [x for i, x in enumerate(seen) if i == 0 or x != seen[i - 1]]
    assert len(changes) == len(set(changes))


@given(a1=alpha, a2=alpha, c=cost, bounds=n_bounds)
@settings(max_examples=300, deadline=None)
def test_higher_acceptance_never_lowers_the_chosen_n(a1, a2, c, bounds):
    lo, hi = sorted((a1, a2))
    n_min, n_max = bounds
    assert (
        choose_n([lo] * 8, c, 0, n_min, n_max, min_gain=0).best_n
        <= choose_n([hi] * 8, c, 0, n_min, n_max, min_gain=0).best_n
    )


@given(a=alpha, c1=cost, c2=cost, bounds=n_bounds)
@settings(max_examples=300, deadline=None)
def test_more_expensive_draft_never_raises_it(a, c1, c2, bounds):
    cheap, dear = sorted((c1, c2))
    n_min, n_max = bounds
    assert (
        choose_n([a] * 8, dear, 0, n_min, n_max, min_gain=0).best_n
        <= choose_n([a] * 8, cheap, 0, n_min, n_max, min_gain=0).best_n
    )


@given(c=cost, current=st.integers(0, 8))
def test_no_data_keeps_the_policy_n(c, current):
    assert choose_n(None, c, current, 0, 8).n == current
    assert choose_n([], c, current, 0, 8).n == current


def test_speedup_is_the_leviathan_bound_for_iid_acceptance():
    a, n, c = 0.7, 3, 0.2
    assert speedup([a] * n, n, c) == pytest.approx((1 - a ** (n + 1)) / ((1 - a) * (n * c + 1)))


def _policy(**kw):
    from spectune.tuner.policy import Policy

    return Policy(**{"num_speculative_tokens": 3, "n_min": 1, "n_max": 6, **kw})


def test_decide_class_off_on_and_n():
    from spectune.tuner.decide import decide_class

    # a bad draft: low acceptance and no speedup -> off, and a diagnosis is asked for
    d = decide_class(_policy(), [400, 40, 4], [40, 4, 0], cost=0.3)
    assert (d.action, d.enabled, d.diagnose) == ("off", False, True)
    # an expensive draft at high acceptance -> off too, but it is not the draft's fault
    d = decide_class(_policy(), [400, 360, 324], [360, 324, 291], cost=2.0)
    assert (d.action, d.diagnose) == ("off", False)
    # off class whose probes now look good -> back on
    d = decide_class(_policy(speculation_enabled=False), [100, 95, 90], [95, 90, 86], cost=0.1)
    assert d.action == "on" and d.enabled and d.n >= 3
    # a good draft at N=3 with cheap drafting -> move N up (bounded step)
    d = decide_class(_policy(), [400, 396, 392], [396, 392, 388], cost=0.05)
    assert d.action == "set_n" and d.n == 5
    # no data -> the policy stands
    assert decide_class(_policy(), [3], [3], cost=0.3).action == "keep"


def test_cost_per_bucket_fits_borrows_and_falls_back():

    costs = costs_by_bucket({1: {0: 0.10, 2: 0.12}, 4: {3: 0.30}, 16: {3: 0.9}}, prior=0.5)
    assert (
        costs[1].source == "fit" and costs[1].cost_ratio == pytest.approx(0.1) and costs[1].t0_s == pytest.approx(0.1)
    )
    # one N only: c from the nearest fitted bucket, t0 from its own step time
    assert costs[4].source == "bucket 1" and costs[4].t0_s == pytest.approx(0.30 / 1.3)
    assert costs_by_bucket({2: {3: 0.2}}, prior=0.5)[2].source == "prior"


def test_batch_table_switches_off_where_verification_is_dear():
    from spectune.tuner.decide import decide_batch_table
    from spectune.tuner.goodput import CostFit

    policy = _policy(n_min=0, n_max=8)
    alphas = [0.8] * 8
    costs = {1: CostFit(0.1, 0.05, "fit"), 4: CostFit(0.2, 0.3, "fit"), 8: CostFit(0.3, 1.5, "fit")}
    table = decide_batch_table(policy, alphas, costs, class_n=3)
    as_tuples = [(e.min_batch, e.max_batch, e.num_speculative_tokens) for e in table]
    assert as_tuples[-1] == (5, 4096, 0)  # the dearest, top bucket: off from batch 5 up
    assert any(lo == 1 and n > 3 for lo, _, n in as_tuples)  # cheap at batch 1: more than the class N
    # a prior-only bucket keeps what it had; a cost probe runs N=0 in its bucket only
    costs[4] = CostFit(0.2, 0.3, "prior")
    probed = decide_batch_table(policy, alphas, costs, class_n=3, cost_probes={4})
    assert (3, 4, 0) in [(e.min_batch, e.max_batch, e.num_speculative_tokens) for e in probed]


@settings(max_examples=200, deadline=None)
@given(alpha, st.floats(0.0, 0.5), st.floats(0.0, 2.0))
def test_batch_table_never_gives_a_dearer_bucket_a_larger_n(a, cheap, extra):
    from spectune.engine.schema import n_for_batch
    from spectune.tuner.decide import decide_batch_table
    from spectune.tuner.goodput import CostFit

    policy = _policy(n_min=0, n_max=8, min_gain=0.0)
    costs = {1: CostFit(0.1, cheap, "fit"), 8: CostFit(0.3, cheap + extra, "fit")}
    table = decide_batch_table(policy, [a] * 8, costs, class_n=3)
    assert n_for_batch(table, 8, 3) <= n_for_batch(table, 1, 3)


def test_a_shift_in_acceptance_is_detected_and_noise_is_not():
    from spectune.tuner.goodput import acceptance_shifted

    long = position_acceptance([1000, 900], [900, 800])  # ~0.9
    assert acceptance_shifted(long, position_acceptance([100, 20], [20, 2]), min_trials=30)  # ~0.2 now
    assert not acceptance_shifted(long, position_acceptance([100, 90], [88, 79]), min_trials=30)
    assert not acceptance_shifted(long, position_acceptance([10, 2], [2, 0]), min_trials=30)  # too few


def test_baseline_names_where_the_plain_step_came_from():
    from spectune.tuner.goodput import CostFit, baseline

    measured = baseline(CostFit(0.10, 0.2, "fit", {0: 0.12, 3: 0.2}), 4)
    assert measured["kind"] == "measured_plain_steps" and measured["t0_s"] == 0.12 and measured["batch_bucket"] == 4
    fitted = baseline(CostFit(0.10, 0.2, "bucket 8", {3: 0.2}), 2)
    assert fitted["kind"] == "extrapolated" and fitted["t0_s"] == 0.10 and "bucket 8" in fitted["note"]
    assert baseline(0.15, None)["kind"] == "prior"
