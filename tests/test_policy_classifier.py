"""Classes and classifier rules are part of the policy: one definition for the fleet, validated,
versioned, audited, and what engines and the tuner follow."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from spectune.app import create_app
from spectune.store.db import make_engine, upgrade

from conftest import OPERATOR, VIEWER, token_specs

CLASSIFIER = {
    "regex_rules": [{"pattern": "^Rewrite the following", "prompt_class": "code_edit"}],
    "length_rules": [{"max_prompt_tokens": 30, "prompt_class": "qa"}],
    "default_class": "chat",
}


@pytest.fixture
def api(tmp_path):
    url = f"sqlite:///{tmp_path}/cp.db"
    upgrade(url)
    db = make_engine(url)
    with TestClient(create_app(None, db, token_specs())) as client:
        yield client
    db.dispose()


def _patch(api, body: dict):
    etag = api.get("/api/v1/policy", headers=VIEWER).headers["ETag"]
    return api.patch("/api/v1/policy", json=body, headers={**OPERATOR, "If-Match": etag, "X-Change-Reason": "classes"})


def test_a_classifier_in_the_policy_defines_the_fleets_classes(api):
    assert {c["class"] for c in api.get("/api/v1/classes", headers=VIEWER).json()["classes"]} == {"qa", "long"}
    # A class override for a class the classifier does not define yet is refused, with the classifier it is not.
    assert _patch(api, {"classes": {"code_edit": {"num_speculative_tokens": 6}}}).status_code == 422
    r = _patch(api, {"classifier": CLASSIFIER, "classes": {"code_edit": {"num_speculative_tokens": 6, "n_max": 6}}})
    assert r.status_code == 200, r.text
    classes = {c["class"]: c for c in api.get("/api/v1/classes", headers=VIEWER).json()["classes"]}
    assert set(classes) == {"qa", "chat", "code_edit"} and classes["code_edit"]["num_speculative_tokens"] == 6
    assert api.get("/api/v1/policy/effective", params={"class": "code_edit"}, headers=VIEWER).status_code == 200
    assert api.get("/api/v1/policy/effective", params={"class": "long"}, headers=VIEWER).status_code == 404
    # Engines get it with their settings (a remote engine classifies with it).
    settings = api.get("/api/v1/engines/e1/settings", headers=VIEWER).json()
    assert settings["classifier"]["regex_rules"][0]["prompt_class"] == "code_edit"
    assert settings["classes"]["code_edit"]["num_speculative_tokens"] == 6
    # Versioned and audited like any change.
    (entry, *_) = api.get("/api/v1/audit", headers=VIEWER).json()
    assert any(c["path"].startswith("/classifier") for c in entry["diff"]["changes"]) and entry["reason"] == "classes"


@pytest.mark.parametrize(
    "classifier, field",
    [
        ({"regex_rules": [{"pattern": "(unclosed", "prompt_class": "x"}]}, "pattern"),
        ({"default_class": "Not A Name"}, "default_class"),
        ({"length_rules": [{"max_prompt_tokens": 0, "prompt_class": "qa"}]}, "max_prompt_tokens"),
        ({"regex_rules": [], "surprise": 1}, "surprise"),
    ],
)
def test_a_bad_classifier_is_a_422_naming_the_field_and_nothing_is_written(api, classifier, field):
    before = api.get("/api/v1/policy", headers=VIEWER).json()["version"]
    r = _patch(api, {"classifier": classifier})
    assert r.status_code == 422 and field in r.text
    assert api.get("/api/v1/policy", headers=VIEWER).json()["version"] == before


def test_dropping_a_class_that_still_has_an_override_is_refused(api):
    assert (
        _patch(api, {"classifier": CLASSIFIER, "classes": {"code_edit": {"num_speculative_tokens": 1}}}).status_code
        == 200
    )
    shrunk = {**CLASSIFIER, "regex_rules": []}
    r = _patch(api, {"classifier": shrunk})
    assert r.status_code == 422 and "code_edit" in r.text


def test_the_tuner_decides_for_the_policys_classes(tmp_path):
    from datetime import timedelta

    from spectune.control import PolicyService
    from spectune.store.policies import PolicyRepository
    from spectune.tuner.job import Tuner
    from spectune.tuner.policy import PolicyDocument

    url = f"sqlite:///{tmp_path}/t.db"
    upgrade(url)
    db = make_engine(url)
    PolicyRepository(db).ensure(PolicyDocument.model_validate({"classifier": CLASSIFIER}).body(), "test")
    tuner = Tuner(PolicyService(db, {"qa", "long"}), window=timedelta(minutes=5))
    assert {d["prompt_class"] for d in tuner.run_once()} == {"qa", "chat", "code_edit"}
