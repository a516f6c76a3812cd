"""Exact replay of the ngram proposer: against vLLM's own prompt-lookup function (in a subprocess:
vLLM's ngram module imports numba, which must stay out of this process) and against the counts a
real ngram engine reports (tiny fp32 models, greedy)."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from spectune.tuner.token_replay import ngram_proposal, replay_ngram

from conftest import complete, running_engine, tiny_config

VLLM_PROPOSE = """
import json, sys
import numpy as np
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as propose
cases = json.load(sys.stdin)
out = [propose(np.array(c, dtype=np.int32), lo, hi, ml, k).tolist() for c, lo, hi, k, ml in cases]
json.dump(out, sys.stdout)
"""


def test_the_proposal_is_vllms_on_random_and_repetitive_contexts():
    rng = random.Random(7)
    cases = []
    for _ in range(400):
        vocab = rng.choice([2, 3, 5, 50])  # small vocabularies repeat: many matches, ties, overlaps
        context = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        lo = rng.randint(1, 3)
        cases.append((context, lo, lo + rng.randint(0, 4), rng.randint(1, 6), rng.choice([64, len(context) + 2])))
    run = subprocess.run(
        [sys.executable, "-c", VLLM_PROPOSE], input=json.dumps(cases), capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    theirs = json.loads(run.stdout)
    ours = [ngram_proposal(c, lo, hi, k, ml) for c, lo, hi, k, ml in cases]
    differ = [(case, a, b) for case, a, b in zip(cases, ours, theirs, strict=True) if a != b]
    assert not differ, differ[:3]
    assert sum(1 for t in theirs if t) > 100  # the cases exercise matching, not only empty drafts


def test_replay_counts_a_perfect_copy_and_nothing_to_copy():
    prompt = [1, 2, 3, 4, 5, 6]
    copy = replay_ngram(prompt, [1, 2, 3, 4, 5, 6, 7, 8, 9], 6, 3, 1, 4, 512)  # repeats the prompt, then new
    assert copy.drafted_per_position[0] == copy.verify_steps > 0
    assert copy.accepted_per_position[0] >= 1
    fresh = replay_ngram([1, 2, 3], [10, 11, 12, 13, 14, 15, 16, 17], 5, 3, 1, 4, 512)
    assert fresh.verify_steps == 0 and fresh.acceptance is None
    with pytest.raises(ValueError, match="max_tokens"):
        replay_ngram(prompt, [1, 2], 6, 3, 1, 4, 512)


REPEATING = [
    "the draft verify the draft verify the draft verify the draft",
    "accept reject accept reject accept reject accept",
    "model engine cache model engine cache model engine",
    "print return def print return def print return",
    "value error step rate value error step rate value",
    "one two three four one two three four one two",
]


@pytest.mark.slow  # an engine of its own; the default tier checks the matcher against vLLM's on 400 contexts
async def test_replay_equals_what_the_ngram_engine_reports(tiny):
    n, max_tokens = 3, 32
    config = tiny_config(tiny, method="ngram", n=n)
    async with running_engine(config) as (eng, sink):
        compared = 0
        for prompt in REPEATING:
            # the target's greedy continuation, long enough to judge the last step's drafts
            _, reference, _ = await complete(eng, prompt, max_tokens + n, temperature=0.0, ignore_eos=True)
            _, served, rid = await complete(eng, prompt, max_tokens, temperature=0.0, ignore_eos=True)
            assert served == reference[:max_tokens]
            record = sink.by_id(rid)
            replayed = replay_ngram(
                eng.tokenize(prompt),
                reference,
                max_tokens,
                n,
                config.ngram_prompt_lookup_min,
                config.ngram_prompt_lookup_max,
                config.max_model_len,
            )
            assert replayed.drafted_per_position == record.drafted_per_position[:n], prompt
            assert replayed.accepted_per_position == record.accepted_per_position[:n], prompt
            assert replayed.verify_steps == record.num_spec_steps, prompt
            compared += sum(replayed.drafted_per_position)
        assert compared > 50  # the prompts made ngram draft
