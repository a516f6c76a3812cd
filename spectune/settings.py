"""Process settings (environment variables ``SPECTUNE_*`` or CLI flags)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from spectune.api.auth import TokenSpec
from spectune.engine.classifier import PromptClassifier
from spectune.engine.schema import SpeculationMethod


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECTUNE_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    model: str | None = Field(default=None, description="Target HF directory; default: demo pair")
    draft_model: str | None = None
    method: SpeculationMethod = "draft_model"
    num_speculative_tokens: int = Field(default=3, ge=0, le=16, description="N in force at start")
    max_speculative_tokens: int = Field(default=6, ge=1, le=16, description="N capacity")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "bfloat16"
    max_model_len: int = Field(default=2048, ge=16)
    max_num_seqs: int = Field(default=16, ge=1)
    kv_cache_space_gib: int = Field(default=2, ge=1)
    instance_id: str | None = None
    db: str = Field(
        default="sqlite:///var/spectune.db", description="SQLAlchemy URL; postgresql+psycopg://... in production"
    )
    spool_dir: Path = Path("var/spool")
    records_path: Path | None = Field(default=None, description="Also append records as JSON lines here")
    retention_days: float = Field(default=7.0, gt=0, description="Request records older than this are deleted")
    sums_retention_days: float = Field(
        default=400.0, gt=0, description="Sums of records per minute/hour/day (every count) older than this are deleted"
    )
    tuner_interval_s: float = Field(default=60.0, gt=0, description="How often the tuner decides")
    tuner_window_s: float = Field(default=300.0, gt=0, description="How far back the tuner looks for acceptance")
    tuner_cost_window_s: float = Field(
        default=3600.0, gt=0, description="How far back the tuner looks for step times (the cost model)"
    )
    prompt_sample_rate: float = Field(
        default=0.0, ge=0.0, le=1.0, description="Opt-in: fraction of prompts kept for diagnostics"
    )
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
    no_engine: bool = False
    control_plane_url: str | None = Field(
        default=None, description="Follow this control plane's policy instead of the local one"
    )
    control_plane_token: SecretStr | None = None
    classifier: PromptClassifier | None = Field(
        default=None,
        description="Start-up prompt classes and rules (JSON); a policy's `classifier` replaces them fleet-wide",
    )
