"""The engine client vLLM's OpenAI layer talks to.

vLLM's serving classes take an ``EngineClient`` (``AsyncLLM`` in ``vllm
serve``) and call ``generate`` once per prompt.  ``SpectuneEngineClient`` is
that client for the embedded engine: ``generate`` goes through
``SpecEngine.serve`` (prompt class, N, one ``RequestRecord`` per request);
everything else is the running ``AsyncLLM``'s, looked up at each call, so a
managed rebuild swaps the engine underneath without rebuilding the API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .requests import REQUEST_CONTEXT, EngineUnavailableError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from .core import SpecEngine


class SpectuneEngineClient:
    def __init__(self, engine: SpecEngine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        llm = self._engine._llm
        if llm is None:
            raise EngineUnavailableError("engine is not running (starting or rebuilding)")
        return getattr(llm, name)

    @property
    def errored(self) -> bool:
        """A rebuild in progress is not an error (vLLM's handlers would stop the server on it)."""
        llm = self._engine._llm
        return llm is not None and llm.errored

    @property
    def is_running(self) -> bool:
        return self._engine.running

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any) -> AsyncIterator[Any]:
        # Read the HTTP request's context now: the stream may be iterated in another task.
        context = REQUEST_CONTEXT.get()
        record_id = request_id
        if context.single_prompt_completion and request_id.endswith("-0"):
            record_id = request_id[:-2]  # the response id: /api/v1/records/{id} finds it
        return self._engine.serve(
            prompt,
            sampling_params,
            request_id,
            prompt_class=context.prompt_class,
            record_id=record_id,
            admitted=context.admitted,
            **kwargs,
        )
