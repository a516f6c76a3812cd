"""Upload the dashboard and the alerting resources to a Grafana with grafana-client.

Idempotent: the folder is created when missing, the dashboard is overwritten by
uid, the contact point is updated by uid or created, spectune's child route is
put into the existing notification policy tree (the operator's other routes
stay), and the rule group is replaced as a whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError

from . import build


@dataclass
class PushReport:
    steps: list[str] = field(default_factory=list)


def _is_spectune_route(route: dict[str, Any]) -> bool:
    return ["spectune", "=", "true"] in (route.get("object_matchers") or [])


def push(url: str, token: str, webhook_url: str, webhook_token: str, timeout: float = 10.0) -> PushReport:
    api = GrafanaApi.from_url(url, credential=token, timeout=timeout)
    report = PushReport()
    try:
        api.folder.get_folder(build.FOLDER_UID)
        report.steps.append(f"folder {build.FOLDER_UID}: exists")
    except GrafanaClientError as exc:
        if exc.status_code != 404:
            raise
        api.folder.create_folder(build.FOLDER_TITLE, uid=build.FOLDER_UID)
        report.steps.append(f"folder {build.FOLDER_UID}: created")
    api.dashboard.update_dashboard(
        {
            "dashboard": build.dashboard_json(),
            "folderUid": build.FOLDER_UID,
            "overwrite": True,
            "message": "spectune grafana push",
        }
    )
    report.steps.append(f"dashboard {build.DASHBOARD_UID}: uploaded")

    contact = build.to_json(build.contact_point(webhook_url, webhook_token))
    existing = api.alertingprovisioning.get_contactpoints(name=build.CONTACT_POINT)
    if any(cp.get("uid") == contact["uid"] for cp in existing):
        api.alertingprovisioning.update_contactpoint(contact["uid"], contact)
        report.steps.append(f"contact point {build.CONTACT_POINT}: updated")
    else:
        api.alertingprovisioning.create_contactpoint(contact)
        report.steps.append(f"contact point {build.CONTACT_POINT}: created")

    tree = api.alertingprovisioning.get_notification_policy_tree()
    routes = [r for r in tree.get("routes") or [] if not _is_spectune_route(r)]
    tree["routes"] = [build.to_json(build.route()), *routes]
    api.alertingprovisioning.set_notification_policy_tree(tree)
    report.steps.append("notification policy: spectune route set")

    group = {"title": build.RULE_GROUP, "interval": 60, "rules": [build.to_json(build.acceptance_rule())]}
    api.alertingprovisioning.update_rule_group(build.FOLDER_UID, build.RULE_GROUP, group)
    report.steps.append(f"rule group {build.RULE_GROUP}: {len(group['rules'])} rule(s)")
    return report
