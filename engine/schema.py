"""The small schema where the engine meets the rest of spectune.

Four shapes cross the boundary, all plain pydantic models with no behaviour
beyond validation and one pure lookup:

* ``RequestRecord`` -- what the engine reports for every finished request.
* ``StepRecord``    -- what the engine reports for every engine step.
* ``FidelityRecord`` -- an audited request compared with its plain replay.
* ``RuntimeSettings`` -- what the control plane tells the engine to do
  (speculation on/off, N, batch-size table, per prompt class).

``engine/`` produces records and consumes settings; it never imports the
store or the tuner.  Whoever wires the two (``spectune.serve``) passes these
objects across.
"""

from __future__ import annotations

import itertools
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .classifier import PromptClassifier

FinishReason = Literal["stop", "length", "abort", "error"]
# How drafts are made: none (plain serving), a draft model, or a token-level proposer -- prompt
# lookup (ngram) or suffix trees over the prompt and earlier outputs (suffix, arctic-inference).
SpeculationMethod = Literal["none", "ngram", "draft_model", "suffix"]
SPECULATION_METHODS: tuple[str, ...] = get_args(SpeculationMethod)

# N: speculative tokens per step.  The capacity (``max_speculative_tokens``) is the largest N an
# engine accepts without a rebuild -- vLLM sizes its buffers for it at start-up; the N in force
# (``num_speculative_tokens``) is what the runtime settings ask for, at most the capacity.
MAX_SPECULATIVE_TOKENS_LIMIT = 16  # the largest capacity spectune lets an engine start with
DEFAULT_MAX_SPECULATIVE_TOKENS = 6  # capacity: ngram N=6 paid 3.2x plain on copy-heavy edits
DEFAULT_NUM_SPECULATIVE_TOKENS = 3  # N in force until the control plane says otherwise

# Request tags: sampling ``extra_args`` the engine sets on every request it admits and its
# scheduler reads at every step (the class, whether it probes a switched-off class, whether it
# runs plain: a control request or a fidelity replay).
CLASS_ARG = "spectune_class"
PROBE_ARG = "spectune_probe"
PLAIN_ARG = "spectune_plain"

# Fidelity audit: a divergence where the target's top-2 logprob margin is below this in both runs
# is a numeric near-tie (bf16 ties measured at 0 and 0.125 nats), above it a losslessness defect.
NEAR_TIE_NATS = 0.25


