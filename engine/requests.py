"""What a request asks of spectune beyond vLLM: its prompt class.

Over HTTP the class comes from the body field ``spectune_class``, from
``vllm_xargs: {"spectune_class": ...}`` or from the ``X-Spectune-Class``
header (first of those that is set); ``engine/openai_server.py`` reads it and
hands it here in a context variable.  In-process callers use
``GenerationRequest`` (benchmarks, tests, the diagnosis job).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

CLASS_HEADER = "x-spectune-class"


@dataclass(frozen=True)
class RequestContext:
    """Set for the duration of one HTTP request."""

    prompt_class: str | None = None
    # A completions request with one prompt: vLLM names its engine request
    # "<response id>-0"; its record takes the response id itself.
    single_prompt_completion: bool = False
    admitted: bool = False  # held by SpecEngine.admitted() for the whole HTTP request


REQUEST_CONTEXT: contextvars.ContextVar[RequestContext] = contextvars.ContextVar(
    "spectune_request",
    default=RequestContext(),  # noqa: B039 (frozen)
)


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (an HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineUnavailableError(RuntimeError):
    """The engine is not running (an HTTP 503)."""


@dataclass(frozen=True)
class GenerationRequest:
    """An in-process request: a prompt and the usual sampling fields."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int | None = None  # None: the rest of the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_class: str | None = None
    request_id: str | None = None


def token_ids(req: GenerationRequest, tokenizer: Any, max_model_len: int) -> tuple[list[int], int]:
    """The prompt's token ids and the max_tokens to ask for, or InvalidRequestError."""
    if req.prompt_token_ids is not None:
        ids = list(req.prompt_token_ids)
    else:
        if not req.prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if len(req.prompt) > max_model_len * 32:  # before paying for tokenization
            raise InvalidRequestError(
                f"prompt of {len(req.prompt)} characters exceeds the model's context of {max_model_len} tokens",
                param="prompt",
            )
        ids = list(tokenizer.encode(req.prompt))
    if not ids:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    max_tokens = max_model_len - len(ids) if req.max_tokens is None else req.max_tokens
    if req.max_tokens is not None and max_tokens < 1:
        raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
    if len(ids) + max(max_tokens, 1) > max_model_len:
        raise InvalidRequestError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{len(ids)} and max_tokens asks for {max_tokens}",
            param="max_tokens" if req.max_tokens is not None else "prompt",
        )
    return ids, max_tokens


def sampling_params(req: GenerationRequest, max_tokens: int) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop=req.stop or None,
        ignore_eos=req.ignore_eos,
        logprobs=req.logprobs,
        output_kind=RequestOutputKind.DELTA,
    )
