"""The OpenAI request matrix both servers get (tests/test_openai_compat.py).

Each case: (name, path, body, prompts): a served request leaves one record per prompt
on spectune, a refused one none.
``MODEL`` is the served name both servers take (``--served-model-name``).
Greedy cases (temperature 0) must produce identical texts on both servers.
"""

from __future__ import annotations

MODEL = "tiny"
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "accept the draft"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    },
}
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
    },
}
SAMPLED = {"temperature": 0.8, "seed": 7}


def _c(**body):
    return {"model": MODEL, "prompt": "the model draft", "max_tokens": 12, "temperature": 0, **body}


def _m(**body):
    return {"model": MODEL, "messages": USER, "max_tokens": 12, "temperature": 0, **body}


# (name, path, body, prompts)
CASES: list[tuple[str, str, dict, int]] = [
    ("cmpl", CMPL, _c(), 1),
    ("cmpl-stream", CMPL, _c(stream=True), 1),
    ("cmpl-stream-usage", CMPL, _c(stream=True, stream_options={"include_usage": True}), 1),
    ("cmpl-logprobs", CMPL, _c(logprobs=2), 1),
    ("cmpl-echo", CMPL, _c(echo=True, max_tokens=4), 1),
    ("cmpl-prompt-logprobs", CMPL, _c(prompt_logprobs=1, max_tokens=4), 1),
    ("cmpl-n2", CMPL, _c(n=2, **SAMPLED), 1),
    ("cmpl-best-of", CMPL, _c(n=1, best_of=2, **SAMPLED), 1),
    ("cmpl-presence", CMPL, _c(presence_penalty=0.5), 1),
    ("cmpl-frequency", CMPL, _c(frequency_penalty=0.5), 1),
    ("cmpl-repetition", CMPL, _c(repetition_penalty=1.3), 1),
    ("cmpl-top-k", CMPL, _c(top_k=5, **SAMPLED), 1),
    ("cmpl-top-p", CMPL, _c(top_p=0.9, **SAMPLED), 1),
    ("cmpl-top-k-top-p", CMPL, _c(top_k=5, top_p=0.9, **SAMPLED), 1),
    ("cmpl-min-p", CMPL, _c(min_p=0.1, **SAMPLED), 1),  # vLLM: not with speculation, 400
    ("cmpl-logit-bias", CMPL, _c(logit_bias={"5": 10}), 1),  # vLLM: not with speculation, 400
    ("cmpl-stop", CMPL, _c(stop=["r"], include_stop_str_in_output=True), 1),
    ("cmpl-stop-token-ids", CMPL, _c(stop_token_ids=[5, 6, 7]), 1),
    ("cmpl-min-tokens", CMPL, _c(min_tokens=8, max_tokens=10, stop_token_ids=[5, 6, 7]), 1),
    ("cmpl-bad-words", CMPL, _c(bad_words=["the"]), 1),
    ("cmpl-allowed-tokens", CMPL, _c(allowed_token_ids=[10, 11, 12, 13]), 1),
    ("cmpl-ignore-eos", CMPL, _c(ignore_eos=True), 1),
    ("cmpl-batched", CMPL, _c(prompt=["the model", "a draft of", "verify"]), 3),
    ("cmpl-token-ids", CMPL, _c(prompt=[5, 6, 7, 8]), 1),
    ("cmpl-token-id-batch", CMPL, _c(prompt=[[5, 6, 7], [9, 10]]), 2),
    ("cmpl-structured", CMPL, _c(structured_outputs={"choice": ["yes", "no"]}), 1),
    ("chat", CHAT, _m(), 1),
    ("chat-stream", CHAT, _m(stream=True), 1),
    ("chat-stream-usage", CHAT, _m(stream=True, stream_options={"include_usage": True}), 1),
    ("chat-logprobs", CHAT, _m(logprobs=True, top_logprobs=2), 1),
    ("chat-n2", CHAT, _m(n=2, **SAMPLED), 1),
    ("chat-max-completion-tokens", CHAT, _m(max_completion_tokens=5), 1),
    ("chat-content-parts", CHAT, _m(messages=[{"role": "user", "content": [{"type": "text", "text": "a draft"}]}]), 1),
    (
        "chat-roles",
        CHAT,
        _m(
            messages=[
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "again"},
            ]
        ),
        1,
    ),
    ("chat-tools-auto", CHAT, _m(tools=[TOOL], tool_choice="auto"), 1),
    ("chat-tools-named", CHAT, _m(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "lookup"}}), 1),
    ("chat-tools-required", CHAT, _m(tools=[TOOL], tool_choice="required", max_tokens=40), 1),
    ("chat-tools-stream", CHAT, _m(tools=[TOOL], tool_choice="auto", stream=True), 1),
    ("chat-json-schema", CHAT, _m(response_format=SCHEMA, max_tokens=20), 1),
    ("chat-json-object", CHAT, _m(response_format={"type": "json_object"}, max_tokens=20), 1),
    ("chat-template-kwargs", CHAT, _m(chat_template_kwargs={"add_generation_prompt": True}), 1),
    ("chat-top-k", CHAT, _m(top_k=5, **SAMPLED), 1),
    ("chat-penalties", CHAT, _m(presence_penalty=0.3, frequency_penalty=0.3, repetition_penalty=1.1), 1),
    # bad input: the same answer as vLLM's (mostly 4xx; a custom role is served)
    ("bad-empty-prompt", CMPL, _c(prompt=""), 1),
    ("bad-max-tokens-0", CMPL, _c(max_tokens=0), 1),
    ("bad-max-tokens-negative", CMPL, _c(max_tokens=-5), 1),
    ("bad-max-tokens-huge", CMPL, _c(max_tokens=100_000), 1),
    ("bad-temperature", CMPL, _c(temperature=-0.5), 1),
    ("bad-top-p-0", CMPL, _c(top_p=0), 1),
    ("bad-top-p-big", CMPL, _c(top_p=1.5), 1),
    ("bad-prompt-too-long", CMPL, _c(prompt="the draft " * 400), 1),
    ("bad-model", CMPL, _c(model="gpt-4"), 1),
    ("bad-n-type", CMPL, _c(n="two"), 1),
    ("bad-messages-empty", CHAT, _m(messages=[]), 1),
    ("bad-role", CHAT, _m(messages=[{"role": "wizard", "content": "hi"}]), 1),
    ("bad-tool-choice-unknown", CHAT, _m(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "x"}}), 1),
]
assert len(CASES) >= 30
