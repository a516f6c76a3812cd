"""A database with something on every dashboard page: records of two classes,
engine steps at two batch buckets, tuner decisions (one with a paired realised
speedup), a finished and a running diagnosis, and a firing and a resolved
alert linked to the diagnosis."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import insert

from spectune.store.db import insert_ignoring_duplicates, insert_records, make_engine, upgrade, utc
from spectune.store.instances import heartbeat
from spectune.store.models import AlertEvent, DiagnosticsReport, FidelityCheck, StepStat, TunerDecision

from records import make_records

REPORT = {
    "target": "tiny-target",
    "draft": "tiny-indep",
    "prompts": 4,
    "classes": {
        "qa": {
            "tokens": 64,
            "expected_acceptance": 0.21,
            "greedy_agreement": 0.0,
            "kl": 2.9,
            "per_position_expected": [0.3, 0.2, 0.15],
            "per_position_realised": [0.05, 0.02, 0.0],
        }
    },
    "top_disagreements": [
        {"class": "qa", "context": "the draft", "target_token": " x", "draft_token": " y",
         "p_target_token": 0.9, "q_target_token": 0.01, "expected_acceptance": 0.02}
    ],
    "attention_entropy": {"target": [1.1, 1.4], "draft": [0.6, 0.9]},
    "latency": {"target_s_per_token": 0.01, "draft_s_per_token": 0.004, "ratio": 0.4, "rule": 0.6},
    "findings": ["draft disagrees with the target on qa: expected acceptance 21 %; fine-tune the draft on this class."],
}  # fmt: skip


def _latency(ttft_p95: float, plain_p95: float | None) -> dict:
    """A ``realised_latency`` (``tuner/outcomes.latency``): the setting's TTFT p95, plain's beside it
    (None: no plain request ran beside it), TPOT 0.05 s against plain's 0.08 s."""
    arm = lambda p95, k: {"requests": k, "ttft_s": {"p50": p95 / 2, "p95": p95}, "tpot_s": {"p50": 0.05, "p95": 0.06}}  # noqa: E731
    plain = None if plain_p95 is None else {**arm(plain_p95, 12), "tpot_s": {"p50": 0.08, "p95": 0.09}}
    vs = {} if plain is None else {"ttft_p50": ttft_p95 / plain_p95, "ttft_p95": ttft_p95 / plain_p95,
                                   "tpot_p50": 0.05 / 0.08, "tpot_p95": 0.06 / 0.09}  # fmt: skip
    return {"bucket": 1, "n": 5, "setting": arm(ttft_p95, 40), "plain": plain, "vs_plain": vs}


def seed(url: str) -> None:
    upgrade(url)
    db = make_engine(url)
    insert_records(db, make_records(120, prefix="dash", seed=3))
    now = datetime.now(UTC)
    minute = (now - timedelta(minutes=1)).timestamp()
    rows = [
        dict(instance_id="i-1", minute=utc(minute // 60 * 60), batch_bucket=b, num_speculative_tokens=n, writer="w",
             steps=100, step_time_sum_s=100 * t, step_time_p50_s=t, step_time_p95_s=t, batch_size_sum=100 * b,
             scheduled_tokens=100 * b * (n + 1), num_draft_tokens=100 * b * n, num_accepted_tokens=int(100 * b * n * a),
             accepted_per_position=[])
        for b, n, t, a in ((1, 3, 0.02, 0.8), (1, 0, 0.015, 0.0), (4, 3, 0.05, 0.75))
    ]  # fmt: skip
    insert_ignoring_duplicates(db, StepStat.__table__, rows)
    with db.begin() as conn:
        decisions = [
            dict(at=now - timedelta(minutes=10), instance_id="*", prompt_class="qa", batch_bucket=1, mode="auto",
                 action="set_n", n_before=3, n_after=5, predicted_speedup=1.42, realised_speedup=1.37, applied=True,
                 realised_estimator="paired", realised_low=1.30, realised_high=1.44, realised_minutes=4,
                 realised_latency=_latency(2.08, 1.60), inputs={"reason": "goodput argmax N=6 (1.48x vs 1.30x)"}),
            dict(at=now - timedelta(minutes=8), instance_id="*", prompt_class="qa", batch_bucket=1, mode="auto",
                 action="keep", n_before=5, n_after=5, predicted_speedup=1.40, realised_speedup=2.15, applied=False,
                 realised_estimator="unpaired", realised_latency=_latency(2.2, None), inputs={"reason": "N=5 stays"}),
            dict(at=now - timedelta(minutes=5), instance_id="*", prompt_class="long", batch_bucket=1, mode="auto",
                 action="off", n_before=3, n_after=0, predicted_speedup=0.83, realised_speedup=None, applied=True,
                 inputs={"reason": "acceptance 12% < floor 70% and predicted speedup 0.83x < 1: speculation off"}),
        ]  # fmt: skip
        unmeasured = dict(realised_estimator=None, realised_low=None, realised_high=None, realised_minutes=None,
                          realised_latency=None)  # fmt: skip
        conn.execute(insert(TunerDecision), [{**unmeasured, **d} for d in decisions])
        done = conn.execute(
            insert(DiagnosticsReport).values(
                created_at=now - timedelta(minutes=4), finished_at=now - timedelta(minutes=3), trigger="alert",
                prompt_class="qa", status="done", summary="qa: expected acceptance 21 %.", report=REPORT,
            )
        ).inserted_primary_key[0]  # fmt: skip
        conn.execute(
            insert(DiagnosticsReport).values(created_at=now, trigger="api", prompt_class="long", status="running")
        )
        starts = now - timedelta(minutes=6)
        for status, received in (("firing", now - timedelta(minutes=4)), ("resolved", now - timedelta(minutes=1))):
            conn.execute(
                insert(AlertEvent).values(
                    fingerprint="f00d", status=status, alertname="SpecAcceptanceLow", starts_at=starts,
                    received_at=received, diagnosis_id=done,
                    labels={"alertname": "SpecAcceptanceLow", "class": "qa",
                            "annotation:summary": "Draft acceptance 12% < 70% for 5m"},
                )
            )  # fmt: skip
        conn.execute(
            insert(AlertEvent).values(
                fingerprint="beef", status="firing", alertname="SpecPredictedSpeedupBelowOne", starts_at=now,
                received_at=now, diagnosis_id=None,
                labels={"alertname": "SpecPredictedSpeedupBelowOne", "class": "long"},
            )
        )  # fmt: skip
        checks = [
            dict(request_id=f"audit-{i}", instance_id="engine-a", prompt_class="qa",
                 checked_at=now - timedelta(minutes=i), speculation_method="draft_model", num_speculative_tokens=3,
                 result=result, compared_tokens=48,
                 diverged_at=None if result == "match" else 17, served_margin=margin, plain_margin=margin,
                 served_gap=0.0, reason=f"seeded {result}")
            for i, (result, margin) in enumerate((("match", None),) * 3 + (("near_tie", 0.125), ("defect", 2.5)))
        ]  # fmt: skip
        conn.execute(insert(FidelityCheck), checks)
    for name, version in (("engine-a", 1), ("engine-b", 1)):  # two engines reporting the policy they hold
        heartbeat(db, name, "target", "draft_model", 6, now - timedelta(minutes=30), None, version, "draft")
    db.dispose()
