"""Speculation policy: what operators set and what the tuner may do.

A ``PolicyDocument`` holds the global policy plus per-class and per-instance
overrides, and optionally the prompt classifier (classes and their rules), so
one definition serves the whole fleet, validated, versioned and audited.
``effective_policy`` (pure) resolves what applies to one instance and class
-- global, then class, then instance override -- and ``runtime_settings``
(pure) turns that into the engine's ``RuntimeSettings``, folding the batch
rules (speculation off below / above a batch size) into the batch-size table.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from spectune.engine.classifier import PromptClassifier
from spectune.engine.schema import (
    DEFAULT_MAX_SPECULATIVE_TOKENS,
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    MAX_SPECULATIVE_TOKENS_LIMIT,
    NEAR_TIE_NATS,
    BatchRange,
    ClassSettings,
    RuntimeSettings,
    SpeculationMethod,
    check_batch_table,
)

MAX_BATCH = 4096


class TunerMode(StrEnum):
    AUTO = "auto"  # apply decisions
    ADVISE = "advise"  # record decisions, apply nothing
    FROZEN = "frozen"  # decide nothing


class PolicyOverride(BaseModel):
    """Any subset of the policy fields; unset fields inherit."""

    model_config = ConfigDict(extra="forbid")

    speculation_enabled: bool | None = None
    method: SpeculationMethod | None = None
    draft_model: str | None = None
    num_speculative_tokens: int | None = Field(default=None, ge=0, le=MAX_SPECULATIVE_TOKENS_LIMIT)
    n_min: int | None = Field(
        default=None, ge=0, le=MAX_SPECULATIVE_TOKENS_LIMIT, description="Lowest N the tuner may choose"
    )
    n_max: int | None = Field(
        default=None, ge=0, le=MAX_SPECULATIVE_TOKENS_LIMIT, description="Highest N the tuner may choose"
    )
    batch_table: list[BatchRange] | None = None
    disable_below_batch: int | None = Field(default=None, ge=1, le=MAX_BATCH, description="Off for batch < this")
    disable_above_batch: int | None = Field(default=None, ge=1, le=MAX_BATCH, description="Off for batch > this")
    acceptance_floor: float | None = Field(default=None, ge=0.0, le=1.0)
    tuner_mode: TunerMode | None = None
    cooldown_s: float | None = Field(default=None, ge=0.0, le=86_400.0)
    probe_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    control_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    control_budget: float | None = Field(default=None, ge=0.0, le=0.5)
    diagnosis_acceptance_threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    diagnosis_min_requests: int | None = Field(default=None, ge=1, le=1_000_000)
    draft_cost_prior: float | None = Field(default=None, ge=0.0, le=5.0)
    min_gain: float | None = Field(default=None, ge=0.0, le=1.0)
    explore_margin: float | None = Field(default=None, ge=0.0, le=1.0)
    explore_budget: float | None = Field(default=None, ge=0.0, le=0.5)
    fidelity_audit_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    ttft_budget_s: float | None = Field(default=None, gt=0.0, le=3600.0)


class Policy(BaseModel):
    """A fully resolved policy (every field set)."""

    model_config = ConfigDict(extra="forbid")

    speculation_enabled: bool = True
    method: SpeculationMethod | None = Field(
        default=None, description="None: as the engine was started; a change rebuilds the engine"
    )
    draft_model: str | None = Field(default=None, description="None: as the engine was started")
    num_speculative_tokens: int = Field(default=DEFAULT_NUM_SPECULATIVE_TOKENS, ge=0, le=MAX_SPECULATIVE_TOKENS_LIMIT)
    n_min: int = Field(default=0, ge=0, le=MAX_SPECULATIVE_TOKENS_LIMIT)
    n_max: int = Field(default=DEFAULT_MAX_SPECULATIVE_TOKENS, ge=0, le=MAX_SPECULATIVE_TOKENS_LIMIT)
    batch_table: list[BatchRange] = Field(default_factory=list)
    disable_below_batch: int | None = Field(default=None, ge=1, le=MAX_BATCH)
    disable_above_batch: int | None = Field(default=None, ge=1, le=MAX_BATCH)
    acceptance_floor: float = Field(default=0.70, ge=0.0, le=1.0)
    tuner_mode: TunerMode = TunerMode.AUTO
    cooldown_s: float = Field(default=300.0, ge=0.0, le=86_400.0)
    probe_fraction: float = Field(
        default=0.05,
        ge=0.0,
        le=1.0,
        description="Share of a switched-off class's requests that still speculate (probes), so that its "
        "acceptance keeps being measured and speculation can come back",
    )
    control_fraction: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Share of a speculating class's requests served plain where they run alone (control "
        "requests: the speedup measured against plain comes from them).  With control_budget > 0 the "
        "tuner sets it with every change it applies",
    )
    control_budget: float = Field(
        default=0.0,
        ge=0.0,
        le=0.5,
        description="Share of a speculating class's tokens/s its control requests may cost: the tuner sets "
        "control_fraction = budget / ((1 - budget)(speedup - 1)), at most 25 %.  0: it leaves control_fraction be",
    )
    diagnosis_acceptance_threshold: float = Field(default=0.70, ge=0.0, le=1.0)
    diagnosis_min_requests: int = Field(default=50, ge=1, le=1_000_000)
    draft_cost_prior: float = Field(
        default=0.3,
        ge=0.0,
        le=5.0,
        description="Cost of one drafted+verified token relative to a plain step, used until step statistics fit one",
    )
    min_gain: float = Field(default=0.05, ge=0.0, le=1.0, description="Hysteresis: predicted gain needed to move N")
    explore_margin: float = Field(
        default=0.1,
        ge=0.0,
        le=1.0,
        description="Try an unmeasured neighbouring N when the model puts it within this share of the current N",
    )
    explore_budget: float = Field(
        default=0.02,
        ge=0.0,
        le=0.5,
        description="Share of a class's tokens/s that exploring may cost: after an exploration that ran L below "
        "the N it replaced for H seconds, the next waits until L x H / budget seconds after it began "
        "(0: never explore)",
    )
    fidelity_audit_fraction: float = Field(
        default=0.01,
        ge=0.0,
        le=1.0,
        description="Share of greedy speculating requests replayed plain in the background and compared token "
        "by token (0: off)",
    )
    fidelity_near_tie_nats: float = Field(
        default=NEAR_TIE_NATS,
        gt=0.0,
        le=10.0,
        description="A divergence where the target's top-2 logprob margin is below this in both runs is a "
        "numeric near-tie, not a defect",
    )

    ttft_budget_s: float | None = Field(
        default=None,
        gt=0.0,
        le=3600.0,
        description="p95 time to first token (s) the class may take while speculating: where its speculating "
        "requests measure above it and plain ones do not, the tuner switches it off and keeps it off (None: no budget)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Policy:
        if self.n_min > self.n_max:
            raise ValueError(f"n_min ({self.n_min}) must be <= n_max ({self.n_max})")
        if not self.n_min <= self.num_speculative_tokens <= self.n_max:
            raise ValueError(
                f"num_speculative_tokens ({self.num_speculative_tokens}) must lie in "
                f"[n_min, n_max] = [{self.n_min}, {self.n_max}]"
            )
        for entry in self.batch_table:
            if entry.num_speculative_tokens > self.n_max:
                raise ValueError(f"batch_table N {entry.num_speculative_tokens} exceeds n_max ({self.n_max})")
        check_batch_table(self.batch_table)
        below, above = self.disable_below_batch, self.disable_above_batch
        if below is not None and above is not None and below > above:
            raise ValueError(f"disable_below_batch ({below}) must be <= disable_above_batch ({above})")
        if self.method == "draft_model" and self.draft_model is not None and not self.draft_model.strip():
            raise ValueError("draft_model must not be blank")
        return self


class PolicyDocument(BaseModel):
    """What the API versions: global policy plus overrides by class and instance."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    global_: Policy = Field(default_factory=Policy, alias="global")
    classes: dict[str, PolicyOverride] = Field(default_factory=dict)
    instances: dict[str, PolicyOverride] = Field(default_factory=dict)
    classifier: PromptClassifier | None = Field(
        default=None,
        description="The fleet's prompt classes and rules (regex, prompt-length thresholds, default); "
        "None: each engine's start-up classifier",
    )

    def known_classes(self, default: set[str] | frozenset[str]) -> set[str]:
        """The classes this document defines, or ``default`` (the engines' start-up classes)."""
        return set(self.classifier.classes) if self.classifier is not None else set(default)

    def body(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def effective_policy(doc: PolicyDocument, instance: str | None, prompt_class: str | None) -> Policy:
    """global <- class override <- instance override (later wins); validated."""
    merged = doc.global_.model_dump()
    for override in (doc.classes.get(prompt_class or ""), doc.instances.get(instance or "")):
        if override is not None:
            merged.update(override.model_dump(exclude_none=True))
    return Policy.model_validate(merged)


def validate_document(doc: PolicyDocument, known_classes: set[str] | None = None) -> None:
    """Every combination must resolve to a valid policy; unknown classes are refused."""
    if known_classes is not None or doc.classifier is not None:
        known_classes = doc.known_classes(known_classes or set())
        unknown = sorted(set(doc.classes) - known_classes)
        if unknown:
            raise ValueError(f"unknown prompt class(es) {unknown}; known: {sorted(known_classes)}")
    for instance in [None, *doc.instances]:
        for prompt_class in [None, *doc.classes]:
            try:
                effective_policy(doc, instance, prompt_class)
            except ValueError as exc:
                where = f"class {prompt_class!r}" if prompt_class else "global"
                if instance:
                    where += f", instance {instance!r}"
                raise ValueError(f"{where}: {exc}") from exc


def batch_table(policy: Policy) -> list[BatchRange]:
    """The policy's table with the batch rules folded in (rules win where they apply)."""
    off: list[tuple[int, int]] = []
    if policy.disable_below_batch is not None and policy.disable_below_batch > 1:
        off.append((1, policy.disable_below_batch - 1))
    if policy.disable_above_batch is not None and policy.disable_above_batch < MAX_BATCH:
        off.append((policy.disable_above_batch + 1, MAX_BATCH))
    table: list[BatchRange] = [BatchRange(min_batch=lo, max_batch=hi, num_speculative_tokens=0) for lo, hi in off]
    return overlay(table, policy.batch_table)


def overlay(winners: list[BatchRange], others: list[BatchRange]) -> list[BatchRange]:
    """``winners`` plus the parts of ``others`` they do not cover, sorted."""
    table = list(winners)
    for entry in others:
        pieces = [(entry.min_batch, entry.max_batch)]
        for w in winners:
            lo, hi = w.min_batch, w.max_batch
            pieces = [p for a, b in pieces for p in ((a, min(b, lo - 1)), (max(a, hi + 1), b)) if p[0] <= p[1]]
        table += [
            BatchRange(min_batch=a, max_batch=b, num_speculative_tokens=entry.num_speculative_tokens) for a, b in pieces
        ]
    return sorted(table, key=lambda r: r.min_batch)


def draft_key(body: dict[str, Any]) -> tuple[str | None, str | None]:
    """The draft a policy body puts in force: its global method and draft model (a change to either
    rebuilds the engines, so measurements from before it describe another draft)."""
    top = body.get("global", {})
    return top.get("method"), top.get("draft_model")


def runtime_settings(doc: PolicyDocument, instance: str, classes: set[str], version: int) -> RuntimeSettings:
    """The engine settings this policy document means for one instance (``classes``: the engine's
    start-up classes, used unless the document has a classifier of its own)."""
    base = effective_policy(doc, instance, None)
    per_class = {}
    for prompt_class in sorted(doc.known_classes(classes)):
        p = effective_policy(doc, instance, prompt_class)
        per_class[prompt_class] = ClassSettings(
            speculation_enabled=p.speculation_enabled,
            num_speculative_tokens=p.num_speculative_tokens,
            batch_table=batch_table(p),
            probe_fraction=p.probe_fraction,
            control_fraction=p.control_fraction,
            audit_fraction=p.fidelity_audit_fraction,
        )
    return RuntimeSettings(
        version=version,
        speculation_enabled=base.speculation_enabled,
        num_speculative_tokens=base.num_speculative_tokens,
        batch_table=batch_table(base),
        classes=per_class,
        probe_fraction=base.probe_fraction,
        control_fraction=base.control_fraction,
        audit_fraction=base.fidelity_audit_fraction,
        near_tie_nats=base.fidelity_near_tie_nats,
        classifier=doc.classifier,
        method=base.method,
        draft_model=base.draft_model,
    )
