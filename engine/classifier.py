"""Prompt classes: which speculation settings a request gets.

Precedence, first match wins:

1. an explicit class on the request (body field ``spectune_class`` or the
   ``X-Spectune-Class`` header), if it names a known class;
2. regex rules, in order, on the prompt text;
3. prompt-length thresholds, in ascending order of ``max_prompt_tokens``;
4. the default class.

The defaults follow the field notes: short Q&A / classification prompts
(< 30 prompt tokens) are ``qa``, everything else ``long``.
"""

from __future__ import annotations

import re
from functools import cached_property

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

CLASS_NAME = r"^[a-z][a-z0-9_\-]{0,31}$"


class RegexRule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    pattern: str
    prompt_class: str = Field(pattern=CLASS_NAME)

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"invalid regex {value!r}: {exc}") from exc
        return value


class LengthRule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_prompt_tokens: int = Field(ge=1, description="Applies when prompt tokens < this")
    prompt_class: str = Field(pattern=CLASS_NAME)


class UnknownClassError(ValueError):
    """An explicit class that the classifier does not know."""


class PromptClassifier(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    regex_rules: list[RegexRule] = Field(default_factory=list)
    length_rules: list[LengthRule] = Field(
        default_factory=lambda: [LengthRule(max_prompt_tokens=30, prompt_class="qa")]
    )
    default_class: str = Field(default="long", pattern=CLASS_NAME)
    extra_classes: list[str] = Field(default_factory=list, description="Classes only reachable by explicit choice")

    @model_validator(mode="after")
    def _sorted(self) -> PromptClassifier:
        object.__setattr__(self, "length_rules", sorted(self.length_rules, key=lambda r: r.max_prompt_tokens))
        return self

    @cached_property
    def classes(self) -> frozenset[str]:
        return frozenset(
            [self.default_class, *self.extra_classes]
            + [r.prompt_class for r in self.regex_rules]
            + [r.prompt_class for r in self.length_rules]
        )

    @cached_property
    def _compiled(self) -> list[tuple[re.Pattern[str], str]]:
        return [(re.compile(r.pattern), r.prompt_class) for r in self.regex_rules]

    def known(self, name: object) -> str:
        """``name`` if it is one of the classes, else UnknownClassError (any other value too)."""
        if not isinstance(name, str) or name not in self.classes:
            known = ", ".join(sorted(self.classes))
            raise UnknownClassError(f"unknown prompt class {name!r}; known: {known}")
        return name

    def classify(self, prompt_text: str, prompt_tokens: int, explicit: str | None = None) -> str:
        if explicit is not None:
            return self.known(explicit)
        for pattern, prompt_class in self._compiled:
            if pattern.search(prompt_text):
                return prompt_class
        for rule in self.length_rules:
            if prompt_tokens < rule.max_prompt_tokens:
                return rule.prompt_class
        return self.default_class
