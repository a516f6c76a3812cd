"""Run a draft diagnosis and keep its report; never disturbs serving.

Triggered from the API, the CLI, the tuner and alerts.  Prompts are the opt-in
sampled prompts of the class when there are any, else the built-in evaluation
set.  ``DiagnosisRunner`` runs each diagnosis in a worker process of its own
(spawned, ``nice`` 19, one torch thread), so two fp32 models run teacher-forced
never share a serving process's interpreter and yield the CPU to it.  That alone
is not enough: they still share cores and memory bandwidth (beside a demo-pair
engine on 2 cores the engine ran at 0.77-0.84x), so the worker also idles to a
CPU share (``cpu_share``, ``DutyCycle``): a diagnosis takes 1/share as long.  At
share 0.25 the engine still ran at 0.865x there (README): on a host that serves,
run diagnoses on the control plane's.  Memory is checked before a worker starts: the two models
in fp32 plus headroom must fit in what the host has available, else the diagnosis is refused
(report failed, saying why) -- a diagnosis beside two demo-pair engines on a 24 GiB host once
pushed an engine's worker out of memory (killed by the kernel).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from datetime import timedelta
from pathlib import Path

from sqlalchemy import Engine

from spectune.engine.lifeline import follow_parent
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
    cpu_share: float = 1.0,
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
                cpu_share=cpu_share,
            )
        )
        finish_report(db, report_id, report, summary(report))
    except Exception as exc:
        log.exception("diagnosis %d failed", report_id)
        fail_report(db, report_id, f"{type(exc).__name__}: {exc}")
    return report_id


GIB = 1 << 30
MEMORY_HEADROOM_BYTES = GIB  # left to the host beyond the two fp32 models (SPECTUNE_DIAGNOSIS_MEMORY_HEADROOM_GIB)
_BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2, "float16": 2}


def fp32_bytes(model_dir: str) -> int | None:
    """Bytes a model's weights take in fp32, as the diagnosis loads them, from its weight files and
    the dtype its config says they are stored in; None when ``model_dir`` is not a local model."""
    path = Path(model_dir)
    config = path / "config.json"
    if not config.is_file():
        return None
    stored = sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in path.glob(pattern))
    meta = json.loads(config.read_text())
    width = _BYTES_PER_PARAM.get(meta.get("torch_dtype") or meta.get("dtype"), 4)  # unknown: as stored
    return stored * 4 // width


def available_memory() -> int | None:
    """MemAvailable of this host (Linux), in bytes; None where /proc/meminfo does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_shortfall(
    target: str, draft: str, available: int | None, headroom: int = MEMORY_HEADROOM_BYTES
) -> str | None:
    """Why a diagnosis of (target, draft) must not start here, or None when it fits."""
    needed = [b for b in (fp32_bytes(target), fp32_bytes(draft)) if b is not None]
    if available is None or not needed:
        return None  # nothing to compare (not Linux, or models not local): the worker reports a failure
    if sum(needed) + headroom <= available:
        return None
    return (
        f"not enough memory for a diagnosis here: the two models need {sum(needed) / GIB:.1f} GiB in fp32 "
        f"plus {headroom / GIB:.1f} GiB headroom, {available / GIB:.1f} GiB is available; "
        "refused so serving is not pushed out of memory -- run diagnoses on the control plane's host "
        "(spectune serve --no-engine --model T --draft-model D)"
    )


def _low_priority_worker() -> None:
    follow_parent()  # a killed or stopped serve must not leave a worker holding two fp32 models
    os.nice(19)  # the serving process keeps the CPU whenever it wants it
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


def _diagnose_in_worker(db_url: str, *args: object) -> int:
    from spectune.store.db import make_engine

    db = make_engine(db_url)
    try:
        return diagnose_and_store(db, *args)  # type: ignore[arg-type]
    finally:
        db.dispose()


class DiagnosisRunner:
    """One diagnosis at a time, each in the low-priority worker process (started on first use).

    ``models`` gives (target, draft) at submit time: the draft in service may
    have changed since start-up.  The report row is created here, so the caller
    has its id at once; the worker fills it in (or marks it failed).
    """

    def __init__(
        self,
        db: Engine,
        models: Callable[[], tuple[str, str]],
        cpu_share: float = 0.25,
        memory_headroom: int = MEMORY_HEADROOM_BYTES,
    ) -> None:
        self.db, self.models, self.cpu_share, self.memory_headroom = db, models, cpu_share, memory_headroom
        self._url = db.url.render_as_string(hide_password=False)
        self._pool = ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_low_priority_worker
        )

    def submit(self, trigger: str, prompt_class: str | None, max_prompts: int = 8) -> tuple[int, Future]:
        target, draft = self.models()
        report_id = start_report(self.db, trigger, prompt_class)
        refused = memory_shortfall(target, draft, available_memory(), self.memory_headroom)
        if refused is not None:
            log.warning("diagnosis %d: %s", report_id, refused)
            fail_report(self.db, report_id, refused)
            done: Future = Future()
            done.set_result(report_id)
            return report_id, done
        future = self._pool.submit(
            _diagnose_in_worker, self._url, target, draft, trigger, prompt_class, max_prompts, report_id, self.cpu_share
        )
        future.add_done_callback(lambda f: self._lost(f, report_id))
        return report_id, future

    def _lost(self, future: Future, report_id: int) -> None:
        """The worker died (killed, out of memory): the report says so instead of staying 'running'."""
        exc = future.exception() if not future.cancelled() else None
        if exc is not None:
            log.error("diagnosis %d: worker process failed: %r", report_id, exc)
            fail_report(self.db, report_id, f"worker process failed: {type(exc).__name__}: {exc}")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
