"""One vocabulary: each setting's name, choices and default are declared once (engine/schema.py,
engine/config.py, spectune/settings.py) and the CLI, the settings, the engine config, the runtime
settings and the policy model agree with that one definition."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, get_args

import pytest
import typer
from pydantic import ValidationError
from typer.testing import CliRunner

from spectune.cli import app
from spectune.engine.config import EngineConfig
from spectune.engine.schema import (
    CLASS_ARG,
    DEFAULT_MAX_SPECULATIVE_TOKENS,
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    MAX_SPECULATIVE_TOKENS_LIMIT,
    NEAR_TIE_NATS,
    PLAIN_ARG,
    PROBE_ARG,
    SPECULATION_METHODS,
    BatchRange,
    ClassSettings,
    RuntimeSettings,
    SpeculationMethod,
)
from spectune.settings import Settings
from spectune.tuner.policy import Policy, PolicyDocument, PolicyOverride, runtime_settings


def _serve_options() -> dict[str, Any]:
    serve = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    return {p.name: p for p in serve.params}


def _run(*args: str) -> tuple[int, str]:
    """Exit code and output of ``spectune ARGS``, the output's box and line breaks taken out."""
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, " ".join(result.output.replace("│", " ").split())


def _default(model: type, name: str) -> object:
    return model.model_fields[name].get_default(call_default_factory=True)


def _bounds(model: type, name: str) -> dict[str, object]:
    return {k: getattr(m, k) for m in model.model_fields[name].metadata for k in ("ge", "le") if hasattr(m, k)}


def test_the_method_literal_is_one_definition():
    assert SPECULATION_METHODS == ("none", "ngram", "draft_model", "suffix")
    for model, name in [(Settings, "method"), (EngineConfig, "method"), (Policy, "method"),
                        (PolicyOverride, "method"), (RuntimeSettings, "method")]:  # fmt: skip
        assert model.model_fields[name].annotation in (SpeculationMethod, SpeculationMethod | None), (model, name)
    assert get_args(_serve_options()["method"].type_descriptor.annotation) == SPECULATION_METHODS
    assert _default(Settings, "method") == _default(EngineConfig, "method") == "draft_model"


def test_the_capacity_is_max_speculative_tokens_everywhere_with_one_default_and_bound():
    for model in (Settings, EngineConfig):
        assert _default(model, "max_speculative_tokens") == DEFAULT_MAX_SPECULATIVE_TOKENS
        assert _bounds(model, "max_speculative_tokens") == {"ge": 1, "le": MAX_SPECULATIVE_TOKENS_LIMIT}
    assert "num_speculative_tokens" not in EngineConfig.model_fields  # the capacity has one name
    # the tuner may choose up to the capacity an engine starts with by default, and no policy N beyond the bound
    assert _default(Policy, "n_max") == DEFAULT_MAX_SPECULATIVE_TOKENS
    assert _bounds(Policy, "n_max")["le"] == _bounds(Policy, "num_speculative_tokens")["le"]
    assert _bounds(Policy, "num_speculative_tokens")["le"] == MAX_SPECULATIVE_TOKENS_LIMIT
    assert _serve_options()["max_speculative_tokens"].show_default == str(DEFAULT_MAX_SPECULATIVE_TOKENS)
    assert EngineConfig(model="m", draft_model="d").speculative_config()["num_speculative_tokens"] == (
        DEFAULT_MAX_SPECULATIVE_TOKENS
    )


def test_the_n_in_force_has_one_default():
    for model in (Settings, RuntimeSettings, Policy):
        assert _default(model, "num_speculative_tokens") == DEFAULT_NUM_SPECULATIVE_TOKENS, model
    assert _serve_options()["num_speculative_tokens"].show_default == str(DEFAULT_NUM_SPECULATIVE_TOKENS)


