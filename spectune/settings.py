"""Process settings (environment variables ``SPECTUNE_*`` or CLI flags).

Each setting is declared once, with its default, bounds and description: here, or -- for those the
engine's ``EngineConfig`` shares -- as a type in ``engine/config.py`` that both use.  ``spectune
serve``'s flags take their help and shown defaults from these fields (``spectune/cli.py``), and
``Settings.engine_config`` builds the embedded engine's ``EngineConfig`` from them.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from spectune.api.auth import TokenSpec
from spectune.engine.classifier import PromptClassifier
from spectune.engine.config import (
    Dtype,
    EngineConfig,
    KvCacheSpaceGib,
    MaxModelLen,
    MaxNumSeqs,
    MaxSpeculativeTokens,
    Method,
    PromptSampleRate,
)
from spectune.engine.schema import DEFAULT_NUM_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS_LIMIT, RuntimeSettings


class DemoPairMissingError(ValueError):
    """No --model given and the demo pair is not prepared."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECTUNE_", extra="ignore")

    host: str = Field(default="127.0.0.1", description="Address the server listens on.")
    port: int = Field(
        default=8000, ge=1, le=65535, description="Port of the OpenAI API, the control plane and /metrics."
    )
    model: str | None = Field(default=None, description="Target model (HF dir). Default: the prepared demo pair.")
    draft_model: str | None = Field(
        default=None, description="Draft model (HF dir, same tokenizer). Default: the demo pair's draft."
    )
    method: Method
    num_speculative_tokens: int = Field(
        default=DEFAULT_NUM_SPECULATIVE_TOKENS,
        ge=0,
        le=MAX_SPECULATIVE_TOKENS_LIMIT,
        description="N in force at start (0 = off); at most the capacity.",
    )
    max_speculative_tokens: MaxSpeculativeTokens
    dtype: Dtype
    max_model_len: MaxModelLen
    max_num_seqs: MaxNumSeqs
    kv_cache_space_gib: KvCacheSpaceGib
    instance_id: str | None = None
    db: str = Field(
        default="sqlite:///var/spectune.db",
        description="Database URL (SQLAlchemy); postgresql+psycopg://user@host/db in production.",
    )
    spool_dir: Path = Path("var/spool")
    records_path: Path | None = Field(default=None, description="Also append request records to this JSONL file.")
    retention_days: float = Field(default=7.0, gt=0, description="Request records older than this are deleted")
    sums_retention_days: float = Field(
        default=400.0, gt=0, description="Sums of records per minute/hour/day (every count) older than this are deleted"
    )
    tuner_interval_s: float = Field(default=60.0, gt=0, description="How often the tuner decides")
    tuner_window_s: float = Field(default=300.0, gt=0, description="How far back the tuner looks for acceptance")
    tuner_cost_window_s: float = Field(
        default=3600.0, gt=0, description="How far back the tuner looks for step times (the cost model)"
    )
    prompt_sample_rate: PromptSampleRate
    prompt_retention_days: float = Field(default=3.0, gt=0)
    diagnosis_cpu_share: float = Field(
        default=0.25, gt=0, le=1, description="Busy share of a core a draft diagnosis may take (it idles the rest)"
    )
    diagnosis_memory_headroom_gib: float = Field(
        default=1.0, ge=0, description="Memory a diagnosis must leave the host beyond its two fp32 models, else refused"
    )
    retention_interval_s: int = Field(default=600, ge=10)
    db_timeout_s: float = Field(
        default=5.0, gt=0, description="Longest wait for the database per connect or statement (then 503 / retry)"
    )
    max_body_bytes: int = Field(default=4 << 20, ge=1024, description="Larger request bodies get 413")
    openai_api_key: SecretStr | None = None
    api_tokens: dict[str, TokenSpec] = Field(
        default_factory=dict,
        description='JSON {"name": {"token": "...", "role": "viewer|operator"}}; '
        "none: a local operator token is generated",
    )
    token_file: Path = Path("var/api-token")
    no_engine: bool = Field(default=False, description="Control plane only, for remote engines.")
    control_plane_url: str | None = Field(
        default=None, description="Follow this control plane's policy (a remote engine) instead of the local one."
    )
    control_plane_token: SecretStr | None = None
    classifier: PromptClassifier | None = Field(
        default=None,
        description="Start-up prompt classes and rules (JSON); a policy's `classifier` replaces them fleet-wide",
    )

    @model_validator(mode="after")
    def _n_within_capacity(self) -> Settings:
        if self.num_speculative_tokens > self.max_speculative_tokens:
            raise ValueError(
                f"num_speculative_tokens ({self.num_speculative_tokens}) exceeds max_speculative_tokens "
                f"({self.max_speculative_tokens}), the capacity the engine starts with"
            )
        return self

    def engine_config(self, vllm_args: list[str] | None = None) -> EngineConfig:
        """The embedded engine these settings describe (``vllm_args``: vLLM's own, passed through)."""
        from spectune.engine.models.prepare import demo_pair_paths

        model, draft = self.model, self.draft_model
        if model is None:
            pair = demo_pair_paths()
            missing = [str(p) for p in pair.values() if not (p / "config.json").exists()]
            if missing:
                raise DemoPairMissingError(
                    f"demo pair not prepared ({', '.join(missing)}); run `spectune models prepare`"
                )
            model, draft = str(pair["target"]), draft or str(pair["draft"])
        return EngineConfig(
            model=model,
            method=self.method,
            draft_model=draft if self.method == "draft_model" else None,
            max_speculative_tokens=self.max_speculative_tokens,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            kv_cache_space_gib=self.kv_cache_space_gib,
            # unset: EngineConfig's own defaults (the host name, the default classifier)
            **{k: v for k, v in {"instance_id": self.instance_id, "classifier": self.classifier}.items() if v},
            prompt_sample_rate=self.prompt_sample_rate,
            vllm_args=list(vllm_args or []),
            initial=RuntimeSettings(
                speculation_enabled=self.num_speculative_tokens > 0,
                num_speculative_tokens=self.num_speculative_tokens,
            ),
        )
