"""A class's TTFT budget: when its speculation breaks it, and the guard that acts on it (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spectune.store.aggregates import ArmLatency
from spectune.tuner.decide import MIN_LATENCY_REQUESTS, ttft_guard, ttft_over_budget
from spectune.tuner.policy import Policy

ENOUGH = MIN_LATENCY_REQUESTS


def _arm(p95: float | None, requests: int = ENOUGH) -> ArmLatency:
    return ArmLatency(requests, {"p50": None if p95 is None else p95 / 2, "p95": p95}, {"p50": 0.05, "p95": 0.1})


def test_speculation_breaks_the_budget_where_its_p95_is_over_and_plain_is_faster():
    assert ttft_over_budget(1.0, {True: _arm(1.4), False: _arm(0.9)}) is not None
    assert ttft_over_budget(1.0, {True: _arm(1.4)}) is not None  # no plain beside it: speculation is suspect
    assert ttft_over_budget(1.0, {True: _arm(1.4), False: _arm(0.9, ENOUGH - 1)}) is not None  # too few to clear it
    assert "p95 1.40 s" in ttft_over_budget(1.0, {True: _arm(1.4), False: _arm(0.9)})


@pytest.mark.parametrize(
    "arms",
    [
        {True: _arm(0.9), False: _arm(0.5)},  # within the budget
        {True: _arm(1.4), False: _arm(1.6)},  # plain is slower still: the load breaks it, not speculation
        {True: _arm(1.4, ENOUGH - 1)},  # too few speculating requests to say
        {True: _arm(None)},  # no first token measured
        {False: _arm(3.0)},  # plain only
        {},
    ],
)
def test_no_verdict_without_evidence_against_speculation(arms):
    assert ttft_over_budget(1.0, arms) is None
    assert ttft_over_budget(None, {True: _arm(9.0)}) is None  # no budget


@given(budget=st.floats(0.01, 10), spec=st.floats(0.01, 10), plain=st.none() | st.floats(0.01, 10))
def test_a_verdict_needs_speculation_over_the_budget_and_slower_than_plain(budget, spec, plain):
    arms = {True: _arm(spec)} | ({} if plain is None else {False: _arm(plain)})
    over = ttft_over_budget(budget, arms) is not None
    assert over == (spec > budget and (plain is None or plain < spec))
    if over:  # a tighter budget is broken too
        assert ttft_over_budget(budget / 2, arms) is not None


def test_the_ttft_guard_switches_a_speculating_class_off_and_leaves_an_off_one_alone():
    on, off = Policy(), Policy(speculation_enabled=False)
    decision, table = ttft_guard(on, "TTFT budget: ...", acceptance=0.8)
    assert decision.action == "off" and not decision.enabled and decision.predicted_speedup == 1.0
    assert table == on.batch_table and not decision.diagnose  # the draft is not at fault: no diagnosis
    assert ttft_guard(off, "TTFT budget: ...", 0.8) is None
    assert ttft_guard(on, None, 0.8) is None
