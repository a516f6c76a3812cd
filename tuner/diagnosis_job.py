"""Run a draft diagnosis and keep its report; never disturbs serving.

Triggered from the API, the CLI (and, later, the tuner and alerts).  Prompts
are the opt-in sampled prompts of the class when there are any, else the
built-in evaluation set.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

from sqlalchemy import Engine

from spectune.store.diagnostics import fail_report, finish_report, realised_per_position, sampled_prompts, start_report

from .diagnose import DiagnosisInput, run_diagnosis, summary

log = logging.getLogger(__name__)

EVALUATION_SET: list[tuple[str, str]] = [
    ("qa", "Question: What does HTTP status 404 mean?\nAnswer:"),
    ("qa", "Is 17 a prime number? Answer yes or no:"),
    ("qa", "Translate 'good morning' to French:"),
    (
        "long",
        '# Python\ndef merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    """Merge two sorted lists."""\n',
    ),
    (
        "long",
        "Summarise: The scheduler reads the request records every minute, estimates the acceptance rate "
        "of each prompt class and lowers the speculation length when the draft stops paying.\nSummary:",
    ),
    ("long", "Write a short story about a robot who learns to paint. Once upon a time"),
]


def diagnose_and_store(
    db: Engine,
    target: str,
    draft: str,
    trigger: str,
    prompt_class: str | None = None,
    max_prompts: int = 8,
    report_id: int | None = None,
) -> int:
    report_id = report_id if report_id is not None else start_report(db, trigger, prompt_class)
    try:
        prompts = (
            sampled_prompts(db, prompt_class, max_prompts)
            or [p for p in EVALUATION_SET if prompt_class in (None, p[0])][:max_prompts]
            or EVALUATION_SET[:max_prompts]
        )
        report = run_diagnosis(
            DiagnosisInput(
                target=target,
                draft=draft,
                prompts=prompts,
                realised_per_position=realised_per_position(db, timedelta(hours=1)),
            )
        )
        finish_report(db, report_id, report, summary(report))
    except Exception as exc:
        log.exception("diagnosis %d failed", report_id)
        fail_report(db, report_id, f"{type(exc).__name__}: {exc}")
    return report_id


class DiagnosisRunner:
    """One diagnosis at a time, in a background thread.

    ``models`` gives (target, draft) at submit time: the draft in service may
    have changed since start-up.
    """

    def __init__(self, db: Engine, models: Callable[[], tuple[str, str]]) -> None:
        self.db, self.models = db, models
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diagnosis")

    def submit(self, trigger: str, prompt_class: str | None, max_prompts: int = 8) -> tuple[int, Future]:
        target, draft = self.models()
        report_id = start_report(self.db, trigger, prompt_class)
        future = self._pool.submit(
            diagnose_and_store, self.db, target, draft, trigger, prompt_class, max_prompts, report_id
        )
        return report_id, future

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
