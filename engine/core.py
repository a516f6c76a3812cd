"""The embedded speculative engine: vLLM's AsyncLLM plus telemetry and control.

``SpecEngine`` owns one AsyncLLM.  For every request it classifies the
prompt, tags it with its class (the scheduler reads the tag to pick N),
streams deltas to the caller, and on the way out -- finished, failed or
aborted -- emits one ``RequestRecord`` to its sinks.  ``apply`` changes the
speculation settings at the next engine step; ``rebuild`` swaps the whole
AsyncLLM (drain, rebuild, resume) for changes vLLM only takes at start-up.
A draft model that fails to load degrades the engine to target-only serving
and says why in ``degraded_reason``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from . import drafter, faults, requests, stats, vllm_args
from .classifier import PromptClassifier, UnknownClassError
from .config import EngineConfig
from .fidelity import Auditor
from .requests import EngineUnavailableError, GenerationRequest, InvalidRequestError
from .schema import CLASS_ARG, PLAIN_ARG, PROBE_ARG, RuntimeSettings, StepRecord
from .sinks import RecordSink, fan_out
from .stats import BatchAccountant, make_stat_logger
from .telemetry import RequestTelemetry

__all__ = ["Delta", "EngineUnavailableError", "GenerationRequest", "InvalidRequestError", "SpecEngine"]

log = logging.getLogger(__name__)


class _DropIterationLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Iteration(" not in str(record.msg)


def _quiet_iteration_logs() -> None:
    """We ask vLLM for per-iteration details (step time for the cost model);
    its logging stat logger would then print a line per engine step.  vLLM
    re-applies its logging config while building the engine (which resets
    logger levels), so a filter is what sticks."""
    vllm_stats_log = logging.getLogger("vllm.v1.metrics.loggers")
    if not any(isinstance(f, _DropIterationLines) for f in vllm_stats_log.filters):
        vllm_stats_log.addFilter(_DropIterationLines())


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0


class SpecEngine:
    def __init__(
        self, config: EngineConfig, sinks: Sequence[RecordSink] = (), openai_api_key: str | None = None
    ) -> None:
        self.config = config
        self.openai_api_key = openai_api_key
        self.server_args = vllm_args.server_args(config, openai_api_key)  # vLLM's Namespace, checked now
        self.active_config = config
        self.sinks = list(sinks)
        self.auditor = Auditor(self)
        self.degraded_reason: str | None = None
        self.settings = config.initial
        self._llm: Any = None
        self._tokenizer: Any = None
        self._batches = BatchAccountant()
        self._in_flight = 0
        self._admitting = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self._rebuild_lock = asyncio.Lock()
        self._last_batch = 0
        self._tasks: set[asyncio.Task] = set()
        self._recovery: asyncio.Task | None = None
        self.recoveries = 0  # target-only rebuilds after the engine died
        # Called with (settings, capacity) whenever settings take effect.
        self.settings_listeners: list[Callable[[RuntimeSettings, int], None]] = []
        # Awaited after every (re)start, before requests are admitted (the OpenAI layer rebinds).
        self.start_listeners: list[Callable[[], Awaitable[None]]] = []

    # -- lifecycle -----------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Largest N the running engine accepts without a rebuild (0 = no drafter)."""
        cfg = self.active_config
        return 0 if cfg.method == "none" else cfg.max_speculative_tokens

    @property
    def started(self) -> bool:
        return self._llm is not None

    @property
    def rebuilding(self) -> bool:
        return self._rebuild_lock.locked()

    @contextlib.asynccontextmanager
    async def admitted(self) -> AsyncIterator[None]:
        """Hold one request: wait while a rebuild is under way, then count it in flight, so a
        rebuild drains it before the engine goes (vLLM's handlers touch the engine before and
        after ``generate``)."""
        await self._admitting.wait()
        self._enter()
        try:
            yield
        finally:
            self._leave()

    def _enter(self) -> None:
        self._in_flight += 1
        self._drained.clear()

    def _leave(self) -> None:
        self._in_flight -= 1
        if not self._in_flight:
            self._drained.set()

    @property
    def running(self) -> bool:
        return self._llm is not None and self._admitting.is_set()

    async def start(self) -> None:
        await self._start(self.config)
        self._admitting.set()

    async def _start(self, config: EngineConfig) -> None:
        try:
            self._llm = await asyncio.to_thread(self._build, config)
            self.active_config = config
            self.degraded_reason = None
            if config.method != "none":
                await self._check_free_off_state()
                if faults.requested():
                    await self._worker_call("install_test_fault")
        except Exception as exc:
            if config.method == "none" or isinstance(exc, drafter.UnsupportedVllmError):
                raise
            self.degraded_reason = f"{type(exc).__name__}: {exc}"[:2000]
            log.error("speculation unavailable, serving target-only: %s", self.degraded_reason)
            fallback = config.target_only()
            self._llm = await asyncio.to_thread(self._build, fallback)
            self.active_config = fallback
        self._tokenizer = self._llm.get_tokenizer()
        await self._push_settings(self.settings)
        for listener in self.start_listeners:
            await listener()

    def _build(self, config: EngineConfig) -> Any:
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        drafter.check_supported()
        drafter.check_method(config.method)
        stats.check_supported()
        _quiet_iteration_logs()
        if current_platform.is_cpu():
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_space_gib)
        args = vllm_args.engine_args(config, self.server_args)
        logger_cls = make_stat_logger(config.instance_id, self._on_step)
        return AsyncLLM.from_engine_args(args, stat_loggers=[logger_cls])

    async def _worker_call(self, name: str) -> list[Any]:
        """Run ``scheduler.WORKER_CALLS[name](worker)`` in every vLLM worker."""
        return await self._llm.engine_core.call_utility_async("spectune_worker_call", name)

    async def _check_free_off_state(self) -> None:
        if not all(await self._worker_call("install_free_off_state")):
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)
            raise drafter.UnsupportedVllmError(
                "the free off state is not installed in vLLM's workers (the vllm.general_plugins "
                "entry point spectune_vllm_fixes did not load): speculation at N=0 would still run the draft model"
            )

    async def count_draft_forwards(self) -> int:
        """Draft-model forward passes so far, summed over workers (installs a counting hook)."""
        if self._llm is None:
            raise EngineUnavailableError("engine is not running")
        return sum(await self._worker_call("count_draft_forwards"))

    def spawn(self, coroutine: Any) -> asyncio.Task:
        """Run in the background, keeping a reference (the loop holds tasks only weakly)."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def shutdown(self) -> None:
        self._admitting.clear()
        llm, self._llm = self._llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)
        for sink in self.sinks:
            sink.close()

    # -- control -------------------------------------------------------------
    async def apply(self, settings: RuntimeSettings) -> RuntimeSettings:
        """Install new speculation settings; effective from the next engine step."""
        settings.check_capacity(self.config.max_speculative_tokens)
        await self._push_settings(settings)
        return settings

    async def _push_settings(self, settings: RuntimeSettings) -> None:
        if self._llm is None:
            self.settings = settings
            return
        await self._llm.engine_core.call_utility_async("spectune_apply", settings.model_dump(mode="json"))
        self.settings = settings  # before the listeners: a heartbeat reports the version now held
        for listener in self.settings_listeners:
            listener(settings, self.capacity)

    async def rebuild(self, config: EngineConfig, settings: RuntimeSettings | None = None) -> float:
        """Managed rebuild: stop admitting, drain in-flight, rebuild, resume.

        Requests that arrive meanwhile wait (they are not failed).  Returns the
        seconds during which no request was admitted.
        """
        async with self._rebuild_lock:
            start = time.perf_counter()
            self._admitting.clear()
            await self._drained.wait()
            old, self._llm = self._llm, None
            if old is not None:
                await asyncio.to_thread(old.shutdown)
            self.config = config
            self.server_args = vllm_args.server_args(config, self.openai_api_key)
            if settings is not None:
                self.settings = settings
            try:
                await self._start(config)
            finally:
                self._admitting.set()
            return time.perf_counter() - start

    # -- serving -------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self._llm.model_config.max_model_len if self._llm is not None else self.config.max_model_len

    @property
    def model_name(self) -> str:
        """The served model name: vLLM's first --served-model-name (spectune's, or a pass-through one)."""
        return self.server_args.served_model_name[0]

    def tokenize(self, text: str) -> list[int]:
        if self._tokenizer is None:
            raise EngineUnavailableError("engine is not running")
        return list(self._tokenizer.encode(text))

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Delta]:
        """In-process streaming: one prompt, deltas out; one RequestRecord when it ends."""
        await self._admitting.wait()
        if self._tokenizer is None:
            raise EngineUnavailableError("engine is not running")
        ids, max_tokens = requests.token_ids(req, self._tokenizer, self.max_model_len)
        params = requests.sampling_params(req, max_tokens)
        request_id = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        stream = self.serve({"prompt_token_ids": ids}, params, request_id, prompt_class=req.prompt_class)
        async for output in stream:
            completion = output.outputs[0]
            yield Delta(completion.text, list(completion.token_ids), completion.finish_reason, len(ids))

    @property
    def classifier(self) -> PromptClassifier:
        """The classifier in force: the policy's where it has one, else the start-up one."""
        return self.settings.classifier or self.config.classifier

    def _classify(self, prompt: Any, params: Any, explicit: str | None) -> tuple[str, int, str | None]:
        """(class, prompt tokens, prompt text if known) of a rendered or raw prompt."""
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenize(prompt)
        else:
            text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids") or []
        extra = params.extra_args or {}
        explicit = explicit or extra.get(CLASS_ARG)
        classifier = self.classifier
        if text is None and classifier.regex_rules and explicit is None:
            text = self._tokenizer.decode(ids)
        try:
            return classifier.classify(text or "", len(ids), explicit), len(ids), text
        except UnknownClassError as exc:
            raise InvalidRequestError(str(exc), param=CLASS_ARG) from exc

    async def serve(
        self,
        prompt: Any,
        params: Any,
        request_id: str,
        *,
        prompt_class: str | None = None,
        record_id: str | None = None,
        admitted: bool = False,
        record: bool = True,
        **vllm_kwargs: Any,
    ) -> AsyncIterator[Any]:
        """``AsyncLLM.generate`` with the request tagged by class and N, and one
        RequestRecord (id ``record_id``, default ``request_id``) when a request
        vLLM accepted ends -- finished, failed or aborted.  ``admitted``: the caller
        already holds ``admitted()`` (an HTTP request), so a rebuild cannot be waiting on it.
        ``record=False`` (a fidelity replay): no record, and never audited itself."""
        from vllm.exceptions import GracefulHTTPError, VLLMClientError
        from vllm.sampling_params import RequestOutputKind

        arrival = time.time()
        if not admitted:
            await self._admitting.wait()
        llm = self._llm
        if llm is None:
            raise EngineUnavailableError("engine is not running")
        cls, prompt_tokens, text = self._classify(prompt, params, prompt_class)
        settings = self.settings
        n_now = settings.n_for(cls, self._last_batch + 1, self.capacity)
        probe = False
        if n_now == 0 and self.capacity > 0 and random.random() < settings.probe_fraction_for(cls):
            # A switched-off class keeps being measured on a few requests.  Each step's batch table decides
            # where a probe drafts: the batch it joins at admission is a guess (short requests queued
            # beside one another mostly run alone), and a guess at a batch the table keeps plain
            # vetoed every probe: the class stayed off for good.  Its record carries the N it probes at.
            probe = True
            n_now = settings.n_for(cls, self._last_batch + 1, self.capacity, probing=True) or settings.n_for(
                cls, 1, self.capacity, probing=True
            )
        # The control arm: served plain beside its speculating class, drawn only where it runs alone.  Its
        # steps are then plain steps in the same minutes as the class's steps at N: the pairs its speedup is
        # measured from.  Beside other requests it would measure nothing (the step drafts for them anyway).
        control = not probe and n_now > 0 and not self._in_flight
        control = control and random.random() < settings.control_fraction_for(cls)
        if control:
            n_now = 0
        params = copy.copy(params)  # vLLM clones it again on admission; only extra_args is replaced here
        params.extra_args = {**(params.extra_args or {}), CLASS_ARG: cls, PROBE_ARG: probe}
        if control:
            params.extra_args[PLAIN_ARG] = True
        asked = copy.copy(params)  # what a replay must ask for (before the audit's logprobs)
        audit = self.auditor.choose(cls, params, n_now, settings) if record else None
        state = RequestTelemetry(arrival, prompt_tokens, deltas=params.output_kind == RequestOutputKind.DELTA)
        if self.config.prompt_sample_rate and random.random() < self.config.prompt_sample_rate:
            state.sampled_prompt = text if text is not None else self._tokenizer.decode(prompt["prompt_token_ids"])
            state.completion = []
        record_id = record_id or request_id
        recorded = refused = False

        def write_record() -> None:
            nonlocal recorded
            recorded = True
            if not record:
                self._batches.finish(record_id)
                return
            mean_batch, max_batch = self._batches.finish(record_id)
            fan_out(
                self.sinks,
                state.record(
                    request_id=record_id,
                    instance_id=self.config.instance_id,
                    model=self.model_name,
                    prompt_class=cls,
                    method=self.active_config.method,
                    n_in_effect=n_now,
                    settings_version=settings.version,
                    positions=self.capacity,
                    batch=(mean_batch, max_batch),
                ),
            )

        self._enter()
        self._batches.start(record_id)
        stream = llm.generate(prompt, params, request_id, **vllm_kwargs)
        try:
            async for output in stream:
                state.observe(output)
                if audit is not None:
                    audit.observe(output.outputs[0], state.deltas)
                if output.finished:  # recorded before the caller can send the last byte (kill -9 safe)
                    write_record()
                    if audit is not None and output.outputs[0].finish_reason in ("stop", "length"):
                        self.auditor.finished(prompt, asked, cls, record_id, audit, n_now)
                yield output
        except (VLLMClientError, GracefulHTTPError):
            refused = not state.choices  # refused at admission (a 4xx): it never ran, so no record
            raise
        except (asyncio.CancelledError, GeneratorExit):
            state.aborted = True
            raise
        except Exception as exc:
            state.error = f"{type(exc).__name__}: {exc}"[:2000]
            self._on_engine_error(exc)
            raise
        finally:
            await stream.aclose()  # aborts the request in vLLM if it is still running
            self._leave()
            if refused:
                self._batches.finish(record_id)
            elif not recorded:
                write_record()

    def _on_step(self, step: StepRecord) -> None:
        self._last_batch = step.num_decode_requests
        self._batches.observe(step)
        fan_out(self.sinks, step)

    def _on_engine_error(self, exc: Exception) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(exc, EngineDeadError) and self.active_config.method != "none":
            if self._recovery is not None and not self._recovery.done():
                return  # every request in flight sees the same death: one rebuild for all of them
            # A crashing drafter must not become an outage: come back target-only.
            self.degraded_reason = f"engine died with speculation on: {exc}"[:2000]
            log.error("%s; rebuilding target-only", self.degraded_reason)
            self.recoveries += 1
            self._recovery = self.spawn(self.rebuild(self.config.target_only()))
