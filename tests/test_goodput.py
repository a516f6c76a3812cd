"""The decision math: estimators, goodput, and the N choice (pure, property-tested)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spectune.tuner.cost import costs_by_bucket
from spectune.tuner.goodput import choose_n, expected_tokens, position_acceptance, speedup

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


def test_the_busiest_bucket_is_where_most_sequences_were_served():
    from spectune.tuner.goodput import busiest_bucket

    # 100 steps at batch 1 against 60 at batch 8 (480 sequence-steps): the load is at 8
    assert busiest_bucket({1: {0: 40, 2: 60}, 8: {0: 60}}) == 8
    assert busiest_bucket({1: {2: 500}, 8: {0: 60}}) == 1
    assert busiest_bucket({}) is None


def test_break_even_speculation_goes_off_and_needs_the_full_gain_to_come_back():
    # N=1 predicted 1.5 / 1.48 = 1.014x: within the model's error of plain, and off is free.
    d = choose_n([0.5] * 8, cost=0.48, current=1, n_min=1, n_max=8)
    assert d.n == 0 and "off" in d.reason
    assert choose_n([0.5] * 8, cost=0.48, current=0, n_min=1, n_max=8).n == 0
    # 1.5 / 1.4 = 1.07x: stays on, and switches on from off (>= 5 %)
    assert choose_n([0.5] * 8, cost=0.4, current=1, n_min=1, n_max=8).n == 1
    assert choose_n([0.5] * 8, cost=0.4, current=0, n_min=1, n_max=8).n == 1


def test_the_busiest_bucket_goes_plain_where_the_class_n_only_breaks_even():
    from spectune.engine.schema import BatchRange, n_for_batch
    from spectune.tuner.cost import CostFit
    from spectune.tuner.decide import decide_batch_table

    on_at_8 = [BatchRange(min_batch=5, max_batch=8, num_speculative_tokens=1)]
    policy = _policy(n_min=0, n_max=8).model_copy(update={"batch_table": on_at_8})
    costs = {1: CostFit(0.1, 0.1, "fit", {0: 0.1}), 8: CostFit(0.3, 0.48, "fit", {0: 0.3, 1: 0.444})}
    table = decide_batch_table(policy, [0.5] * 8, costs, class_n=1, class_bucket=8)
    assert n_for_batch(table, 8, 1) == 0 and n_for_batch(table, 1, 1) > 0
    costs[8] = CostFit(0.3, 0.4, "fit", {0: 0.3, 1: 0.42})  # 1.07x: stays on
    assert n_for_batch(decide_batch_table(policy, [0.5] * 8, costs, class_n=1, class_bucket=8), 8, 1) == 1


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
    from spectune.tuner.cost import CostFit
    from spectune.tuner.decide import decide_batch_table

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


def test_a_borrowed_cost_grows_with_what_one_more_sequence_costs_a_plain_step():
    # Step times like the demo pair's on this CPU: a plain step at batch 8 costs 1.6x batch 1's, so
    # verifying a drafted token per sequence is much dearer there than at batch 1.
    times = {1: {0: 0.090, 1: 0.130, 2: 0.160, 3: 0.190}, 8: {0: 0.141}}
    costs = costs_by_bucket(times, prior=0.3)
    assert costs[8].source == "bucket 1 + plain-step slope"
    slope = (0.141 - 0.090) / 7
    drafter = costs[1].cost_ratio - slope / 0.090
    assert costs[8].cost_ratio == pytest.approx(drafter + slope * 8 / 0.141)
    assert costs[8].cost_ratio > costs[1].cost_ratio
    assert speedup([0.8] * 3, 1, costs[8]) < 1.1 < speedup([0.8] * 3, 1, costs[1])
    # Without plain steps at both buckets nothing is scaled: c is the nearest fitted bucket's.
    unscaled = costs_by_bucket({1: times[1], 8: {3: 0.5}}, prior=0.3)
    assert unscaled[8].source == "bucket 1" and unscaled[8].cost_ratio == costs[1].cost_ratio


@settings(max_examples=200, deadline=None)
@given(st.floats(0.01, 0.2), st.floats(0.0, 0.05), st.floats(0.0, 1.0), st.sampled_from([2, 4, 8, 16]))
def test_a_larger_bucket_never_borrows_a_cheaper_cost(t0, slope, c_ref, bucket):
    from spectune.tuner.cost import scaled_cost_ratio

    c = scaled_cost_ratio(c_ref, 1, t0, bucket, t0 + slope * (bucket - 1), slope)
    assert c >= c_ref - 1e-12


def test_batches_never_measured_run_plain_and_a_borrowed_model_needs_a_margin_to_go_on():
    from spectune.engine.schema import n_for_batch
    from spectune.tuner.cost import CostFit
    from spectune.tuner.decide import decide_batch_table

    policy = _policy(n_min=0, n_max=8)
    table = decide_batch_table(policy, [0.8] * 8, {1: CostFit(0.1, 0.1, "fit", {0: 0.1})}, class_n=3, class_bucket=1)
    assert [(e.min_batch, e.max_batch, e.num_speculative_tokens) for e in table] == [(2, 4096, 0)]
    # Batch 8 now measured plain, its cost borrowed: a predicted 1.07x is not enough to go back on ...
    alphas = [0.8] * 8
    barely = CostFit(0.14, 0.68, "bucket 1 + plain-step slope", {0: 0.14})
    assert 1.05 < speedup(alphas, 1, barely) < 1.1
    policy = _policy(n_min=0, n_max=8, batch_table=table)
    kept = decide_batch_table(policy, alphas, {1: CostFit(0.1, 0.1, "fit"), 8: barely}, class_n=3, class_bucket=1)
    assert n_for_batch(kept, 8, 3) == 0
    # ... a measured (fitted) cost with the same prediction is, and so is a borrowed 1.5x.
    fitted = CostFit(0.14, 0.68, "fit", {0: 0.14})
    on = decide_batch_table(policy, alphas, {1: CostFit(0.1, 0.1, "fit"), 8: fitted}, class_n=3, class_bucket=1)
    assert n_for_batch(on, 8, 3) > 0
    cheap = CostFit(0.14, 0.1, "bucket 1 + plain-step slope", {0: 0.14})
    on = decide_batch_table(policy, alphas, {1: CostFit(0.1, 0.1, "fit"), 8: cheap}, class_n=3, class_bucket=1)
    assert n_for_batch(on, 8, 3) > 0


def test_the_busiest_bucket_runs_plain_where_the_class_n_does_not_pay_there():
    from spectune.engine.schema import n_for_batch
    from spectune.tuner.cost import CostFit
    from spectune.tuner.decide import decide_batch_table

    costs = {1: CostFit(0.1, 0.1, "fit", {0: 0.1}), 8: CostFit(0.14, 1.5, "fit", {0: 0.14, 3: 0.77})}
    table = decide_batch_table(_policy(n_min=0, n_max=8), [0.7] * 8, costs, class_n=3, class_bucket=8)
    assert n_for_batch(table, 8, 3) == 0 and n_for_batch(table, 1, 3) > 0


@settings(max_examples=200, deadline=None)
@given(alpha, st.floats(0.0, 0.5), st.floats(0.0, 2.0))
def test_batch_table_never_gives_a_dearer_bucket_a_larger_n(a, cheap, extra):
    from spectune.engine.schema import n_for_batch
    from spectune.tuner.cost import CostFit
    from spectune.tuner.decide import decide_batch_table

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
    from spectune.tuner.cost import CostFit, baseline

    measured = baseline(CostFit(0.10, 0.2, "fit", {0: 0.12, 3: 0.2}), 4)
    assert measured["kind"] == "measured_plain_steps" and measured["t0_s"] == 0.12 and measured["batch_bucket"] == 4
    fitted = baseline(CostFit(0.10, 0.2, "bucket 8", {3: 0.2}), 2)
    assert fitted["kind"] == "extrapolated" and fitted["t0_s"] == 0.10 and "bucket 8" in fitted["note"]
    assert baseline(0.15, None)["kind"] == "prior"


def test_prompts_dilute_the_gain_and_the_drafters_prefill_can_turn_it_into_a_loss():
    from spectune.tuner.cost import CostFit, PrefillCost
    from spectune.tuner.goodput import wall_speedup

    # Like the demo pair at batch 8 here: N=1 gains 1.11x over decode steps alone, but prompts take
    # ~40 % of plain serving's time and the drafter adds ~30 % to every prefill.
    t0, t1, e = 0.36, 0.36 * 1.35, 1.5
    assert wall_speedup(e, t0, t1) == pytest.approx(e * t0 / t1)
    prefill = PrefillCost(batch=8, off=0.03, on=0.039)  # s per generated token; plain: 0.045 s decode
    wall = wall_speedup(e, t0, t1, prefill)
    assert wall < 1.0 < wall_speedup(e, t0, t1)
    # by hand: time per token plain vs speculating
    assert wall == pytest.approx((t0 / 8 + 0.03) / (t1 / (8 * e) + 0.039))
    # the same prefill cost on and off only dilutes: between 1 and the decode-step gain
    same = PrefillCost(batch=8, off=0.03, on=0.03)
    assert 1.0 < wall_speedup(e, t0, t1, same) < wall_speedup(e, t0, t1)
    # a side not measured takes the other's; neither measured: no charge
    assert PrefillCost(8, off=0.03).per_token(True) == 0.03 and PrefillCost(8).per_token(False) == 0.0
    cost = CostFit(t0, (t1 / t0 - 1), "fit", {0: t0, 1: t1}, prefill)
    alphas = [e - 1] * 4
    assert speedup(alphas, 1, cost) == pytest.approx(wall) and speedup(alphas, 0, cost) == 1.0


@settings(max_examples=300, deadline=None)
@given(
    st.floats(1.0, 4.0), st.floats(0.01, 1.0), st.floats(1.0, 3.0), st.floats(1, 64),
    st.floats(0.0, 0.1), st.floats(0.0, 0.1),
)  # fmt: skip
def test_wall_speedup_lies_between_the_prompt_only_and_the_decode_only_ratio(e, t0, ratio, batch, off, on):
    from spectune.tuner.cost import PrefillCost
    from spectune.tuner.goodput import wall_speedup

    wall = wall_speedup(e, t0, t0 * ratio, PrefillCost(batch, off, on))
    decode_only = e / ratio
    prompts_only = off / on if on > 0 else (1.0 if off == 0 else float("inf"))
    assert min(decode_only, prompts_only) - 1e-9 <= wall <= max(decode_only, prompts_only) + 1e-9


def test_demoted_requests_dilute_what_a_step_at_n_yields():
    from spectune.tuner.cost import CostFit
    from spectune.tuner.goodput import expected_tokens, measured_speedups, speedup

    alphas = [0.8, 0.7, 0.6]
    every = CostFit(0.10, 0.2, "fit", {0: 0.10, 1: 0.12, 3: 0.16})
    few = CostFit(0.10, 0.2, "fit", {0: 0.10, 1: 0.12, 3: 0.16}, drafting_share={1: 0.25})
    assert speedup(alphas, 1, every) == pytest.approx(expected_tokens(alphas, 1) * 0.10 / 0.12)
    assert speedup(alphas, 1, few) == pytest.approx((1 + 0.25 * 0.8) * 0.10 / 0.12)  # 1.0x, not 1.5x
    # N=3 takes N=1's share (the nearest measured): a longer draft for the same few requests costs more
    assert speedup(alphas, 3, few) == pytest.approx((1 + 0.25 * (expected_tokens(alphas, 3) - 1)) * 0.10 / 0.16)
    assert speedup(alphas, 3, few) < speedup(alphas, 1, few) < 1.01
    # Realised from measured tokens/s: plain 8 tokens a step in 0.1 s, N=1 9.6 tokens in 0.12 s
    served = {8: {0: (800, 10.0, 100), 1: (960, 12.0, 100), 2: (100, 1.0, 5)}}
    assert measured_speedups(served, served) == {8: {1: pytest.approx(1.0)}}  # N=2: too few steps


def test_an_unmeasured_n_is_explored_only_where_the_model_says_it_beats_plain():
    from spectune.tuner.cost import CostFit

    def at_n1(cost_ratio: float):
        fit = CostFit(1.0, cost_ratio, "fit", measured={0: 1.0, 1: 1.35})
        return choose_n([0.6] * 4, fit, current=1, n_min=1, n_max=2, explore_margin=1.0)

    cheap = at_n1(0.4)  # N=2: 1.96 tokens for 1.8x the step: 1.09x, worth one interval's look
    assert cheap.explore and cheap.n == 2 and cheap.predicted_speedup > 1
    dear = at_n1(0.7)  # N=2: 0.82x; trying it would switch its batches to plain for an interval
    assert not dear.explore and dear.n == 1


def test_the_window_forgets_an_explored_n_and_the_history_remembers_it():
    from spectune.tuner.cost import CostFit
    from spectune.tuner.goodput import MIN_TRIALS, remembered

    window = position_acceptance([200], [120])  # N=1 in force: position 1 only
    history = position_acceptance([400, 200], [240, 100])  # an hour that explored N=2 (alpha_2 = 0.5)
    merged = remembered(window, history)
    assert merged.mean[0] == window.mean[0] and merged.samples[0] == 200  # the window wins where it measured
    assert merged.mean[1] == history.mean[1] and merged.samples[1] == 200 >= MIN_TRIALS
    fit = CostFit(0.10, 0.35, "fit", measured={0: 0.10, 1: 0.13, 2: 0.17})

    def at_n1(est):
        return choose_n(list(est.mean), fit, current=1, n_min=1, n_max=2, explore_margin=0.1,
                        position_samples=est.samples)  # fmt: skip

    forgot = at_n1(window)  # N=2 extrapolated from alpha_1 = 0.6: 1.15x, within the margin of 1.23x
    assert forgot.explore and forgot.n == 2
    remembers = at_n1(merged)  # N=2 from its measured alpha_2 = 0.5: 1.12x, measured: nothing to explore
    assert not remembers.explore and remembers.n == 1
    assert speedup(list(merged.mean), 2, fit) < speedup(list(window.mean), 2, fit)


def test_positions_neither_side_measured_end_the_memory():
    from spectune.tuner.goodput import remembered

    window = position_acceptance([200, 10], [120, 5])  # position 2: 10 trials, too few to trust
    history = position_acceptance([400, 50, 5], [240, 20, 2])  # position 3: 5 trials
    merged = remembered(window, history)
    assert merged.samples == (200, 50)  # position 2 from the history, position 3 from neither
    assert remembered(window, position_acceptance([], [])) == window  # nothing remembered: the window as it is
    shifted = position_acceptance([400, 50], [380, 40])  # position 1 at 0.95 against the window's 0.6
    assert remembered(window, shifted) == window  # another regime: its second position is not this one's
    thin = position_acceptance([20], [12])  # too few trials at the first position to compare regimes
    assert remembered(thin, history) == thin


counts = st.lists(st.tuples(st.integers(0, 400), st.floats(0, 1)), max_size=6)


def _acceptance_from(pairs):
    drafted = [d for d, _ in pairs]
    return position_acceptance(drafted, [round(d * f) for d, f in pairs])


@given(counts, counts)
@settings(max_examples=200, deadline=None)
def test_remembered_takes_each_position_from_the_side_that_measured_it(w, h):
    from spectune.tuner.goodput import MIN_TRIALS, remembered

    window, history = _acceptance_from(w), _acceptance_from(h)
    merged = remembered(window, history)
    both = [k for k in range(min(len(window.samples), len(history.samples)))
            if min(window.samples[k], history.samples[k]) >= MIN_TRIALS]  # fmt: skip
    agree = all(window.low[k] <= history.high[k] and history.low[k] <= window.high[k] for k in both)
    if not window.samples or window.samples[0] < MIN_TRIALS or not agree:
        assert merged == window  # too little of the present, or another regime: nothing remembered
        return
    assert len(window.mean) <= len(merged.mean) <= max(len(window.mean), len(history.mean))
    for k, (mean, trials) in enumerate(zip(merged.mean, merged.samples)):
        if k < len(window.samples) and window.samples[k] >= MIN_TRIALS:
            assert (mean, trials) == (window.mean[k], window.samples[k])
        elif k < len(history.samples) and history.samples[k] >= MIN_TRIALS:
            assert (mean, trials) == (history.mean[k], history.samples[k])
        else:
            assert k < len(window.samples) and (mean, trials) == (window.mean[k], window.samples[k])
    assert remembered(window, window) == window


def test_an_explored_n_is_held_until_its_step_and_last_position_are_measured():
    from spectune.tuner.cost import CostFit
    from spectune.tuner.decide import exploring

    unmeasured_step = CostFit(0.10, 0.35, "fit", measured={0: 0.10, 1: 0.13})
    measured_step = CostFit(0.10, 0.35, "fit", measured={0: 0.10, 1: 0.13, 2: 0.17})
    held = exploring(2, unmeasured_step, (200, 40), held_s=20, hold_s=300)
    assert held is not None and "step time not measured yet" in held
    held = exploring(2, measured_step, (200, 12), held_s=20, hold_s=300)
    assert held is not None and "position 2 has 12 of 30 trials" in held
    assert exploring(2, measured_step, (200,), held_s=20, hold_s=300) is not None  # position 2 never reached
    assert exploring(2, measured_step, (200, 30), held_s=20, hold_s=300) is None  # measured: decide on it
    assert exploring(2, unmeasured_step, (200, 12), held_s=300, hold_s=300) is None  # held the most it may be
    assert exploring(2, 0.3, (200, 12), held_s=20, hold_s=300) is None  # a prior cost: nothing to measure


@given(st.integers(1, 6), st.lists(st.integers(0, 100), max_size=7), st.booleans(), st.floats(0, 600))
@settings(max_examples=200, deadline=None)
def test_an_exploration_is_held_exactly_while_choose_n_would_call_it_unmeasured(n, trials, step_measured, held_s):
    """The hold and the exploration share one test of "measured" (``goodput.unmeasured``): an N the
    tuner explores is held until it stops being a reason to explore, and never past its budget."""
    from spectune.tuner.cost import CostFit
    from spectune.tuner.decide import exploring
    from spectune.tuner.goodput import MIN_TRIALS

    fit = CostFit(0.10, 0.3, "fit", measured={0: 0.10, **({n: 0.13} if step_measured else {})})
    measured = step_measured and n <= len(trials) and trials[n - 1] >= MIN_TRIALS
    assert (exploring(n, fit, trials, held_s, hold_s=300) is not None) == (not measured and held_s < 300)


def test_an_exploration_costs_what_it_lost_against_the_n_it_replaced():
    from spectune.tuner.goodput import exploration_loss

    alphas = [0.8, 0.6, 0.4]
    s1, s2 = speedup(alphas, 1, 0.5), speedup(alphas, 2, 0.5)
    assert s2 < s1  # at this cost N=2 loses to N=1
    assert exploration_loss(alphas, 2, 1, 0.5) == pytest.approx(1 - s2 / s1)
    assert exploration_loss(alphas, 1, 2, 0.5) == 0.0  # a gain costs nothing
    assert exploration_loss(alphas, 0, 1, 0.5) == pytest.approx(1 - 1 / s1)  # plain at a bucket: what N=1 gained


def test_the_explore_budget_repays_an_exploration_before_the_next():
    from spectune.tuner.decide import exploration_unpaid

    assert exploration_unpaid(0.02, None, 0, 0, spacing_s=30) is None  # the first exploration
    assert exploration_unpaid(0.0, None, 0, 0) == "explore_budget is 0"  # never
    # Lost 5 % for 60 s at a 2 % budget: repaid 150 s after it began, and not one second before.
    why = exploration_unpaid(0.02, 0.05, held_s=60, since_s=100)
    assert why is not None and why.startswith("the next exploration waits 50 s")
    assert exploration_unpaid(0.02, 0.05, held_s=60, since_s=150) is None
    assert exploration_unpaid(0.02, 0.0, held_s=60, since_s=30) is None  # cost nothing: repaid at once
    spaced = exploration_unpaid(0.02, 0.0, held_s=10, since_s=20, spacing_s=30)
    assert spaced == "the last exploration began 20 s ago (at most one per 30 s)"


@settings(max_examples=300, deadline=None)
@given(
    st.floats(0.005, 0.5),
    st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(1.0, 300.0), st.floats(1.0, 120.0)), min_size=1, max_size=40),
)
def test_explorations_started_whenever_allowed_cost_at_most_the_budget_plus_the_last_one(budget, explorations):
    """Whatever each exploration loses and however long it is held, a tuner that explores as soon as
    ``exploration_unpaid`` allows spends at most ``budget`` of the elapsed time, plus the one
    exploration not yet repaid."""
    from spectune.tuner.decide import exploration_unpaid

    t, spent, last = 0.0, 0.0, None  # last: (began, loss, held)
    for loss, held, gap in explorations:
        while last is not None and exploration_unpaid(budget, last[1], last[2], t - last[0]) is not None:
            t += gap  # decide again an interval later
        spent += loss * held
        last, t = (t, loss, held), t + held
    assert spent <= budget * t + last[1] * last[2] + 1e-6
