"""Draft diagnosis: why does the draft disagree with the target?

Target and draft run teacher-forced (HF transformers, the same weights the
engine serves) on the target's own greedy continuation of each prompt.  Per
continuation token t we get the target's p_t and the draft's q_t and compute:

* expected acceptance  sum_x min(p_t, q_t) = 1 - TV(p_t, q_t)  (noise-free,
  unlike counting accepts), and greedy agreement (argmax equal);
* KL(p_t || q_t);
* per-position expected acceptance of a speculative block: the chance that
  draft position k is accepted, mean over block starts of
  prod_{i<=k} overlap_{t+i} -- comparable to the records' accepted/drafted
  per position;
* the tokens and contexts where the two disagree most;
* per-layer attention entropy of target and draft;
* the draft/target per-token latency ratio against the 0.6 rule of thumb.

``findings`` turns the numbers into plain-language conclusions.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

LATENCY_RULE = 0.6


@dataclass
class DiagnosisInput:
    target: str
    draft: str
    prompts: list[tuple[str, str]]  # (prompt class, prompt text)
    max_new_tokens: int = 32
    positions: int = 5
    realised_per_position: dict[str, list[float]] = field(default_factory=dict)  # class -> accepted/drafted
    cpu_share: float = 1.0  # the busy share the diagnosis may take of its core (DutyCycle); 1.0 = unthrottled


class DutyCycle:
    """Keeps a worker's busy share of the wall clock at most ``share``: after each unit of work,
    ``pause`` sleeps busy * (1 - share) / share.  A low ``nice`` yields a core only to a process that
    wants that same core; beside an engine whose threads span every core it still takes cores and
    memory bandwidth, and only idling bounds what it takes."""

    def __init__(self, share: float, clock: Callable[[], float] = time.perf_counter, sleep=time.sleep) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"cpu share must be in (0, 1], got {share}")
        self.share, self.clock, self.sleep = share, clock, sleep
        self.busy_s = self.idle_s = 0.0
        self._since = clock()

    def pause(self) -> None:
        busy = self.clock() - self._since
        self.busy_s += busy
        if self.share < 1:
            idle = busy * (1 - self.share) / self.share
            self.sleep(idle)
            self.idle_s += idle
        self._since = self.clock()


class _PacedStreamer:
    """A ``generate`` streamer that paces decoding: ``put`` is called once per generated token."""

    def __init__(self, pace: DutyCycle) -> None:
        self.pace = pace

    def put(self, value: Any) -> None:
        self.pace.pause()

    def end(self) -> None:
        self.pace.pause()


def _entropy_per_layer(attentions: Sequence[Any]) -> list[float]:
    out = []
    for layer in attentions:  # [batch, heads, query, key]
        a = layer.float().clamp_min(1e-12)
        out.append(float(-(a * a.log()).sum(-1).mean()))
    return out


def _per_token_latency(model: Any, ids: Any, steps: int = 16) -> float:
    import torch

    with torch.no_grad():
        out = model(ids, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(steps):
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return (time.perf_counter() - start) / steps


def latency_ratio(target: Any, draft: Any, ids: Any, rounds: int = 3) -> tuple[float, float]:
    """Median per-token decode time of each model, measured alternately after a warm-up."""
    _per_token_latency(target, ids, 2), _per_token_latency(draft, ids, 2)
    t, d = [], []
    for _ in range(rounds):
        t.append(_per_token_latency(target, ids))
        d.append(_per_token_latency(draft, ids))
    return sorted(t)[rounds // 2], sorted(d)[rounds // 2]


def block_acceptance(overlaps: Sequence[float], positions: int) -> list[float]:
    """P(draft position k accepted) = mean over starts t of prod_{i<=k} overlap_{t+i}."""
    result = []
    for k in range(positions):
        starts = range(0, max(0, len(overlaps) - k))
        values = [math.prod(overlaps[t : t + k + 1]) for t in starts]
        result.append(sum(values) / len(values) if values else 0.0)
    return result


def run_diagnosis(inp: DiagnosisInput, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(inp.target)
    target = AutoModelForCausalLM.from_pretrained(inp.target, attn_implementation="eager", torch_dtype=torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(inp.draft, attn_implementation="eager", torch_dtype=torch.float32)
    target.eval()
    draft.eval()
    per_class: dict[str, dict[str, list]] = {}
    disagreements: list[dict[str, Any]] = []
    entropy_t: list[list[float]] = []
    entropy_d: list[list[float]] = []
    latency_t, latency_d = [], []
    pace = DutyCycle(inp.cpu_share)
    pace.pause()  # loading the models counts as work too
    for index, (prompt_class, prompt) in enumerate(inp.prompts):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            full = target.generate(
                ids,
                max_new_tokens=inp.max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
                streamer=_PacedStreamer(pace),
            )
            out_t = target(full, output_attentions=True)
            pace.pause()
            out_d = draft(full, output_attentions=True)
            pace.pause()
        start = ids.shape[1] - 1  # logits at i predict token i+1
        p = out_t.logits[0, start:-1].float().softmax(-1)
        q = out_d.logits[0, start:-1].float().softmax(-1)
        overlap = torch.minimum(p, q).sum(-1)
        kl = (p * (p.clamp_min(1e-12).log() - q.clamp_min(1e-12).log())).sum(-1)
        agree = (p.argmax(-1) == q.argmax(-1)).float()
        bucket = per_class.setdefault(prompt_class, {"overlap": [], "kl": [], "agree": [], "blocks": []})
        bucket["overlap"] += overlap.tolist()
        bucket["kl"] += kl.tolist()
        bucket["agree"] += agree.tolist()
        bucket["blocks"].append(block_acceptance(overlap.tolist(), inp.positions))
        continuation = full[0, ids.shape[1] :]
        for t in torch.argsort(overlap)[:3].tolist():
            context = tokenizer.decode(full[0, max(0, ids.shape[1] + t - 12) : ids.shape[1] + t])
            disagreements.append(
                {
                    "class": prompt_class,
                    "context": context[-80:],
                    "target_token": tokenizer.decode([int(continuation[t])]),
                    "draft_token": tokenizer.decode([int(q[t].argmax())]),
                    "p_target_token": float(p[t, continuation[t]]),
                    "q_target_token": float(q[t, continuation[t]]),
                    "expected_acceptance": float(overlap[t]),
                }
            )
        entropy_t.append(_entropy_per_layer(out_t.attentions))
        entropy_d.append(_entropy_per_layer(out_d.attentions))
        if index == 0:  # timed unpaced (a pause inside would be measured), paced after
            t_tok, d_tok = latency_ratio(target, draft, ids)
            latency_t.append(t_tok)
            latency_d.append(d_tok)
        pace.pause()
        if progress:
            progress(index + 1, len(inp.prompts))
    classes = {}
    for name, b in per_class.items():
        blocks = b["blocks"]
        classes[name] = {
            "tokens": len(b["overlap"]),
            "expected_acceptance": sum(b["overlap"]) / len(b["overlap"]),
            "greedy_agreement": sum(b["agree"]) / len(b["agree"]),
            "kl": sum(b["kl"]) / len(b["kl"]),
            "per_position_expected": [sum(x[k] for x in blocks) / len(blocks) for k in range(inp.positions)],
            "per_position_realised": inp.realised_per_position.get(name),
        }
    ratio = (sum(latency_d) / len(latency_d)) / (sum(latency_t) / len(latency_t)) if latency_t else None
    report = {
        "target": inp.target,
        "draft": inp.draft,
        "prompts": len(inp.prompts),
        "classes": classes,
        "top_disagreements": sorted(disagreements, key=lambda d: d["expected_acceptance"])[:10],
        "attention_entropy": {
            "target": [sum(col) / len(col) for col in zip(*entropy_t)],
            "draft": [sum(col) / len(col) for col in zip(*entropy_d)],
        },
        "cpu": {"share": inp.cpu_share, "busy_s": pace.busy_s, "idle_s": pace.idle_s},
        "latency": {
            "target_s_per_token": sum(latency_t) / len(latency_t),
            "draft_s_per_token": sum(latency_d) / len(latency_d),
            "ratio": ratio,
            "rule": LATENCY_RULE,
        },
    }
    report["findings"] = findings(report)
    return report


def findings(report: dict[str, Any]) -> list[str]:
    """Plain-language conclusions and recommendations (pure)."""
    out = []
    for name, c in sorted(report["classes"].items()):
        acc = c["expected_acceptance"]
        if acc < 0.3:
            out.append(
                f"class {name}: the draft disagrees with the target on most tokens (expected acceptance "
                f"{acc:.0%}, greedy agreement {c['greedy_agreement']:.0%}); speculation cannot pay here. Use a "
                f"same-family draft or fine-tune the draft on this class; meanwhile switch the class off."
            )
        per_pos = c["per_position_expected"]
        worth = [k + 1 for k, a in enumerate(per_pos) if a >= 0.3]
        if acc >= 0.3 and worth and worth[-1] < len(per_pos):
            out.append(
                f"class {name}: acceptance decays with position (k=1..{len(per_pos)}: "
                + ", ".join(f"{a:.2f}" for a in per_pos)
                + f"); lower N to {worth[-1]}."
            )
        realised = c.get("per_position_realised")
        if realised and abs(realised[0] - per_pos[0]) > 0.2:
            out.append(
                f"class {name}: realised first-position acceptance {realised[0]:.0%} differs from expected "
                f"{per_pos[0]:.0%}: the served prompts differ from the diagnosed ones, or sampling settings do."
            )
    ratio = report["latency"]["ratio"]
    if ratio is not None and ratio > LATENCY_RULE:
        out.append(f"draft too slow: cost ratio {ratio:.2f} > {LATENCY_RULE}; use a smaller draft or lower N.")
    if not out:
        out.append("draft healthy: high expected acceptance at every position and an affordable cost ratio.")
    return out


def summary(report: dict[str, Any]) -> str:
    parts = [
        f"{name}: expected acceptance {c['expected_acceptance']:.0%}" for name, c in sorted(report["classes"].items())
    ]
    return "; ".join(parts) + ". " + " ".join(report["findings"])
