"""Grafana as code: the committed files are what the SDK code generates, they
round-trip through the SDK's models, and `spectune grafana push` makes exactly
the documented API calls (checked against a loopback fake of Grafana's API,
since no Grafana server is available here)."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.alerting import Rule
from grafana_foundation_sdk.models.dashboard import Dashboard

from spectune.dashboards.grafana import build

from conftest import free_port
from fake_grafana import FakeGrafana, FakeGrafanaServer

TOKEN = "glsa_test_token"
WEBHOOK = "http://spectune.test:8000/api/v1/alerts/alertmanager"


def _sdk_round_trip(model_cls, data: dict) -> dict:
    return json.loads(json.dumps(model_cls.from_json(data), cls=JSONEncoder))


def test_committed_files_are_up_to_date():
    stale = [str(path) for path, text in build.files().items() if not path.exists() or path.read_text() != text]
    assert stale == [], f"regenerate with `spectune grafana build`: {stale}"


def test_generated_files_round_trip_through_the_sdk():
    dashboard = json.loads((build.HERE / "spectune-operator.json").read_text())
    assert _sdk_round_trip(Dashboard, dashboard) == dashboard
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Acceptance rate (accepted / drafted), 70 % line", "Predicted speedup (tuner)"} <= titles
    assert "Tuner changes" in {a["name"] for a in dashboard["annotations"]["list"]}
    alerting = yaml.safe_load((build.HERE / "provisioning" / "alerting" / "spectune.yaml").read_text())
    (rule,) = alerting["groups"][0]["rules"]
    api_rule = {**rule, "folderUID": build.FOLDER_UID, "ruleGroup": build.RULE_GROUP, "orgID": 1}
    assert _sdk_round_trip(Rule, api_rule) == api_rule
    assert rule["for"] == "5m" and rule["data"][2]["model"]["conditions"][0]["evaluator"] == {
        "params": [0.7],
        "type": "lt",
    }


def _push(url: str, token: str = TOKEN, webhook_token: str = "operator-token"):
    return subprocess.run(
        [sys.executable, "-m", "spectune.cli", "grafana", "push", "--url", url, "--token", token,
         "--webhook-url", WEBHOOK, "--webhook-token", webhook_token],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_push_makes_the_documented_calls_and_is_idempotent():
    fake = FakeGrafana(TOKEN)
    with FakeGrafanaServer(fake, free_port()) as server:
        first = _push(server.url)
        assert first.returncode == 0, first.stderr
        calls = [(r["method"], r["path"]) for r in fake.requests]
        assert calls == [
            ("GET", "/api/folders/spectune"),
            ("POST", "/api/folders"),
            ("POST", "/api/dashboards/db"),
            ("GET", "/api/v1/provisioning/contact-points"),
            ("POST", "/api/v1/provisioning/contact-points"),
            ("GET", "/api/v1/provisioning/policies"),
            ("PUT", "/api/v1/provisioning/policies"),
            ("PUT", "/api/v1/provisioning/folder/spectune/rule-groups/spectune"),
        ]
        assert all(r["auth"] == f"Bearer {TOKEN}" for r in fake.requests)
        dash = fake.dashboards[build.DASHBOARD_UID]
        assert dash["dashboard"] == json.loads((build.HERE / "spectune-operator.json").read_text())
        cp = fake.contact_points["spectune-webhook"]
        assert cp["settings"]["url"] == WEBHOOK and cp["settings"]["authorization_credentials"] == "operator-token"
        # The operator's own route survives; spectune's is added once.
        routes = fake.policies["routes"]
        assert [r["receiver"] for r in routes] == ["spectune-webhook", "grafana-default-email"]
        (rule,) = fake.rule_groups[("spectune", "spectune")]["rules"]
        assert rule["uid"] == build.ALERT_UID

        fake.requests.clear()
        again = _push(server.url)
        assert again.returncode == 0, again.stderr
        calls = [(r["method"], r["path"]) for r in fake.requests]
        assert ("PUT", "/api/v1/provisioning/contact-points/spectune-webhook") in calls
        assert ("POST", "/api/folders") not in calls
        assert fake.dashboards[build.DASHBOARD_UID]["version"] == 2
        assert len(fake.policies["routes"]) == 2


def test_push_reports_refusals_and_unreachable_servers_clearly():
    fake = FakeGrafana(TOKEN)
    with FakeGrafanaServer(fake, free_port()) as server:
        refused = _push(server.url, token="wrong")
    assert refused.returncode == 1 and "Grafana refused: 401" in refused.stderr and "Traceback" not in refused.stderr
    unreachable = _push(f"http://127.0.0.1:{free_port()}")
    assert unreachable.returncode == 1 and "could not reach Grafana" in unreachable.stderr
    missing = _push("http://127.0.0.1:1", webhook_token="")
    assert missing.returncode != 0 and "webhook-token" in missing.stderr
