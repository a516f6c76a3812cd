"""Per-request accounting: what vLLM's outputs say about one request, folded
into the ``RequestRecord`` it leaves behind.

One record per engine request, that is per prompt: a request with ``n``
choices (or ``best_of``) is one record whose token and acceptance counts are
summed over its choices; its finish reason is choice 0's unless a choice
failed.  Works for every output kind vLLM's OpenAI layer asks for (deltas
when streaming, the final output otherwise).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .schema import RequestRecord


def per_position(per_step: Sequence[int], positions: int) -> list[int]:
    """Count, for each draft position k, the steps whose value exceeds k."""
    return [sum(1 for v in per_step if v > k) for k in range(positions)]


@dataclass
class _Choice:
    tokens: int = 0
    finish_reason: str | None = None
    spec: Any = None  # vLLM's RequestSpecDecodeMetrics, on the choice's last output


@dataclass
class RequestTelemetry:
    arrival: float
    prompt_tokens: int
    deltas: bool  # outputs carry new tokens only (RequestOutputKind.DELTA)
    sampled_prompt: str | None = None  # set only for requests sampled for diagnostics
    completion: list[str] | None = None
    first_token: float | None = None
    error: str | None = None
    aborted: bool = False
    choices: dict[int, _Choice] = field(default_factory=dict)

    def observe(self, output: Any) -> None:
        """One ``RequestOutput`` from vLLM (any of its choices)."""
        now = time.time()
        for completion in output.outputs:
            choice = self.choices.setdefault(completion.index, _Choice())
            n = len(completion.token_ids)
            choice.tokens = choice.tokens + n if self.deltas else n
            if n and self.first_token is None:
                self.first_token = now
            if completion.finish_reason:
                choice.finish_reason = completion.finish_reason
            if completion.spec_decode_metrics is not None:
                choice.spec = completion.spec_decode_metrics
            if self.completion is not None and completion.index == 0:
                if not self.deltas:
                    self.completion.clear()
                self.completion.append(completion.text)
        stats = output.metrics
        # A non-streamed request is seen only at its end; vLLM timed its first token.
        if stats is not None and stats.first_token_latency > 0:
            self.first_token = min(self.first_token or now, stats.arrival_time + stats.first_token_latency)

    def _finish_reason(self) -> str:
        if self.error:
            return "error"
        if self.aborted or not self.choices:
            return "abort"
        reasons = [self.choices[i].finish_reason for i in sorted(self.choices)]
        if "error" in reasons:
            return "error"
        first = reasons[0]
        return first if first in ("stop", "length") else "abort"

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
        accepted: list[int] = []
        drafted: list[int] = []
        draft_tokens = 0
        for choice in self.choices.values():
            if choice.spec is not None:
                accepted += choice.spec.per_step_accepted or []
                drafted += choice.spec.per_step_drafted or []
                draft_tokens += choice.spec.num_draft_tokens or 0
        output_tokens = sum(c.tokens for c in self.choices.values())
        first = self.first_token
        ttft = max(0.0, first - self.arrival) if first else None
        tpot = (finish - first) / (output_tokens - 1) if first and output_tokens > 1 else None
        return RequestRecord(
            request_id=request_id,
            instance_id=instance_id,
            model=model,
            prompt_class=prompt_class,
            arrival_time=self.arrival,
            first_token_time=first,
            finish_time=finish,
            prompt_tokens=self.prompt_tokens,
            output_tokens=output_tokens,
            ttft_s=ttft,
            tpot_s=tpot,
            e2e_s=max(0.0, finish - self.arrival),
            speculation_method=method,  # type: ignore[arg-type]
            speculation_enabled=method != "none" and n_in_effect > 0,
            num_speculative_tokens=n_in_effect if method != "none" else 0,
            settings_version=settings_version,
            num_spec_steps=len(accepted),
            num_draft_tokens=draft_tokens,
            num_accepted_tokens=sum(accepted),
            drafted_per_position=per_position(drafted, positions),
            accepted_per_position=per_position(accepted, positions),
            batch_size_mean=batch[0],
            batch_size_max=batch[1],
            finish_reason=self._finish_reason(),  # type: ignore[arg-type]
            error=self.error,
            prompt_text=self.sampled_prompt,
            completion_text="".join(self.completion) if self.completion is not None else None,
        )
