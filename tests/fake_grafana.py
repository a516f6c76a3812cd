"""A loopback stand-in for the parts of Grafana's HTTP API that `spectune grafana push` uses.

It enforces what Grafana documents for each call -- path, method, bearer
auth, body shape and cross-references (folder exists, a route's receiver is a
known contact point, a rule's condition names one of its queries) -- keeps
state like Grafana would, and records every request so tests can check them.
No Grafana server is installable here; this is what the push is tested against.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from servers import ThreadedServer

DURATION = re.compile(r"^\d+[smhd]$")
CONTACT_TYPES = {"webhook", "email", "slack", "pagerduty", "alertmanager"}


class FakeGrafana:
    def __init__(self, token: str) -> None:
        self.token = token
        self.requests: list[dict[str, Any]] = []
        self.folders: dict[str, dict] = {}
        self.dashboards: dict[str, dict] = {}
        self.contact_points: dict[str, dict] = {}
        self.policies: dict[str, Any] = {
            "receiver": "grafana-default-email",
            "routes": [{"receiver": "grafana-default-email", "object_matchers": [["team", "=", "db"]]}],
        }
        self.rule_groups: dict[tuple[str, str], dict] = {}
        self.contact_points["grafana-default-email"] = {
            "uid": "default-email",
            "name": "grafana-default-email",
            "type": "email",
            "settings": {"addresses": "x"},
        }
        self.app = self._build()

    # -- helpers -------------------------------------------------------------
    @staticmethod
    def _need(condition: bool, message: str, status: int = 400) -> None:
        if not condition:
            raise HTTPException(status, message)

    def _receivers(self) -> set[str]:
        return {cp["name"] for cp in self.contact_points.values()}

    def _check_rule(self, rule: dict, folder_uid: str, group: str) -> None:
        need = self._need
        for key in (
            "uid",
            "title",
            "condition",
            "data",
            "for",
            "noDataState",
            "execErrState",
            "folderUID",
            "ruleGroup",
        ):
            need(key in rule, f"rule: missing {key}")
        need(rule["folderUID"] == folder_uid, "rule: folderUID differs from the URL's folder")
        need(rule["ruleGroup"] == group, "rule: ruleGroup differs from the URL's group")
        need(bool(DURATION.match(rule["for"])), f"rule: invalid for {rule['for']!r}")
        need(rule["noDataState"] in ("Alerting", "NoData", "OK"), "rule: invalid noDataState")
        need(rule["execErrState"] in ("Alerting", "Error", "OK"), "rule: invalid execErrState")
        refs = set()
        for q in rule["data"]:
            for key in ("refId", "datasourceUid", "model"):
                need(key in q, f"rule query: missing {key}")
            need(q["model"].get("refId") == q["refId"], "rule query: model.refId must equal refId")
            refs.add(q["refId"])
        need(rule["condition"] in refs, f"rule: condition {rule['condition']!r} names no query")

    def _build(self) -> FastAPI:
        app = FastAPI()
        need = self._need

        @app.middleware("http")
        async def record_and_authorise(request: Request, call_next):
            body = await request.body()
            import json

            self.requests.append(
                dict(
                    method=request.method,
                    path=request.url.path,
                    query=dict(request.query_params),
                    auth=request.headers.get("authorization"),
                    json=json.loads(body) if body else None,
                )
            )
            if request.headers.get("authorization") != f"Bearer {self.token}":
                return JSONResponse({"message": "Unauthorized"}, status_code=401)
            return await call_next(request)

        @app.get("/api/folders/{uid}")
        def get_folder(uid: str):
            need(uid in self.folders, "folder not found", 404)
            return self.folders[uid]

        @app.post("/api/folders")
        async def create_folder(request: Request):
            body = await request.json()
            need(isinstance(body.get("title"), str) and body["title"], "title required")
            uid = body.get("uid") or uuid.uuid4().hex[:9]
            need(uid not in self.folders, "a folder with the same uid already exists", 409)
            self.folders[uid] = {"id": len(self.folders) + 1, "uid": uid, "title": body["title"]}
            return self.folders[uid]

        @app.post("/api/dashboards/db")
        async def save_dashboard(request: Request):
            body = await request.json()
            dash = body.get("dashboard")
            need(isinstance(dash, dict), "dashboard object required")
            need(isinstance(dash.get("title"), str) and dash["title"], "dashboard title required")
            need(isinstance(dash.get("panels"), list), "dashboard panels must be a list")
            ids = [p.get("id") for p in dash["panels"]]
            need(len(ids) == len(set(ids)), "panel ids must be unique")
            need(body.get("folderUid") in self.folders, "folder not found", 400)
            uid = dash.get("uid")
            if uid in self.dashboards and not body.get("overwrite"):
                raise HTTPException(412, "A dashboard with the same uid already exists")
            version = self.dashboards.get(uid, {}).get("version", 0) + 1
            self.dashboards[uid] = {"dashboard": dash, "folderUid": body["folderUid"], "version": version}
            return {"status": "success", "uid": uid, "url": f"/d/{uid}", "version": version, "id": 1}

        @app.get("/api/v1/provisioning/contact-points")
        def list_contact_points(name: str | None = None):
            return [cp for cp in self.contact_points.values() if name is None or cp["name"] == name]

        def check_contact_point(body: dict) -> None:
            need(isinstance(body.get("name"), str) and body["name"], "name required")
            need(body.get("type") in CONTACT_TYPES, f"unknown type {body.get('type')!r}")
            if body["type"] == "webhook":
                need(str(body.get("settings", {}).get("url", "")).startswith("http"), "webhook settings.url required")

        @app.post("/api/v1/provisioning/contact-points", status_code=202)
        async def create_contact_point(request: Request):
            body = await request.json()
            check_contact_point(body)
            uid = body.get("uid") or uuid.uuid4().hex[:9]
            need(uid not in self.contact_points, "uid exists", 409)
            self.contact_points[uid] = {**body, "uid": uid}
            return self.contact_points[uid]

        @app.put("/api/v1/provisioning/contact-points/{uid}", status_code=202)
        async def update_contact_point(uid: str, request: Request):
            need(uid in self.contact_points, "contact point not found", 404)
            body = await request.json()
            check_contact_point(body)
            self.contact_points[uid] = {**body, "uid": uid}
            return {"message": "contactpoint updated"}

        @app.get("/api/v1/provisioning/policies")
        def get_policies():
            return self.policies

        @app.put("/api/v1/provisioning/policies", status_code=202)
        async def put_policies(request: Request):
            body = await request.json()
            known = self._receivers()

            def walk(route: dict) -> None:
                need(route.get("receiver") in known, f"receiver {route.get('receiver')!r} does not exist")
                for m in route.get("object_matchers") or []:
                    need(isinstance(m, list) and len(m) == 3 and m[1] in ("=", "!=", "=~", "!~"), "bad matcher")
                for child in route.get("routes") or []:
                    walk(child)

            walk(body)
            self.policies = body
            return {"message": "policies updated"}

        @app.put("/api/v1/provisioning/folder/{folder_uid}/rule-groups/{group}")
        async def put_rule_group(folder_uid: str, group: str, request: Request):
            need(folder_uid in self.folders, "folder not found", 404)
            body = await request.json()
            need(body.get("title") == group, "title must equal the group in the URL")
            need(
                isinstance(body.get("interval"), int) and body["interval"] > 0 and body["interval"] % 10 == 0,
                "interval must be a positive multiple of 10 seconds",
            )
            need(isinstance(body.get("rules"), list) and body["rules"], "rules required")
            for rule in body["rules"]:
                self._check_rule(rule, folder_uid, group)
            self.rule_groups[(folder_uid, group)] = body
            return body

        return app


class FakeGrafanaServer(ThreadedServer):
    """Runs a FakeGrafana on 127.0.0.1:port in a thread."""

    def __init__(self, fake: FakeGrafana, port: int) -> None:
        super().__init__(fake.app, port)
        self.fake = fake
