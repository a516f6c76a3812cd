"""Fidelity audit: does speculation change what the target would have said?

A greedy request chosen by the policy's ``audit_fraction`` is served as
usual, with the target's top-2 logprobs kept per generated token, then
replayed in the background as a plain request (``spectune_plain``: it never
drafts) and the two compared token by token (``compare``, pure):

* every served token must be the target's argmax in its own run (its logprob
  equal to the best at that position, ties included -- vLLM's rank counts
  ties as higher, so a tied token has rank 2): a speculative step that emits
  anything else broke the lossless rule, whatever the replay says;
* at the first position where the two runs differ, the target's margin
  between its top-2 tokens is read in both runs.  Both below
  ``near_tie_nats`` is a numeric near-tie (a different batch shape rounds
  two almost equal logits the other way: the demo pair in bf16 diverged only
  at margins of 0 and 0.125 nats, where the median margin over all positions
  was 3.4); either run confident is a defect.

After the first divergence the continuations differ and are not compared.
"""

from __future__ import annotations

import copy
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .schema import NEAR_TIE_NATS, PLAIN_ARG, FidelityRecord, RuntimeSettings
from .sinks import fan_out

if TYPE_CHECKING:
    from .core import SpecEngine

log = logging.getLogger(__name__)

Result = Literal["match", "near_tie", "defect"]
AUDIT_LOGPROBS = 2  # top-2 per position: the margin needs the runner-up
MAX_REPLAYS = 2  # replays in flight at once, by default; a request chosen beyond that is not audited (counted)
# A bf16 logit of magnitude 16-32 moves in steps of 0.125: two ulps of slack above the ties measured.
# Argmax and logprobs come from the same logits: a correct greedy token is exactly the best.
ARGMAX_SLACK_NATS = 1e-4


@dataclass
class Trace:
    """One run's generated tokens with, per token, how far its logprob is below the best at that
    position (0 for the argmax) and the top-2 margin (nats)."""

    tokens: list[int] = field(default_factory=list)
    gaps: list[float | None] = field(default_factory=list)
    margins: list[float | None] = field(default_factory=list)

    def observe(self, completion: Any, deltas: bool) -> None:
        """One of vLLM's ``CompletionOutput`` (choice 0) with logprobs asked for."""
        if not deltas:  # a cumulative output repeats what came before
            self.tokens, self.gaps, self.margins = [], [], []
        positions = completion.logprobs or []
        if len(positions) != len(completion.token_ids):
            raise ValueError(f"{len(completion.token_ids)} tokens but {len(positions)} logprob positions")
        for token, position in zip(completion.token_ids, positions, strict=True):
            self.tokens.append(token)
            logprobs = {t: lp.logprob for t, lp in position.items()}
            chosen = logprobs.get(token)
            self.gaps.append(None if chosen is None else max(logprobs.values()) - chosen)
            self.margins.append(top2_margin(logprobs))


def top2_margin(logprobs: dict[int, float]) -> float | None:
    """Best minus second-best logprob at one position (None with fewer than two)."""
    best = sorted(logprobs.values(), reverse=True)[:2]
    return best[0] - best[1] if len(best) == 2 else None


@dataclass(frozen=True)
class Verdict:
    result: Result
    compared_tokens: int
    diverged_at: int | None = None
    served_margin: float | None = None
    plain_margin: float | None = None
    served_gap: float | None = None
    reason: str = ""


def compare(served: Trace, plain: Trace, near_tie_nats: float = NEAR_TIE_NATS) -> Verdict:
    """The served run against its plain replay (see the module docstring)."""
    common = min(len(served.tokens), len(plain.tokens))
    diverged = next((k for k in range(common) if served.tokens[k] != plain.tokens[k]), None)
    checked = common if diverged is None else diverged + 1
    for k in range(checked):
        gap = served.gaps[k]
        if gap is not None and gap > ARGMAX_SLACK_NATS:
            return Verdict(
                "defect",
                checked,
                k,
                _at(served.margins, k),
                _at(plain.margins, k),
                gap,
                f"served token {k} is {gap:.3f} nats below the target's best in its own run (greedy takes the argmax)",
            )
    if diverged is None:
        return Verdict("match", checked, reason=f"{checked} tokens equal")
    served_margin, plain_margin = _at(served.margins, diverged), _at(plain.margins, diverged)
    margins = [m for m in (served_margin, plain_margin) if m is not None]
    tie = bool(margins) and max(margins) < near_tie_nats
    why = (
        f"first difference at token {diverged}: target's top-2 margin {_nats(served_margin)} served, "
        f"{_nats(plain_margin)} plain ({'<' if tie else '>='} {near_tie_nats} nats)"
    )
    return Verdict(
        "near_tie" if tie else "defect",
        checked,
        diverged,
        served_margin,
        plain_margin,
        served.gaps[diverged],
        why,
    )


