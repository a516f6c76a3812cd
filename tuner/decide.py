"""One class's decision from its measurements (pure).

Inputs: the effective policy, per-position draft counts from the records,
the cost ratio, and what is in force.  Output: keep, set N, switch off (and
ask for a diagnosis) or switch back on -- with the predicted speedup and the
reason.  Acceptance alone never switches a class off: predicted speedup
below 1 must agree.  The class-level decision is made at the busiest batch
bucket; a draft that is merely too dear there switches the class off only
when it pays at no other bucket (``pays_elsewhere``).  ``decide_batch_table``
then sets N per batch bucket, which is where "off at high batch" comes from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from spectune.engine.schema import BatchRange, n_for_batch
from spectune.store.aggregates import ArmLatency

from .cost import CostFit
from .goodput import (
    MIN_TRIALS,
    PositionAcceptance,
    bucket_sizes,
    choose_n,
    position_acceptance,
    speedup,
    stay_margin,
    unmeasured,
)
from .paired_cost import RatioEstimate
from .policy import MAX_BATCH, Policy, overlay

# explore, cost_probe and reprobe are measurements: they do not start a cooldown.  guard: the
# speedup measured against plain is below 1 where the class drafts; it acts even in a cooldown.
Action = Literal["keep", "set_n", "explore", "off", "on", "set_table", "cost_probe", "reprobe", "guard"]
# {bucket: {N: tokens/s at N over plain tokens/s, from paired minutes}} (``paired_cost.paired_speedup``).
Measured = dict[int, dict[int, RatioEstimate]]
MIN_DRAFTS = MIN_TRIALS  # below this many first-position trials the prior dominates: decide nothing
MIN_LATENCY_REQUESTS = 20  # an arm's p95 is read from at least this many requests (rank 19 of 20)


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
    policy: Policy,
    drafted: list[int],
    accepted: list[int],
    cost: float | CostFit,
    reprobe_margin: float = 0.1,
    pays_elsewhere: bool = False,
    estimate: PositionAcceptance | None = None,
) -> ClassDecision:
    """``estimate``: the per-position acceptance to decide on where the caller has one (the job's,
    continued with the cost window's by ``goodput.remembered``); else from ``drafted`` / ``accepted``."""
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
    est = estimate if estimate is not None else position_acceptance(drafted, accepted)
    alphas = list(est.mean)
    rate = sum(accepted) / max(1, sum(drafted))
    here = speedup(alphas, current, cost)
    choice = choose_n(
        alphas,
        cost,
        current if enabled else 0,
        policy.n_min,
        policy.n_max,
        min_gain=policy.min_gain,
        max_step=2,
        explore_margin=policy.explore_margin,
        position_samples=est.samples,
    )
    if not enabled:
        # Off: data come from probe requests. Back on only with margin, at the best N, and only where
        # the lower bound of its speedup (paired cost interval) beats plain too: first, do no harm.
        best, low = choice.best_n, choice.best_low
        pays = best > 0 and choice.best_speedup > 1 + reprobe_margin
        if pays and (low is None or low > 1):
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
        why = "still does not pay"
        if pays:  # its lower bound is what kept it off
            why = f"probes predict {choice.best_speedup:.2f}x at N={best}, but its lower bound {low:.2f}x: stay off"
        return ClassDecision("keep", False, current, choice.best_speedup, rate, False, why)
    # Off only when no N pays here; a draft that merely accepts less runs at a smaller N instead.
    if here < 1.0 and choice.best_n == 0 and (rate < policy.acceptance_floor or not pays_elsewhere):
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
        action: Action = "explore" if choice.explore else "set_n"
        return ClassDecision(action, True, choice.n, choice.predicted_speedup, rate, False, choice.reason)
    return ClassDecision("keep", True, current, here, rate, False, choice.reason)


def exploring(
    n: int, cost: float | CostFit, position_samples: Sequence[int], held_s: float, hold_s: float
) -> str | None:
    """Why an explored N in force is held -- None once measured (``goodput.unmeasured``: its step time
    and its last position's trials) or held ``hold_s``.  Deciding after one interval decides on the
    model's extrapolation of N again, not on N: where traffic is slow, one interval measures a few
    steps (live, 2026-12-06: N explored 3 -> 2 -> 3 -> 2 at 30 s spacing, none of it measured)."""
    if not isinstance(cost, CostFit) or held_s >= hold_s or not unmeasured(n, cost, position_samples):
        return None
    trials = position_samples[n - 1] if n <= len(position_samples) else 0
    step = "step time measured" if n in cost.measured else "step time not measured yet"
    return (f"exploring N={n} ({held_s:.0f} s of at most {hold_s:.0f} s): position {n} has {trials} of "
            f"{MIN_TRIALS} trials, {step}")  # fmt: skip


def exploration_unpaid(
    budget: float, loss: float | None, held_s: float, since_s: float, spacing_s: float = 0.0
) -> str | None:
    """Why the class may not explore now -- None where it may.

    Exploring an unmeasured N may cost at most ``budget`` of the class's tokens/s: the last
    exploration began ``since_s`` ago and ran ``held_s`` seconds at ``loss`` below the N it
    replaced (``goodput.exploration_loss``; ``loss`` None: there was none).  The budget repays it at
    ``budget`` per second from when it began, so the next may start once
    budget x since_s >= loss x held_s: an exploration that cost nothing is repaid at once, one that
    lost 5 % for a minute after 2.5 minutes at a 2 % budget.  Nor sooner than ``spacing_s`` after
    the last began.  A budget of 0 never explores."""
    if budget <= 0:
        return "explore_budget is 0"
    if loss is None:
        return None
    if since_s < spacing_s:
        return f"the last exploration began {since_s:.0f} s ago (at most one per {spacing_s:.0f} s)"
    wait = loss * held_s / budget - since_s
    if wait <= 0:
        return None
    return (f"the next exploration waits {wait:.0f} s: the last one cost {loss:.1%} for {held_s:.0f} s, "
            f"repaid at the explore_budget of {budget * 100:g} %")  # fmt: skip


def below_plain(measured: Measured, bucket: int, n: int) -> RatioEstimate | None:
    """The measured speedup of N at ``bucket`` where even its upper bound is below plain, else None.
    Measured beats modelled: whatever the goodput model predicts, N does not run there."""
    est = measured.get(bucket, {}).get(n) if n > 0 else None
    return est if est is not None and est.high < 1 else None


def guard(
    policy: Policy, measured: Measured, bucket: int | None, acceptance: float | None
) -> tuple[ClassDecision, list[BatchRange]] | None:
    """First, do no harm, measured: where the class drafts at ``bucket`` and serving there at that N
    measured slower than plain in the same minutes (upper bound of its interval below 1), that
    bucket runs plain from the next interval -- cooldown or not.  None where it does not apply."""
    if bucket is None or not policy.speculation_enabled:
        return None
    n = n_for_batch(policy.batch_table, bucket, policy.num_speculative_tokens)
    est = below_plain(measured, bucket, n)
    if est is None:
        return None
    table = with_bucket(policy, bucket, 0)
    why = (
        f"guard: N={n} at batch bucket {bucket} measured {est.ratio:.2f}x of plain (90 % interval "
        f"{est.low:.2f}-{est.high:.2f}x, {est.minutes} paired minutes): that bucket runs plain"
    )
    decision = ClassDecision("guard", True, policy.num_speculative_tokens, 1.0, acceptance, False, why)
    return decision, table


def ttft_over_budget(budget_s: float | None, arms: dict[bool, ArmLatency]) -> str | None:
    """Why a class's speculation breaks its TTFT budget (p95 of its speculating requests above it), or
    None: no budget, too few speculating requests to say, within it, or plain requests measured no
    faster to the first token (then speculation is not what breaks it: the load is)."""
    spec, plain = arms.get(True), arms.get(False)
    if budget_s is None or spec is None or spec.requests < MIN_LATENCY_REQUESTS:
        return None
    p95 = spec.ttft_s.get("p95")
    if p95 is None or p95 <= budget_s:
        return None
    base = plain.ttft_s.get("p95") if plain is not None and plain.requests >= MIN_LATENCY_REQUESTS else None
    if base is not None and base >= p95:
        return None
    beside = "no plain requests to compare" if base is None else f"plain {base:.2f} s"
    return f"TTFT budget: p95 {p95:.2f} s while speculating ({spec.requests} requests) > {budget_s:.2f} s ({beside})"


def ttft_guard(
    policy: Policy, over: str | None, acceptance: float | None
) -> tuple[ClassDecision, list[BatchRange]] | None:
    """A speculating class over its TTFT budget (``over``: ``ttft_over_budget``'s reason) runs plain
    from the next interval, cooldown or not.  None where it does not apply."""
    if over is None or not policy.speculation_enabled:
        return None
    return ClassDecision("off", False, policy.num_speculative_tokens, 1.0, acceptance, False, over), policy.batch_table


def drafts_at(policy: Policy, bucket: int) -> bool:
    """Whether a class's table drafts at ``bucket`` (an off class's probes obey it too)."""
    return n_for_batch(policy.batch_table, bucket, policy.num_speculative_tokens) > 0


def open_for_probes(policy: Policy, bucket: int) -> list[BatchRange]:
    """An off class's table with ``bucket`` at the class N, for when nothing of the draft in force
    is measured.  Its probes obey the table (at 8 concurrent one probe makes the drafter run over the
    whole batch), so an N = 0 there, decided while another draft was in force (it did not pay at
    the busiest bucket, then the class went off), would keep every probe plain and the class off
    for good.  Entries equal to the class N are dropped, as ``decide_batch_table`` does."""
    if policy.num_speculative_tokens == 0:
        return policy.batch_table  # probes at N = 0 measure nothing wherever they run
    return with_bucket(policy, bucket, policy.num_speculative_tokens)


def with_bucket(policy: Policy, bucket: int, n: int) -> list[BatchRange]:
    """The class's table with ``bucket``'s batch sizes at N = ``n``; entries equal to the class N
    are dropped (the class N covers them)."""
    lo, hi = bucket_sizes(bucket)
    table = overlay([BatchRange(min_batch=lo, max_batch=hi, num_speculative_tokens=n)], policy.batch_table)
    return [e for e in table if e.num_speculative_tokens != policy.num_speculative_tokens]


def decide_batch_table(
    policy: Policy,
    alphas: list[float],
    costs: dict[int, CostFit],
    class_n: int,
    cost_probes: set[int] = frozenset(),
    class_bucket: int | None = None,
    on_margin: float = 0.1,
    measured: Measured | None = None,
) -> list[BatchRange]:
    """N per batch bucket from the goodput model, as a batch-size table.

    Buckets with a cost model (fitted or borrowed) get the goodput argmax,
    with hysteresis against what runs there now; buckets on the prior alone
    keep their entry; ``cost_probes`` run at N=0 for one interval.  A bucket
    that runs plain goes back on from a borrowed cost model only for a
    predicted gain of ``on_margin`` (off costs nothing; a borrowed model
    guesses).  ``class_bucket`` (the busiest) runs the class N, decided by
    ``decide_class``, where that pays (once on: by the stay margin), else plain.  Entries equal to the class
    N are dropped.  Batches above every measured bucket run plain until their
    steps are measured (verification only gets dearer with batch size, and the
    plain steps there are what the model needs); so does every batch above a
    top bucket at N=0.  A bucket where an N measured slower than plain (``below_plain``) runs
    plain rather than at that N.
    """
    current = policy.batch_table
    decided: dict[int, int] = {}
    for bucket, cost in costs.items():
        here = n_for_batch(current, bucket, class_n)
        gain = policy.min_gain if here > 0 or cost.source == "fit" else max(policy.min_gain, on_margin)
        if bucket in cost_probes:
            decided[bucket] = 0
        elif bucket == class_bucket:
            keep_above = 1 + (stay_margin(policy.min_gain) if here > 0 else gain)
            decided[bucket] = class_n if speedup(alphas, class_n, cost) >= keep_above else 0
        elif cost.source != "prior":
            decided[bucket] = choose_n(alphas, cost, here, policy.n_min, policy.n_max, min_gain=gain).n
        if measured and below_plain(measured, bucket, decided.get(bucket, 0)) is not None:
            decided[bucket] = 0
    new: list[BatchRange] = []
    for bucket, n in decided.items():
        lo, hi = bucket_sizes(bucket)
        new.append(BatchRange(min_batch=lo, max_batch=hi, num_speculative_tokens=n))
    top = max(costs, default=None)
    if top is not None and bucket_sizes(top)[1] < MAX_BATCH:
        if decided.get(top) == 0 and top not in cost_probes:
            new = [e for e in new if e.min_batch != bucket_sizes(top)[0]]
            new.append(BatchRange(min_batch=bucket_sizes(top)[0], max_batch=MAX_BATCH, num_speculative_tokens=0))
        else:
            new.append(BatchRange(min_batch=bucket_sizes(top)[1] + 1, max_batch=MAX_BATCH, num_speculative_tokens=0))
    table = overlay(new, current)
    return [e for e in table if e.num_speculative_tokens != class_n]
