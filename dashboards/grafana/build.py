"""The Grafana operator dashboard and the acceptance alert, as code.

Built with grafana-foundation-sdk; ``python -m spectune.dashboards.grafana.build``
(or ``spectune grafana build``) writes the committed files:

* ``spectune-operator.json``               -- the dashboard (Grafana's dashboard JSON model)
* ``provisioning/dashboards/spectune.yaml`` -- file provider for that JSON
* ``provisioning/datasources/prometheus.yaml``
* ``provisioning/alerting/spectune.yaml``  -- contact point (spectune's webhook), a child
  notification route, and the Grafana-managed rule: acceptance < 70 % for 5 m.

``tests/test_grafana.py`` fails when the committed files differ from what this
module generates, and round-trips them through the SDK's models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from grafana_foundation_sdk.builders import alerting, expr, prometheus, stat, timeseries
from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.alerting import RelativeTimeRange
from grafana_foundation_sdk.models.dashboard import DataSourceRef, Threshold, ThresholdsMode

HERE = Path(__file__).parent
DASHBOARD_UID = "spectune-operator"
FOLDER_UID = "spectune"
FOLDER_TITLE = "spectune"
DATASOURCE_UID = "prometheus"
CONTACT_POINT = "spectune-webhook"
RULE_GROUP = "spectune"
ALERT_UID = "spectune-acceptance-low"
WEBHOOK_PATH = "/api/v1/alerts/alertmanager"
DATASOURCE = DataSourceRef(type_val="prometheus", uid=DATASOURCE_UID)
ACCEPTANCE = (
    "sum by (instance, class) (rate(spectune_accepted_tokens_total[5m]))"
    " / sum by (instance, class) (rate(spectune_draft_tokens_total[5m]) > 0)"
)


def _query(expression: str, legend: str, ref: str = "A") -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expression).legend_format(legend).ref_id(ref).datasource(DATASOURCE)


def _series(title: str, unit: str, *queries: prometheus.Dataquery, width: int = 12) -> timeseries.Panel:
    panel = timeseries.Panel().title(title).unit(unit).datasource(DATASOURCE).height(8).span(width)
    for q in queries:
        panel = panel.with_target(q)
    return panel


def _line_at(panel: timeseries.Panel, value: float, color: str) -> timeseries.Panel:
    """A dashed threshold line (the 70 % acceptance line, speedup 1)."""
    steps = [Threshold(value=None, color="green"), Threshold(value=value, color=color)]
    return panel.thresholds(db.ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(steps)).thresholds_style(
        common_builders.GraphThresholdsStyleConfig().mode(common.GraphTresholdsStyleMode.DASHED)
    )


def _latency(metric: str, title: str) -> timeseries.Panel:
    return _series(
        title,
        "s",
        *[
            _query(
                f"histogram_quantile({q}, sum by (le, class) (rate({metric}_bucket[5m])))",
                f"p{int(q * 100)} {{{{class}}}}",
                ref,
            )
            for q, ref in ((0.5, "A"), (0.95, "B"), (0.99, "C"))
        ],
        width=8,
    )


def dashboard() -> db.Dashboard:
    return (
        db.Dashboard("spectune: speculative decoding")
        .uid(DASHBOARD_UID)
        .tags(["spectune", "speculative-decoding"])
        .refresh("30s")
        .time("now-6h", "now")
        .annotation(
            db.AnnotationQuery()
            .name("Tuner changes")
            .datasource(DATASOURCE)
            .enable(True)
            .icon_color("orange")
            .expr("changes(spectune_tuner_last_change_timestamp_seconds[2m]) > 0")
        )
        .with_row(db.Row("Acceptance"))
        .with_panel(
            _line_at(
                _series(
                    "Acceptance rate (accepted / drafted), 70 % line",
                    "percentunit",
                    _query(ACCEPTANCE, "{{class}} {{instance}}"),
                ),
                0.7,
                "red",
            )
        )
        .with_panel(
            _series(
                "Acceptance by draft position",
                "percentunit",
                _query(
                    "sum by (class, position) (rate(spectune_accepted_tokens_per_position_total[5m]))"
                    " / sum by (class, position) (rate(spectune_draft_tokens_per_position_total[5m]) > 0)",
                    "{{class}} pos {{position}}",
                ),
            )
        )
        .with_panel(
            _series(
                "Mean acceptance length (tokens per verify step)",
                "short",
                _query(
                    "1 + sum by (class) (rate(spectune_accepted_tokens_total[5m]))"
                    " / sum by (class) (rate(spectune_spec_steps_total[5m]) > 0)",
                    "{{class}}",
                ),
            )
        )
        .with_panel(
            _series(
                "Output tokens/s",
                "short",
                _query("sum by (class) (rate(spectune_output_tokens_total[5m]))", "{{class}}"),
            )
        )
        .with_row(db.Row("Speculation in force"))
        .with_panel(
            stat.Panel()
            .title("N per class (batch 1)")
            .datasource(DATASOURCE)
            .height(6)
            .span(8)
            .with_target(_query("spectune_speculative_tokens", "{{class}}"))
        )
        .with_panel(
            stat.Panel()
            .title("Speculation on (1) / off (0)")
            .datasource(DATASOURCE)
            .height(6)
            .span(8)
            .with_target(_query("spectune_speculation_enabled", "{{class}}"))
        )
        .with_panel(
            _line_at(
                _series("Predicted speedup (tuner)", "x", _query("spectune_predicted_speedup", "{{class}}"), width=8),
                1.0,
                "red",
            )
        )
        .with_row(db.Row("Latency"))
        .with_panel(_latency("spectune_time_to_first_token_seconds", "Time to first token"))
        .with_panel(_latency("spectune_time_per_output_token_seconds", "Time per output token"))
        .with_panel(_latency("spectune_e2e_request_latency_seconds", "End-to-end latency"))
        .with_row(db.Row("vLLM spec decode"))
        .with_panel(
            _series(
                "vLLM: accepted / draft tokens",
                "percentunit",
                _query(
                    "sum(rate(vllm:spec_decode_num_accepted_tokens_total[5m]))"
                    " / sum(rate(vllm:spec_decode_num_draft_tokens_total[5m]) > 0)",
                    "acceptance",
                ),
            )
        )
        .with_panel(
            _series(
                "vLLM: drafts and tokens per second",
                "short",
                _query("sum(rate(vllm:spec_decode_num_drafts_total[5m]))", "drafts/s", "A"),
                _query("sum(rate(vllm:spec_decode_num_draft_tokens_total[5m]))", "draft tokens/s", "B"),
                _query("sum(rate(vllm:spec_decode_num_accepted_tokens_total[5m]))", "accepted tokens/s", "C"),
            )
        )
    )


def acceptance_rule() -> alerting.Rule:
    """Grafana-managed: acceptance < 70 % for 5 m, per instance and class."""
    query = (
        alerting.Query("A")
        .datasource_uid(DATASOURCE_UID)
        .relative_time_range(RelativeTimeRange(from_val=600, to=0))
        .model(prometheus.Dataquery().expr(ACCEPTANCE).instant().ref_id("A"))
    )
    reduce = (
        alerting.Query("B")
        .datasource_uid("__expr__")
        .model(expr.TypeReduce().ref_id("B").expression("A").reducer("last"))
    )
    threshold = (
        alerting.Query("C")
        .datasource_uid("__expr__")
        .model(
            expr.TypeThreshold()
            .ref_id("C")
            .expression("B")
            .conditions(
                [
                    expr.ExprTypeThresholdConditions().evaluator(
                        expr.ExprTypeThresholdConditionsEvaluator().type("lt").params([0.7])
                    )
                ]
            )
        )
    )
    return (
        alerting.Rule("Speculative decoding acceptance below 70%")
        .uid(ALERT_UID)
        .folder_uid(FOLDER_UID)
        .rule_group(RULE_GROUP)
        .org_id(1)
        .condition("C")
        .queries([query, reduce, threshold])
        .for_val("5m")
        .no_data_state("OK")
        .exec_err_state("Error")
        .labels({"severity": "warning", "spectune": "true"})
        .annotations(
            {
                "summary": "Draft acceptance {{ humanizePercentage $values.B.Value }} < 70% for 5m "
                "({{ $labels.class }} on {{ $labels.instance }})",
                "runbook": "spectune diagnose --class {{ $labels.class }}",
            }
        )
    )


def contact_point(url: str, token: str) -> alerting.ContactPoint:
    return (
        alerting.ContactPoint()
        .uid("spectune-webhook")
        .name(CONTACT_POINT)
        .type("webhook")
        .settings(
            {"url": url, "httpMethod": "POST", "authorization_scheme": "Bearer", "authorization_credentials": token}
        )
    )


def route() -> alerting.NotificationPolicy:
    """A child route for spectune's alerts (``spectune="true"``); the rest of the tree stays the operator's."""
    return (
        alerting.NotificationPolicy()
        .receiver(CONTACT_POINT)
        .object_matchers([["spectune", "=", "true"]])
        .group_by(["alertname", "instance", "class"])
        .group_wait("30s")
        .group_interval("5m")
        .repeat_interval("4h")
    )


def to_json(builder: Any) -> dict[str, Any]:
    return json.loads(json.dumps(builder.build(), cls=JSONEncoder))


def dashboard_json() -> dict[str, Any]:
    """The dashboard model with stable, unique panel ids (Grafana links and panel URLs use them)."""
    model = to_json(dashboard())
    for i, panel in enumerate(model["panels"], start=1):
        panel["id"] = i
    return model


def files(webhook_url: str = "http://spectune:8000" + WEBHOOK_PATH) -> dict[Path, str]:
    """Every generated file, path -> text (the committed versions must equal these)."""
    rule = to_json(acceptance_rule())
    # File provisioning spells some keys differently from the HTTP API.
    rule_file = {k: v for k, v in rule.items() if k not in ("folderUID", "ruleGroup", "orgID")}
    cp = to_json(contact_point(webhook_url, "$SPECTUNE_OPERATOR_TOKEN"))
    alerting_doc = {
        "apiVersion": 1,
        "contactPoints": [
            {
                "orgId": 1,
                "name": CONTACT_POINT,
                "receivers": [{"uid": cp["uid"], "type": cp["type"], "settings": cp["settings"]}],
            }
        ],
        "policies": [{"orgId": 1, "receiver": CONTACT_POINT, "routes": [to_json(route())]}],
        "groups": [{"orgId": 1, "name": RULE_GROUP, "folder": FOLDER_TITLE, "interval": "1m", "rules": [rule_file]}],
    }
    datasources = {
        "apiVersion": 1,
        "datasources": [
            {
                "name": "Prometheus",
                "type": "prometheus",
                "uid": DATASOURCE_UID,
                "access": "proxy",
                "url": "http://prometheus:9090",
                "isDefault": True,
            }
        ],
    }
    provider = {
        "apiVersion": 1,
        "providers": [
            {
                "name": "spectune",
                "folder": FOLDER_TITLE,
                "folderUid": FOLDER_UID,
                "type": "file",
                "allowUiUpdates": False,
                "options": {"path": "/var/lib/grafana/dashboards/spectune"},
            }
        ],
    }

    def dump(doc: dict[str, Any]) -> str:
        return "# Generated by dashboards/grafana/build.py -- do not edit.\n" + yaml.safe_dump(doc, sort_keys=False)

    return {
        HERE / "spectune-operator.json": json.dumps(dashboard_json(), indent=2, sort_keys=True) + "\n",
        HERE / "provisioning" / "alerting" / "spectune.yaml": dump(alerting_doc),
        HERE / "provisioning" / "datasources" / "prometheus.yaml": dump(datasources),
        HERE / "provisioning" / "dashboards" / "spectune.yaml": dump(provider),
    }


def write() -> list[Path]:
    written = []
    for path, content in files().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        written.append(path)
    return written


if __name__ == "__main__":
    for p in write():
        print(p)
