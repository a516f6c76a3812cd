"""The fidelity audit: the comparison (pure), the recorder and API, and the audit on real engines.

Tiny fp32 models: speculation is exact there, so every audited request must come out a match or a
numeric near-tie -- never a defect -- with the draft model and with ngram; the test-only fault
``accept_unverified`` (drafts accepted without verification) must be flagged as a defect within 20
audited requests, and the defect alert must fire on the counter it leaves (promtool).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytest_asyncio
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from spectune.engine import RuntimeSettings
from spectune.engine.faults import ENV as FAULT_ENV
from spectune.engine.fidelity import Trace, auditable, compare
from spectune.engine.schema import FidelityRecord
from spectune.store.metrics import RequestMetrics

from conftest import PROMPTS, VIEWER, complete, running_engine, tiny_config, token_specs

RULES = Path(__file__).parent.parent / "dashboards" / "prometheus" / "rules.yml"


def trace(tokens, margins, gaps=None) -> Trace:
    return Trace(list(tokens), list(gaps or [0.0] * len(tokens)), list(margins))


# -- the comparison -------------------------------------------------------------
def test_equal_runs_match_and_a_confident_divergence_is_a_defect():
    served = trace([5, 6, 7], [3.0, 2.0, 4.0])
    assert compare(served, trace([5, 6, 7], [3.0, 2.0, 4.0])).result == "match"
    verdict = compare(served, trace([5, 9, 7], [3.0, 2.0, 4.0]))
    assert (verdict.result, verdict.diverged_at, verdict.compared_tokens) == ("defect", 1, 2)
    assert verdict.served_margin == verdict.plain_margin == 2.0


def test_a_divergence_at_a_tie_is_numerics_unless_either_run_was_sure():
    tie = compare(trace([5, 6], [3.0, 0.125]), trace([5, 8], [3.0, 0.0]))
    assert tie.result == "near_tie" and tie.diverged_at == 1
    assert compare(trace([5, 6], [3.0, 0.125]), trace([5, 8], [3.0, 0.0]), near_tie_nats=0.1).result == "defect"
    # the served run was sure where the replay saw a tie: not numerics
    assert compare(trace([5, 6], [3.0, 1.5]), trace([5, 8], [3.0, 0.0])).result == "defect"


def test_a_served_token_that_is_not_the_targets_argmax_is_a_defect_even_if_the_replay_agrees():
    verdict = compare(trace([5, 6, 7], [3.0, 2.0, 4.0], gaps=[0, 1.5, 0]), trace([5, 6, 7], [3.0, 2.0, 4.0]))
    assert (verdict.result, verdict.diverged_at, verdict.served_gap) == ("defect", 1, 1.5)
    # a tie is still the argmax (vLLM ranks a tied token 2): numerics, not a defect
    tie = compare(trace([5, 6], [3.0, 0.0]), trace([5, 8], [3.0, 0.0]))
    assert tie.result == "near_tie" and tie.served_gap == 0.0


def test_a_shorter_run_compares_its_common_prefix():
    assert compare(trace([5, 6], [1.0, 1.0]), trace([5, 6, 7], [1.0, 1.0, 1.0])).compared_tokens == 2


def _logprobs(token, top):
    return {t: SimpleNamespace(logprob=lp, rank=r) for r, (t, lp) in enumerate(top, 1)} | (
        {} if token in dict(top) else {token: SimpleNamespace(logprob=-9.0, rank=7)}
    )


def test_a_trace_reads_vllm_outputs_deltas_or_cumulative():
    first = SimpleNamespace(token_ids=[4], logprobs=[_logprobs(4, [(4, -0.1), (2, -2.6)])])
    second = SimpleNamespace(token_ids=[9], logprobs=[_logprobs(9, [(3, -0.5), (8, -1.0)])])
    t = Trace()
    t.observe(first, deltas=True)
    t.observe(second, deltas=True)
    assert t.tokens == [4, 9] and t.gaps == pytest.approx([0.0, 8.5]) and t.margins == pytest.approx([2.5, 0.5])
    both = SimpleNamespace(token_ids=[4, 9], logprobs=first.logprobs + second.logprobs)
    t.observe(both, deltas=False)
    assert t.tokens == [4, 9]
    with pytest.raises(ValueError, match="logprob positions"):
        t.observe(SimpleNamespace(token_ids=[1, 2], logprobs=first.logprobs), deltas=True)


def test_only_greedy_single_choice_requests_are_audited():
    def params(**kw):
        return SimpleNamespace(**{"temperature": 0.0, "top_k": 0, "n": 1, "logprobs": None, **kw})

    assert auditable(params()) and auditable(params(logprobs=5)) and auditable(params(temperature=0.8, top_k=1))
    assert not auditable(params(temperature=0.8))
    assert not auditable(params(n=2))
    assert not auditable(params(logprobs=1))  # the audit's top-2 would change what the client gets


# -- recorder, API, metrics -------------------------------------------------------
def check(request_id: str, result: str, **kw) -> FidelityRecord:
    fields = dict(
        request_id=request_id,
        instance_id="i1",
        prompt_class="code",
        checked_at=time.time(),
        speculation_method="draft_model",
        num_speculative_tokens=3,
        result=result,
        compared_tokens=24,
    )
    return FidelityRecord(**{**fields, **kw})


def test_checks_are_stored_once_and_summarised_by_the_api(db_url, tmp_path):
    from spectune.app import create_app
    from spectune.store.db import make_engine, upgrade
    from spectune.store.recorder import Recorder

    upgrade(db_url)
    db = make_engine(db_url)
    recorder = Recorder(db, tmp_path / "spool")
    checks = [check(f"r{i}", "match") for i in range(5)]
    checks += [check("r5", "near_tie", diverged_at=7, served_margin=0.125, plain_margin=0.0, reason="tie")]
    checks += [check("r6", "defect", diverged_at=2, served_margin=3.1, plain_margin=3.0, served_gap=0.4)]
    for c in [*checks, checks[-1]]:  # a replayed spool item stores once
        recorder.submit_fidelity(c)
    assert recorder.close()
    with TestClient(create_app(None, db, token_specs())) as client:
        body = client.get("/api/v1/fidelity", headers=VIEWER).json()
        (summary,) = body["classes"]
        assert (summary["audited"], summary["match"], summary["near_tie"], summary["defect"]) == (7, 5, 1, 1)
        assert summary["divergence_rate"] == pytest.approx(2 / 7) and summary["max_near_tie_margin"] == 0.0
        assert [d["request_id"] for d in body["divergences"]] == ["r6", "r5"]
        only = client.get("/api/v1/fidelity", params={"result": "defect"}, headers=VIEWER).json()
        assert [d["request_id"] for d in only["divergences"]] == ["r6"]
        assert client.get("/api/v1/fidelity", params={"class": "nope"}, headers=VIEWER).status_code == 404
        assert client.get("/api/v1/fidelity").status_code == 401
    db.dispose()


def _promtool_fires(before: float, after: float, tmp_path: Path) -> bool:
    """Whether SpectuneFidelityDefect fires when the defect counter goes from ``before`` to ``after``."""
    test = tmp_path / "fidelity_test.yml"
    test.write_text(
        f"""rule_files: [{RULES}]
