"""vLLM's arguments pass through `spectune serve` unchanged; speculation's stay spectune's (no engine)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spectune.engine import EngineConfig
from spectune.engine.vllm_args import VllmArgumentError, engine_args, server_args


def _config(*vllm_args: str, **kw) -> EngineConfig:
    return EngineConfig(model="/models/target", draft_model="/models/draft", vllm_args=list(vllm_args), **kw)


def test_pass_through_wins_over_spectune_defaults_and_reaches_vllm(tiny):
    args = server_args(
        _config(
            "--max-model-len", "1024", "--served-model-name", "coder", "--enable-auto-tool-choice",
            "--tool-call-parser", "hermes", "--chat-template", "{{ messages }}", "--gpu-memory-utilization", "0.5",
        ),
        api_key="k",
    )  # fmt: skip
    assert args.max_model_len == 1024 and args.served_model_name == ["coder"]
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    assert args.api_key == ["k"]
    real = {"model": str(tiny["target"]), "draft_model": str(tiny["copy"])}
    config = EngineConfig(**real, vllm_args=["--max-model-len", "1024"])
    engine = engine_args(config, server_args(config))
    assert engine.max_model_len == 1024 and engine.dtype == "bfloat16"
    assert engine.scheduler_cls.endswith("SpectuneScheduler") and engine.async_scheduling is False
    assert engine.speculative_config["model"] == str(tiny["copy"])
    assert engine.per_request_spec_decode_metrics == "detailed" and not engine.disable_log_stats


def test_spectune_options_without_pass_through():
    args = server_args(_config(max_model_len=333, dtype="float32", served_model_name="x"))
    assert (args.max_model_len, args.dtype, args.served_model_name, args.api_key) == (333, "float32", ["x"], None)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--speculative-config", '{"method": "ngram"}'], "--speculative-config (use --method"),
        (["--scheduler-cls", "x.Y"], "--scheduler-cls"),
        (["--async-scheduling"], "--async-scheduling"),
        (["--port", "9"], "spectune's --port"),
        (["--api-key", "k"], "SPECTUNE_OPENAI_API_KEY"),
        (["--max-model-lenn", "5"], "unrecognized arguments: --max-model-lenn"),
        (["--max-model-len", "many"], "--max-model-len"),
        (["other-model"], "pass the model as --model"),
    ],
)
def test_refused_with_what_to_do_instead(argv, message):
    with pytest.raises(VllmArgumentError) as info:
        server_args(_config(*argv))
    assert message in str(info.value)


def test_cli_fails_before_loading_a_model():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "spectune.cli",
            "serve",
            "--model",
            "/nonexistent",
            "--method",
            "none",
            "--speculative-config",
            "{}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "spectune sets these vLLM arguments itself" in out.stderr