class BatchRange(BaseModel):
    """N for every batch size in ``[min_batch, max_batch]`` (inclusive)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_batch: int = Field(ge=1)
    max_batch: int = Field(ge=1)
    num_speculative_tokens: int = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> BatchRange:
        if self.max_batch < self.min_batch:
            raise ValueError(f"max_batch ({self.max_batch}) must be >= min_batch ({self.min_batch})")
        return self


def check_batch_table(table: list[BatchRange] | None) -> list[BatchRange] | None:
    if not table:
        return table
    ordered = sorted(table, key=lambda r: r.min_batch)
    for before, after in itertools.pairwise(ordered):
        if after.min_batch <= before.max_batch:
            raise ValueError(
                f"batch ranges overlap: [{before.min_batch},{before.max_batch}] and "
                f"[{after.min_batch},{after.max_batch}]"
            )
    return ordered


def n_for_batch(table: list[BatchRange], batch_size: int, default: int) -> int:
    """N of the table entry covering ``batch_size``, else ``default``."""
    for entry in table:
        if entry.min_batch <= batch_size <= entry.max_batch:
            return entry.num_speculative_tokens
    return default


class ClassSettings(BaseModel):
    """Overrides for one prompt class; ``None`` inherits the global value."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    speculation_enabled: bool | None = None
    num_speculative_tokens: int | None = Field(default=None, ge=0)
    batch_table: list[BatchRange] | None = None
    probe_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    control_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    audit_fraction: float | None = Field(default=None, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _table(self) -> ClassSettings:
        check_batch_table(self.batch_table)
        return self


class RuntimeSettings(BaseModel):
    """Speculation settings the engine applies while serving.

    ``num_speculative_tokens`` can never exceed the engine's capacity
    (``EngineConfig.max_speculative_tokens``): vLLM sizes its buffers for it at
    start-up.  Raising the capacity needs a rebuild, lowering N does not
    (``check_capacity``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = Field(default=0, ge=0)
    speculation_enabled: bool = True
    num_speculative_tokens: int = Field(default=DEFAULT_NUM_SPECULATIVE_TOKENS, ge=0)
    batch_table: list[BatchRange] | None = None
    classes: dict[str, ClassSettings] = Field(default_factory=dict)
    probe_fraction: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Share of requests of a switched-off class that still speculate, so that "
        "acceptance keeps being measured and speculation can come back",
    )
    control_fraction: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Share of requests of a speculating class served plain beside it (the control arm): "
        "run alone, their steps are plain steps in the same minutes as the class's steps at N, which is what "
        "its speedup over plain is measured from",
    )
    audit_fraction: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Share of greedy speculating requests replayed as plain requests and compared (fidelity audit)",
    )
    near_tie_nats: float = Field(
        default=NEAR_TIE_NATS,
        gt=0.0,
        le=10.0,
        description="A divergence where the target's top-2 margin is below this in both runs is a numeric near-tie",
    )
    classifier: PromptClassifier | None = Field(
        default=None, description="Prompt classes and their rules; None: the engine's start-up classifier"
    )
    # What the policy wants speculation to run with; None: as the engine started.  Not applied by
    # ``SpecEngine.apply``: a change is a managed rebuild, rolled through a fleet one engine at a time.
    method: SpeculationMethod | None = None
    draft_model: str | None = None

    @model_validator(mode="after")
    def _table(self) -> RuntimeSettings:
        check_batch_table(self.batch_table)
        return self

    def largest_n(self) -> int:
        """The largest N any class or batch size asks for."""
        return max(
            [self.num_speculative_tokens]
            + [c.num_speculative_tokens or 0 for c in self.classes.values()]
            + [r.num_speculative_tokens for r in self.batch_table or ()]
            + [r.num_speculative_tokens for c in self.classes.values() for r in c.batch_table or ()]
        )

    def check_capacity(self, capacity: int) -> None:
        """The one capacity check: refuse settings an engine of this capacity cannot run without a rebuild."""
        largest = self.largest_n()
        if largest > capacity:
            raise ValueError(
                f"num_speculative_tokens {largest} exceeds this engine's capacity {capacity} "
                f"(raising it needs a restart with --max-speculative-tokens {largest})"
            )

    def n_for(self, prompt_class: str | None, batch_size: int, capacity: int, probing: bool = False) -> int:
        """N to use for a request of ``prompt_class`` in a batch of ``batch_size``.

        Class override beats global (``prompt_class`` None: a request the engine did not tag, which
        runs the global settings); a batch table entry covering the batch
        size beats the plain N; the result is clamped to the engine capacity.
        A probe request ignores on/off, not the table: it measures the class's acceptance, and a
        batch size the table keeps plain stays plain (one speculating request makes the drafter run
        over the whole batch: at 8 concurrent, 5 % probes put one in about a third of the steps).
        """
        override = self.classes.get(prompt_class) if prompt_class is not None else None
        enabled = self.speculation_enabled
        n = self.num_speculative_tokens
        table = self.batch_table
        if override is not None:
            if override.speculation_enabled is not None:
                enabled = override.speculation_enabled
            if override.num_speculative_tokens is not None:
                n = override.num_speculative_tokens
            if override.batch_table is not None:
                table = override.batch_table
        if not enabled and not probing:
            return 0
        return max(0, min(n_for_batch(table or [], batch_size, n), capacity))

    def probe_fraction_for(self, prompt_class: str) -> float:
        return self._share(prompt_class, "probe_fraction")

    def control_fraction_for(self, prompt_class: str) -> float:
        return self._share(prompt_class, "control_fraction")

    def audit_fraction_for(self, prompt_class: str) -> float:
        return self._share(prompt_class, "audit_fraction")

    def _share(self, prompt_class: str, name: str) -> float:
        """A class's own value of a share, else the global one."""
        own = getattr(self.classes.get(prompt_class), name, None)
        return getattr(self, name) if own is None else own


class RequestRecord(BaseModel):
    """Telemetry for one finished (or failed, or aborted) request."""

    model_config = ConfigDict(extra="forbid")

    request_id: str
    instance_id: str
    model: str
    prompt_class: str
    arrival_time: float = Field(description="Unix time the engine received the request")
    first_token_time: float | None = None
    finish_time: float
    prompt_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)
    ttft_s: float | None = Field(default=None, description="Arrival to first output token")
    tpot_s: float | None = Field(default=None, description="Mean time per output token after the first")
    e2e_s: float = Field(ge=0)
    speculation_method: SpeculationMethod
    speculation_enabled: bool = Field(description="N in effect > 0 when the request was admitted")
    num_speculative_tokens: int = Field(ge=0, description="N in effect at admission")
    settings_version: int = 0
    num_spec_steps: int = Field(default=0, ge=0)
    num_draft_tokens: int = Field(default=0, ge=0)
    num_accepted_tokens: int = Field(default=0, ge=0)
    drafted_per_position: list[int] = Field(default_factory=list)
    accepted_per_position: list[int] = Field(default_factory=list)
    batch_size_mean: float | None = None
    batch_size_max: int | None = None
    finish_reason: FinishReason
    error: str | None = None
    # Only on requests sampled for diagnostics (EngineConfig.prompt_sample_rate, off by default).
    prompt_text: str | None = None
    completion_text: str | None = None

    @property
    def acceptance_rate(self) -> float | None:
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens


class StepRecord(BaseModel):
    """One engine step as seen by the stat logger (the tuner's cost model input)."""

    model_config = ConfigDict(extra="forbid")

    instance_id: str
    time: float
    batch_size: int = Field(ge=0)
    num_prefill_requests: int = Field(ge=0)
    num_decode_requests: int = Field(ge=0)
    num_scheduled_tokens: int = Field(ge=0)
    step_time_s: float = Field(ge=0)
    num_speculative_tokens: int = Field(ge=0, description="K drafted this step (0 = none)")
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = Field(default_factory=list)


class FidelityRecord(BaseModel):
    """A served greedy request against its plain replay (``engine/fidelity.py``)."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(description="The audited request's record id")
    instance_id: str
    prompt_class: str
    checked_at: float = Field(description="Unix time the comparison was made")
    speculation_method: SpeculationMethod
    num_speculative_tokens: int = Field(ge=0, description="N in effect when the request was admitted")
    result: Literal["match", "near_tie", "defect"]
    compared_tokens: int = Field(ge=0)
    diverged_at: int | None = Field(
        default=None, ge=0, description="First token that differs (or that was not the served run's argmax)"
    )
    served_margin: float | None = Field(default=None, description="Target's top-2 logprob margin there, served")
    plain_margin: float | None = Field(default=None, description="The same in the plain replay")
    served_gap: float | None = Field(
        default=None, ge=0.0, description="Nats the served token's logprob lies below its run's best there (0: argmax)"
    )
    reason: str = ""
