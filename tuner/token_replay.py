"""Exact replay of a token-level proposer (ngram) on a greedy continuation (pure).

Under greedy decoding the target's output does not depend on speculation, so
what a token-level proposer would have drafted, and how much of it the target
would have accepted, follows from the prompt and the target's continuation
alone: at each verify step the proposer looks at the tokens so far, drafts up
to N, the target accepts the longest prefix that equals its own next tokens
and adds one of its own.  This is the acceptance per position a what-if
across methods needs for ngram, without serving a single request with it.

``ngram_proposal`` is vLLM 0.32's prompt-lookup rule
(``vllm/v1/spec_decode/ngram_proposer.py``): the longest n-gram with
``min_n <= n <= max_n`` that matches the context's suffix, at its earliest
occurrence, and the up to ``k`` tokens that followed it.  The engine test in
``tests/test_token_replay.py`` checks the replay against the counts vLLM
itself reports.

``replay_suffix`` does the same for suffix decoding (vLLM 0.32's
``SuffixDecodingProposer`` over arctic-inference's trees, run as spectune runs
it: at its capacity, the drafts cut to the step's N).  Its global tree holds
earlier responses, so a replay covers a sequence of requests served one after
another from empty trees; ``tests/test_suffix_method.py`` checks it against a
suffix engine's records.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def ngram_proposal(context: Sequence[int], min_n: int, max_n: int, k: int, max_model_len: int) -> list[int]:
    """The draft vLLM's ngram proposer makes after ``context`` (empty when nothing matches)."""
    total = len(context)
    k = min(k, max_model_len - total)
    if total < min_n or k <= 0:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = list(context[total - n :])
        for start in range(0, total - n):  # earliest occurrence, the suffix itself excluded
            if list(context[start : start + n]) == suffix:
                follow = start + n
                return list(context[follow : follow + min(k, total - follow)])
    return []


@dataclass(frozen=True)
class Replayed:
    drafted_per_position: list[int]
    accepted_per_position: list[int]
    verify_steps: int

    @property
    def acceptance(self) -> float | None:
        drafted = sum(self.drafted_per_position)
        return sum(self.accepted_per_position) / drafted if drafted else None


def replay_ngram(
    prompt: Sequence[int],
    continuation: Sequence[int],
    max_tokens: int,
    n: int,
    min_n: int,
    max_n: int,
    max_model_len: int,
    ended: bool = False,
) -> Replayed:
    """Drafts and acceptances per position of ngram at N = ``n`` on a request of ``max_tokens``.

    ``continuation`` is the target's greedy output; it must reach ``max_tokens + n`` tokens unless
    the sequence ``ended`` there (end of sequence, model length), so that the last verify step,
    whose drafts may run past ``max_tokens``, is judged on what the target would have said.
    """

    def propose(produced: int, _sampled: list[int]) -> list[int]:
        return ngram_proposal([*prompt, *continuation[:produced]], min_n, max_n, n, max_model_len)

    return _replay(continuation, max_tokens, n, ended, propose)[0]


def _replay(
    continuation: Sequence[int], max_tokens: int, n: int, ended: bool, propose: Any
) -> tuple[Replayed, list[int]]:
    """Verify steps of one greedy request: ``propose(produced, sampled)`` drafts after ``produced``
    tokens, ``sampled`` being the last step's new tokens; the target accepts the longest prefix that
    equals its continuation and adds one token of its own.  Also returns the last step's tokens."""
    if not ended and len(continuation) < max_tokens + n:
        raise ValueError(f"continuation of {len(continuation)} tokens: need max_tokens + n = {max_tokens + n}")
    drafted, accepted = [0] * n, [0] * n
    steps = 0
    produced, sampled = 1, list(continuation[:1])  # the prefill step's token
    limit = min(max_tokens, len(continuation))
    while produced < limit:
        draft = propose(produced, sampled)
        ahead = continuation[produced : produced + len(draft)]
        matched = next((i for i, (d, t) in enumerate(zip(draft, ahead, strict=False)) if d != t), len(ahead))
        if draft:
            steps += 1
            for j in range(len(draft)):
                drafted[j] += 1
            for j in range(matched):
                accepted[j] += 1
        sampled = list(continuation[produced : produced + matched + 1])
        produced += matched + 1
    return Replayed(drafted, accepted, steps), sampled


@dataclass(frozen=True)
class SuffixSettings:
    """vLLM's suffix-decoding settings (its defaults) and the engine's N capacity."""

    capacity: int
    max_model_len: int
    max_tree_depth: int = 24
    max_cached_requests: int = 10_000
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1


def replay_suffix(
    requests: Sequence[tuple[Sequence[int], Sequence[int], int, bool]], n: int, settings: SuffixSettings
) -> list[Replayed]:
    """Drafts and acceptances per position of suffix decoding at N = ``n`` on ``requests`` --
    (prompt, greedy continuation, max_tokens, ended) as for ``replay_ngram`` -- served one after
    another at batch 1, from empty trees (needs arctic-inference)."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(
        max_tree_depth=settings.max_tree_depth, max_cached_requests=settings.max_cached_requests
    )
    return [_suffix_request(cache, f"replay-{i}", *request, n, settings) for i, request in enumerate(requests)]


def _suffix_request(
    cache: Any,
    request_id: str,
    prompt: Sequence[int],
    continuation: Sequence[int],
    max_tokens: int,
    ended: bool,
    n: int,
    settings: SuffixSettings,
) -> Replayed:
    """One request through ``cache`` as ``SuffixDecodingProposer.propose`` feeds it, step by step."""
    cache.start_request(request_id, list(prompt))

    def propose(produced: int, sampled: list[int]) -> list[int]:
        cache.add_active_response(request_id, sampled)  # vLLM adds each step's tokens, then speculates
        tokens = [*prompt, *continuation[:produced]]
        draft = cache.speculate(
            request_id,
            tokens[max(0, len(tokens) - settings.max_tree_depth) :],
            max_spec_tokens=min(settings.capacity, settings.max_model_len - len(tokens) - 1),
            max_spec_factor=settings.max_spec_factor,
            min_token_prob=settings.min_token_prob,
        )
        return list(draft.token_ids)[:n]  # spectune runs the proposer at capacity and cuts to N

    replayed, last = _replay(continuation, max_tokens, n, ended, propose)
    cache.add_active_response(request_id, last)  # the last step's tokens, past max_tokens too
    cache.stop_request(request_id)
    return replayed
