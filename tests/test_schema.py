"""Pure pieces of the engine boundary: settings resolution, classifier, counters."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from spectune.engine import BatchRange, ClassSettings, PromptClassifier, RuntimeSettings
from spectune.engine.classifier import LengthRule, RegexRule, UnknownClassError
from spectune.engine.config import EngineConfig, parse_batch_table
from spectune.engine.telemetry import per_position


def test_n_for_precedence_and_clamp():
    s = RuntimeSettings(
        num_speculative_tokens=3,
        batch_table=[
            BatchRange(min_batch=1, max_batch=4, num_speculative_tokens=5),
            BatchRange(min_batch=9, max_batch=64, num_speculative_tokens=0),
        ],
        classes={
            "qa": ClassSettings(num_speculative_tokens=2, batch_table=[]),
            "long": ClassSettings(speculation_enabled=False),
        },
    )
    assert s.n_for("other", 1, capacity=8) == 5  # table beats plain N
    assert s.n_for("other", 6, capacity=8) == 3  # gap in the table: plain N
    assert s.n_for("other", 32, capacity=8) == 0  # high batch: off
    assert s.n_for("other", 2, capacity=4) == 4  # clamped to capacity
    assert s.n_for("qa", 1, capacity=8) == 2  # class N, empty class table
    assert s.n_for("long", 1, capacity=8) == 0  # class switched off
    assert RuntimeSettings(speculation_enabled=False).n_for("x", 1, 8) == 0
    # A probe ignores on/off, not the table: a batch the table keeps plain stays plain.
    assert s.n_for("long", 1, capacity=8, probing=True) == 5
    assert s.n_for("long", 32, capacity=8, probing=True) == 0
    assert s.n_for("other", 32, capacity=8, probing=True) == 0


@pytest.mark.parametrize(
    "table",
    [
        [
            BatchRange(min_batch=1, max_batch=8, num_speculative_tokens=3),
            BatchRange(min_batch=8, max_batch=9, num_speculative_tokens=1),
        ],
        [
            BatchRange(min_batch=4, max_batch=16, num_speculative_tokens=3),
            BatchRange(min_batch=1, max_batch=4, num_speculative_tokens=1),
        ],
    ],
)
def test_overlapping_batch_ranges_rejected(table):
    with pytest.raises(ValidationError, match="overlap"):
        RuntimeSettings(batch_table=table)


def test_invalid_ranges_and_values_name_the_field():
    with pytest.raises(ValidationError, match="max_batch"):
        BatchRange(min_batch=5, max_batch=2, num_speculative_tokens=1)
    with pytest.raises(ValidationError, match="num_speculative_tokens"):
        RuntimeSettings(num_speculative_tokens=-1)
    with pytest.raises(ValidationError, match="extra"):
        RuntimeSettings.model_validate({"n": 3})


def test_parse_batch_table():
    assert parse_batch_table("1-4:3, 5-16:1,17:0") == [
        BatchRange(min_batch=1, max_batch=4, num_speculative_tokens=3),
        BatchRange(min_batch=5, max_batch=16, num_speculative_tokens=1),
        BatchRange(min_batch=17, max_batch=17, num_speculative_tokens=0),
    ]
    with pytest.raises(ValueError, match="MIN-MAX:N"):
        parse_batch_table("1-4=3")


def test_classifier_precedence():
    c = PromptClassifier(
        regex_rules=[RegexRule(pattern=r"```|def |class ", prompt_class="code")],
        length_rules=[
            LengthRule(max_prompt_tokens=200, prompt_class="medium"),
            LengthRule(max_prompt_tokens=30, prompt_class="qa"),
        ],
        extra_classes=["batch"],
    )
    assert c.classify("def f(): pass", 5) == "code"  # regex before length
    assert c.classify("hello", 5) == "qa"  # smallest threshold first
    assert c.classify("hello", 100) == "medium"
    assert c.classify("hello", 500) == "long"
    assert c.classify("def f", 5, explicit="batch") == "batch"  # explicit wins
    with pytest.raises(UnknownClassError, match="unknown prompt class 'nope'"):
        c.classify("x", 1, explicit="nope")


def test_default_classes_follow_the_field_notes():
    c = PromptClassifier()
    assert c.classify("what is 2+2?", 29) == "qa"
    assert c.classify("write a long story", 30) == "long"


def test_bad_regex_is_a_validation_error():
    with pytest.raises(ValidationError, match="invalid regex"):
        RegexRule(pattern="(", prompt_class="x")


def test_engine_config_needs_a_draft_for_draft_method():
    with pytest.raises(ValidationError, match="draft_model"):
        EngineConfig(model="m", method="draft_model")
    cfg = EngineConfig(model="/x/target", method="draft_model", draft_model="/x/d")
    assert cfg.target_only().method == "none" and cfg.target_only().speculative_config() is None
    assert cfg.name == "target"


def test_per_position_counts():
    # steps drafted [4,4,2] with accepted [4,1,0]
    assert per_position([4, 4, 2], 4) == [3, 3, 2, 2]
    assert per_position([4, 1, 0], 4) == [2, 1, 1, 1]
    assert per_position([], 3) == [0, 0, 0]