def auditable(params: Any) -> bool:
    """Greedy, one choice, and logprobs either not asked for or at least the audit's top-2
    (raising a client's own top-k would change what it gets back)."""
    greedy = params.temperature < 1e-5 or params.top_k == 1
    asked = params.logprobs
    return greedy and params.n == 1 and (asked is None or asked >= AUDIT_LOGPROBS)


def _at(values: Sequence[float | None], k: int) -> float | None:
    return values[k] if k < len(values) else None


def _nats(margin: float | None) -> str:
    return "unknown" if margin is None else f"{margin:.3f}"


class Auditor:
    """Chooses the requests to audit and replays them plain in the background.

    The replay goes through ``SpecEngine.serve`` without a record of its own
    (it would count as plain traffic in the statistics) at normal priority:
    vLLM's priority scheduling is not on, so the load is bounded by the
    audit fraction and ``max_replays`` instead.
    """

    def __init__(self, engine: SpecEngine, max_replays: int = MAX_REPLAYS) -> None:
        self.engine = engine
        self.max_replays = max_replays
        self.in_flight = 0
        self.skipped = 0  # chosen while max_replays were running
        self.failed = 0  # replays that errored (no verdict)

    def choose(self, prompt_class: str, params: Any, n_now: int, settings: RuntimeSettings) -> Trace | None:
        """A trace to fill when this request is audited (its params then ask for top-2 logprobs)."""
        fraction = settings.audit_fraction_for(prompt_class)
        if n_now == 0 or not fraction or random.random() >= fraction or not auditable(params):
            return None
        params.logprobs = max(params.logprobs or 0, AUDIT_LOGPROBS)
        return Trace()

    def finished(self, prompt: Any, params: Any, prompt_class: str, record_id: str, served: Trace, n_now: int) -> None:
        """The audited request ended normally: replay it plain and compare."""
        if self.in_flight >= self.max_replays:
            self.skipped += 1
            return
        self.in_flight += 1
        settings, method = self.engine.settings, self.engine.active_config.method  # as served, not as replayed
        self.engine.spawn(self._replay(prompt, params, prompt_class, record_id, served, n_now, settings, method))

    async def _replay(
        self,
        prompt: Any,
        params: Any,
        prompt_class: str,
        record_id: str,
        served: Trace,
        n_now: int,
        settings: RuntimeSettings,
        method: str,
    ) -> None:
        from vllm.sampling_params import RequestOutputKind

        try:
            plain_params = copy.copy(params)
            plain_params.output_kind = RequestOutputKind.FINAL_ONLY
            plain_params.logprobs = AUDIT_LOGPROBS
            plain_params.extra_args = {**(params.extra_args or {}), PLAIN_ARG: True}
            plain = Trace()
            stream = self.engine.serve(
                prompt, plain_params, f"{record_id}-audit", prompt_class=prompt_class, record=False
            )
            async for output in stream:
                plain.observe(output.outputs[0], deltas=False)
            verdict = compare(served, plain, settings.near_tie_nats)
        except Exception:
            self.failed += 1
            log.warning("fidelity replay of %s failed", record_id, exc_info=True)
            return
        finally:
            self.in_flight -= 1
        if verdict.result == "defect":
            log.error("fidelity defect in %s: %s", record_id, verdict.reason)
        fan_out(
            self.engine.sinks,
            FidelityRecord(
                request_id=record_id,
                instance_id=self.engine.config.instance_id,
                prompt_class=prompt_class,
                checked_at=time.time(),
                speculation_method=method,
                num_speculative_tokens=n_now,
                result=verdict.result,
                compared_tokens=verdict.compared_tokens,
                diverged_at=verdict.diverged_at,
                served_margin=verdict.served_margin,
                plain_margin=verdict.plain_margin,
                served_gap=verdict.served_gap,
                reason=verdict.reason,
            ),
        )
