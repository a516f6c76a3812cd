"""A step's time is the busy wall time since the previous step (vLLM's timer leaves out the work
between steps), and vLLM's timer after idling."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from spectune.engine.stats import step_record


def _stats(prefill: int, decode: int, elapsed_ms: float):
    details = SimpleNamespace(num_ctx_requests=prefill, num_generation_requests=decode, num_ctx_tokens=50 * prefill,
                              num_generation_tokens=2 * decode, elapsed_ms=elapsed_ms)  # fmt: skip
    return SimpleNamespace(iteration_details=details, spec_decoding_stats=None, num_running_reqs=prefill + decode)


def test_a_decode_step_is_charged_the_wall_time_since_the_step_before():
    # the engine spent 40 ms between steps: the step took 0.30 s by vLLM's timer, 0.34 s of serving
    record = step_record("i", _stats(0, 8, 300.0), now=100.34, last=100.0)
    assert record.step_time_s == pytest.approx(0.34) and record.batch_size == 8


def test_outputs_that_bunch_up_still_sum_to_the_busy_wall_time():
    # two steps' statistics arrive 1 ms apart after 0.6 s: 0.599 + 0.001, not 0.599 + vLLM's 0.3
    first = step_record("i", _stats(0, 8, 300.0), now=100.599, last=100.0)
    second = step_record("i", _stats(0, 8, 300.0), now=100.600, last=100.599)
    assert first.step_time_s + second.step_time_s == pytest.approx(0.6)


def test_a_prompt_only_step_after_idling_takes_vllms_timer():
    record = step_record("i", _stats(3, 0, 120.0), now=200.0, last=100.0)  # idle for 100 s before it
    assert record.step_time_s == pytest.approx(0.12) and record.num_prefill_requests == 3
