"""One class's decision from its measurements (pure).

Inputs: the effective policy, per-position draft counts from the records,
the cost ratio, and what is in force.  Output: keep, set N, switch off (and
ask for a diagnosis) or switch back on -- with the predicted speedup and the
reason.  Acceptance alone never switches a class off: predicted speedup
below 1 must agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .goodput import choose_n, position_acceptance, speedup
from .policy import Policy

Action = Literal["keep", "set_n", "off", "on"]
MIN_DRAFTS = 30  # below this many first-position trials the prior dominates: decide nothing


@dataclass(frozen=True)
class ClassDecision:
    action: Action
    enabled: bool
    n: int
    predicted_speedup: float | None
    acceptance: float | None
    diagnose: bool
    reason: str


def decide_class(
    policy: Policy, drafted: list[int], accepted: list[int], cost_ratio: float, reprobe_margin: float = 0.1
) -> ClassDecision:
    enabled, current = policy.speculation_enabled, policy.num_speculative_tokens
    if not drafted or drafted[0] < MIN_DRAFTS:
        return ClassDecision(
            "keep",
            enabled,
            current,
            None,
            None,
            False,
            f"too little data ({drafted[0] if drafted else 0} drafts < {MIN_DRAFTS}): policy stands",
        )
    est = position_acceptance(drafted, accepted)
    alphas = list(est.mean)
    rate = sum(accepted) / max(1, sum(drafted))
    here = speedup(alphas, current, cost_ratio)
    choice = choose_n(
        alphas, cost_ratio, current if enabled else 0, policy.n_min, policy.n_max, min_gain=policy.min_gain, max_step=2
    )
    if not enabled:
        # Off: data come from probe requests. Back on only with margin, at the best N.
        best = choice.best_n
        if best > 0 and choice.best_speedup > 1 + reprobe_margin:
            n = max(policy.n_min, min(best, policy.n_max))
            return ClassDecision(
                "on",
                True,
                n,
                choice.best_speedup,
                rate,
                False,
                f"probes predict {choice.best_speedup:.2f}x at N={n} (> 1 + {reprobe_margin:.0%})",
            )
        return ClassDecision("keep", False, current, choice.best_speedup, rate, False, "still does not pay")
    if here < 1.0 and (rate < policy.acceptance_floor or choice.best_n == 0):
        low = rate < policy.acceptance_floor
        why = f"acceptance {rate:.0%} < floor {policy.acceptance_floor:.0%} and " if low else ""
        return ClassDecision(
            "off",
            False,
            current,
            here,
            rate,
            low,
            f"{why}predicted speedup {here:.2f}x < 1 at N={current}: speculation off",
        )
    if choice.n != current and choice.n > 0:
        return ClassDecision("set_n", True, choice.n, choice.predicted_speedup, rate, False, choice.reason)
    return ClassDecision("keep", True, current, here, rate, False, choice.reason)