def test_settings_build_the_engine_config(tmp_path):
    settings = Settings(model=str(tmp_path / "t"), draft_model=str(tmp_path / "d"), num_speculative_tokens=2,
                        max_speculative_tokens=4, dtype="float32", max_model_len=512, instance_id="i1")  # fmt: skip
    config = settings.engine_config(["--enforce-eager"])
    assert (config.max_speculative_tokens, config.initial.num_speculative_tokens) == (4, 2)
    assert (config.dtype, config.max_model_len, config.instance_id, config.vllm_args) == (
        "float32", 512, "i1", ["--enforce-eager"],
    )  # fmt: skip
    # The settings the two share have the same default, bounds and description.
    for name in ("method", "max_speculative_tokens", "dtype", "max_model_len", "max_num_seqs", "kv_cache_space_gib",
                 "prompt_sample_rate"):  # fmt: skip
        ours, engine = Settings.model_fields[name], EngineConfig.model_fields[name]
        assert (ours.annotation, ours.default, ours.metadata, ours.description) == (
            engine.annotation, engine.default, engine.metadata, engine.description,
        ), name  # fmt: skip
    plain = Settings(model="m", method="ngram").engine_config()
    assert plain.method == "ngram" and plain.draft_model is None


def test_an_n_above_the_capacity_is_a_clear_error_in_settings_and_on_the_command_line():
    with pytest.raises(ValidationError, match="exceeds max_speculative_tokens"):
        Settings(num_speculative_tokens=7, max_speculative_tokens=6)
    code, output = _run("serve", "--model", "m", "-n", "9", "--max-speculative-tokens", "4")
    assert code == 2 and "num_speculative_tokens (9) exceeds max_speculative_tokens (4)" in output
    code, output = _run("serve", "--model", "m", "--method", "draft_model")
    assert code == 2 and "method 'draft_model' needs draft_model" in output
    code, output = _run("serve", "--method", "medusa")
    assert code == 2 and "'medusa' is not one of 'none', 'ngram', 'draft_model', 'suffix'" in output


def test_every_serve_flag_takes_its_help_from_the_setting_it_sets():
    options = _serve_options()
    flags = {"records": "records_path", "control_plane": "control_plane_url"}
    for name, option in options.items():
        if name in ("classifier", "help"):  # a file the CLI reads into Settings.classifier; click's own
            continue
        field = Settings.model_fields[flags.get(name, name)]
        assert field.description and option.help == field.description, name


def test_the_probe_share_has_one_name():
    assert "probe_fraction" in Policy.model_fields and "probe_fraction" in PolicyOverride.model_fields
    assert "exploration_fraction" not in Policy.model_fields
    doc = PolicyDocument(global_=Policy(probe_fraction=0.2), classes={"qa": PolicyOverride(probe_fraction=0.5)})
    settings = runtime_settings(doc, "i1", {"qa", "long"}, version=1)
    assert settings.probe_fraction == 0.2 and settings.probe_fraction_for("qa") == 0.5
    with pytest.raises(ValidationError, match="exploration_fraction"):
        PolicyDocument.model_validate({"global": {"exploration_fraction": 0.1}})


def test_the_near_tie_threshold_has_one_default():
    assert _default(RuntimeSettings, "near_tie_nats") == _default(Policy, "fidelity_near_tie_nats") == NEAR_TIE_NATS


def test_the_scheduler_reads_the_tags_the_engine_sets_and_an_untagged_request_runs_the_global_settings():
    from spectune.engine.scheduler import _request_tag

    def request(extra_args):
        return SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra_args))

    assert _request_tag(request({CLASS_ARG: "qa", PROBE_ARG: True, PLAIN_ARG: True})) == ("qa", True, True)
    assert _request_tag(request(None)) == (None, False, False)
    settings = RuntimeSettings(num_speculative_tokens=2, classes={"default": ClassSettings(num_speculative_tokens=5)})
    assert settings.n_for(None, 1, capacity=6) == 2


def test_one_capacity_check_covers_every_n_a_setting_can_ask_for():
    table = [BatchRange(min_batch=1, max_batch=4, num_speculative_tokens=5)]
    cases = [
        RuntimeSettings(num_speculative_tokens=5),
        RuntimeSettings(num_speculative_tokens=1, batch_table=table),
        RuntimeSettings(num_speculative_tokens=1, classes={"qa": ClassSettings(num_speculative_tokens=5)}),
        RuntimeSettings(num_speculative_tokens=1, classes={"qa": ClassSettings(batch_table=table)}),
    ]
    for settings in cases:
        assert settings.largest_n() == 5
        settings.check_capacity(5)
        with pytest.raises(ValueError, match="exceeds this engine's capacity 4"):
            settings.check_capacity(4)