evaluation_interval: 30s
tests:
  - interval: 1m
    input_series:
      - series: 'spectune_fidelity_checks_total{{instance="a",class="qa",result="defect"}}'
        values: '{before:g}x5 {after:g}x5'
    promql_expr_test:
      - expr: count(ALERTS{{alertname="SpectuneFidelityDefect", alertstate="firing", class="qa"}})
        eval_time: 7m
        exp_samples: [{{labels: '{{}}', value: 1}}]
"""
    )
    run = subprocess.run(["promtool", "test", "rules", str(test)], capture_output=True, text=True)
    return run.returncode == 0


def _defects(registry: CollectorRegistry, cls: str) -> float:
    value = registry.get_sample_value("spectune_fidelity_checks_total", {"class": cls, "result": "defect"})
    assert value is not None, "the defect counter is not exported"
    return value


# -- real engines ---------------------------------------------------------------
AUDIT_ALL = RuntimeSettings(version=1, num_speculative_tokens=3, audit_fraction=1.0)


async def audit(eng, sink, count: int, max_tokens: int = 24, concurrency: int = 8) -> list[FidelityRecord]:
    """Serve ``count`` greedy requests (every one audited) and wait for their verdicts."""
    start = len(sink.fidelity)
    eng.auditor.max_replays = count  # every request audited: none skipped
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(count)]
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: str) -> None:
        async with gate:
            await complete(eng, prompt, max_tokens, temperature=0.0, ignore_eos=True)

    await asyncio.gather(*[one(p) for p in prompts])
    deadline = time.monotonic() + 120
    while len(sink.fidelity) - start + eng.auditor.failed < count and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return list(sink.fidelity)[start:]


@pytest.mark.parametrize("method, draft", [("draft_model", "noised"), ("ngram", "copy")])
async def test_no_defect_over_200_audited_requests(tiny, method, draft):
    async with running_engine(tiny_config(tiny, method=method, draft=draft, n=3)) as (eng, sink):
        await eng.apply(AUDIT_ALL)
        checks = await audit(eng, sink, 200)
        assert eng.auditor.failed == 0 and eng.auditor.skipped == 0
        assert len(checks) == 200
        results = [c.result for c in checks]
        assert results.count("defect") == 0, [c.reason for c in checks if c.result == "defect"][:3]
        assert all(c.compared_tokens == 24 or c.result == "near_tie" for c in checks)
        assert sum(r.num_draft_tokens for r in list(sink.records)[-200:]) > 0, "nothing was speculated"
        # the replays left no record of their own: one record per served request
        assert not any(r.request_id.endswith("-audit") for r in sink.records)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def faulty(tiny):
    os.environ[FAULT_ENV] = "accept_unverified"
    try:
        async with running_engine(tiny_config(tiny, draft="indep", n=3)) as pair:
            yield pair
    finally:
        del os.environ[FAULT_ENV]


async def test_accepting_unverified_drafts_is_flagged_and_the_alert_fires(faulty, tmp_path):
    eng, sink = faulty
    registry = CollectorRegistry()
    metrics = RequestMetrics(registry)
    classes = sorted(eng.classifier.classes)
    metrics.settings_applied(AUDIT_ALL, classes, 3)
    eng.sinks.append(metrics)
    before = {c: _defects(registry, c) for c in classes}  # exported at 0 before any check
    await eng.apply(AUDIT_ALL)
    checks = await audit(eng, sink, 20, concurrency=4)
    defects = [c for c in checks if c.result == "defect"]
    assert defects, f"20 audited requests with unverified drafts, results {[c.result for c in checks]}"
    (cls,) = {c.prompt_class for c in checks}
    before = before[cls]
    # an accepted draft the target did not choose: below its argmax in the served run itself
    assert any(c.served_gap is not None and c.served_gap > 0 for c in defects)
    after = _defects(registry, cls)
    assert after - before == len(defects)
    assert _promtool_fires(before, after, tmp_path)
    assert not _promtool_fires(after, after, tmp_path)  # no new defect: quiet
