"""Engine configuration: what to serve and how to speculate."""

from __future__ import annotations

import socket
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .classifier import PromptClassifier
from .schema import (
    DEFAULT_MAX_SPECULATIVE_TOKENS,
    MAX_SPECULATIVE_TOKENS_LIMIT,
    SPECULATION_METHODS,
    BatchRange,
    RuntimeSettings,
    SpeculationMethod,
)

# Start-up settings an operator also sets through ``spectune serve`` (``spectune/settings.py``
# declares its fields with these types): one default, bounds and description each.
Method = Annotated[
    SpeculationMethod,
    Field(
        default="draft_model",
        description=f"How drafts are made: {' | '.join(SPECULATION_METHODS)} (suffix: arctic-inference's trees).",
    ),
]
MaxSpeculativeTokens = Annotated[
    int,
    Field(
        default=DEFAULT_MAX_SPECULATIVE_TOKENS,
        ge=1,
        le=MAX_SPECULATIVE_TOKENS_LIMIT,
        description="N capacity: the largest N the control plane may set; a higher one needs a restart.",
    ),
]
DtypeName = Literal["auto", "bfloat16", "float16", "float32"]
Dtype = Annotated[DtypeName, Field(default="bfloat16", description="Model weights dtype.")]
MaxModelLen = Annotated[int, Field(default=2048, ge=16, description="Longest prompt plus output, in tokens.")]
MaxNumSeqs = Annotated[int, Field(default=16, ge=1, description="Most requests in one batch.")]
KvCacheSpaceGib = Annotated[int, Field(default=2, ge=1, description="KV cache size (VLLM_CPU_KVCACHE_SPACE on CPU).")]
PromptSampleRate = Annotated[
    float,
    Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Fraction of requests whose prompt and completion text ride on the record (for draft "
        "diagnostics). Off by default: prompts can be sensitive.",
    ),
]


class EngineConfig(BaseModel):
    """Start-up configuration of one embedded engine instance.

    ``max_speculative_tokens`` is the *capacity*: the largest N the runtime
    settings may ask for without a rebuild (vLLM's ``num_speculative_tokens``).
    ``initial`` is what is in force until the control plane says otherwise.
    """

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="Target model: a local HF directory")
    served_model_name: str | None = None
    tokenizer: str | None = None
    method: Method
    draft_model: str | None = None
    max_speculative_tokens: MaxSpeculativeTokens
    draft_sample_method: Literal["greedy", "probabilistic"] = Field(
        default="probabilistic",
        description="probabilistic: the draft samples from q and verification uses "
        "min(1, p/q); greedy: argmax drafts verified as q = one-hot (lossless, lower "
        "acceptance under sampling)",
    )
    ngram_prompt_lookup_min: int = Field(default=1, ge=1)
    ngram_prompt_lookup_max: int = Field(default=4, ge=1)
    max_model_len: MaxModelLen
    max_num_seqs: MaxNumSeqs
    dtype: Dtype
    kv_cache_space_gib: KvCacheSpaceGib
    seed: int = 0
    instance_id: str = Field(default_factory=socket.gethostname)
    prompt_sample_rate: PromptSampleRate
    initial: RuntimeSettings = Field(default_factory=RuntimeSettings)
    vllm_args: list[str] = Field(
        default_factory=list,
        description="vLLM engine and server arguments, as `vllm serve` takes them (engine/vllm_args.py)",
    )
    classifier: PromptClassifier = Field(default_factory=PromptClassifier)

    @model_validator(mode="after")
    def _consistent(self) -> EngineConfig:
        if self.method == "draft_model" and not self.draft_model:
            raise ValueError("method 'draft_model' needs draft_model")
        if self.ngram_prompt_lookup_max < self.ngram_prompt_lookup_min:
            raise ValueError("ngram_prompt_lookup_max must be >= ngram_prompt_lookup_min")
        return self

    @property
    def name(self) -> str:
        return self.served_model_name or self.model.rstrip("/").rsplit("/", 1)[-1]

    def speculative_config(self) -> dict[str, Any] | None:
        if self.method == "none":
            return None
        if self.method == "ngram":
            return {
                "method": "ngram",
                "num_speculative_tokens": self.max_speculative_tokens,
                "prompt_lookup_min": self.ngram_prompt_lookup_min,
                "prompt_lookup_max": self.ngram_prompt_lookup_max,
            }
        if self.method == "suffix":
            # N capacity = the longest draft; the suffix trees stay at vLLM's default depth (24),
            # which only bounds the pattern matched, never the draft (the capacity does).
            return {"method": "suffix", "num_speculative_tokens": self.max_speculative_tokens}
        return {
            "method": "draft_model",
            "model": self.draft_model,
            "num_speculative_tokens": self.max_speculative_tokens,
            "draft_sample_method": self.draft_sample_method,
        }

    def target_only(self) -> EngineConfig:
        """The same engine without speculation (the degraded fallback)."""
        return self.model_copy(update={"method": "none", "draft_model": None})


def parse_batch_table(spec: str) -> list[BatchRange]:
    """Parse ``"1-4:3,5-16:1,17-256:0"`` into batch ranges (CLI helper)."""
    table = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            span, n = part.split(":")
            lo, _, hi = span.partition("-")
            table.append(BatchRange(min_batch=int(lo), max_batch=int(hi or lo), num_speculative_tokens=int(n)))
        except ValueError as exc:
            raise ValueError(f"bad batch range {part!r}: expected MIN-MAX:N ({exc})") from exc
    return table
