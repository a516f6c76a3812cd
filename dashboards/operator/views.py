"""One function per dashboard page. Each reads through the API and draws;
every chart has its numbers in a table next to it."""

from __future__ import annotations

import json
from typing import Any

import altair as alt
import pandas as pd
import streamlit as st

from .client import Api, ApiError
from .tuner_page import tuner
from .widgets import empty

ACCEPTANCE_LINE = 0.70


def overview(api: Api, window_s: float, who: dict) -> None:
    st.header("Overview")
    classes = pd.DataFrame(api.get("/api/v1/classes")["classes"])
    st.subheader("Speculation in force")
    rows = classes.to_dict("records")
    for col, row in zip(st.columns(max(1, len(rows))), rows):
        shown = f"N={row['num_speculative_tokens']}" if row["speculation_enabled"] else "off"
        col.metric(row["class"], shown, help=f"tuner mode {row['tuner_mode']}")
    st.dataframe(classes, hide_index=True, key="classes_table")

    fleet = api.get("/api/v1/instances")
    st.subheader(f"Engine instances (policy v{fleet['policy_version']})")
    if fleet["behind"]:
        st.warning(f"Behind the policy: {', '.join(fleet['behind'])} (still on an older settings version)")
    if fleet["instances"]:
        columns = ["instance_id", "method", "draft_model", "settings_version", "behind", "live", "seen_s_ago"]
        st.dataframe(pd.DataFrame(fleet["instances"])[columns], hide_index=True, key="instances_table")
    else:
        st.info("No engine has reported to this control plane yet.")

    points = pd.DataFrame(
        api.get("/api/v1/stats/timeseries", window_s=window_s, bucket_s=max(60, window_s // 60))["points"]
    )
    st.subheader(f"Acceptance over time ({ACCEPTANCE_LINE:.0%} line)")
    if points.empty:
        empty("requests")
    else:
        points["time"] = pd.to_datetime(points["time"])
        line = (
            alt.Chart(points.dropna(subset=["acceptance"]))
            .mark_line(point=True)
            .encode(x="time:T", y=alt.Y("acceptance:Q", scale=alt.Scale(domain=[0, 1])), color="class:N")
        )
        rule = alt.Chart(pd.DataFrame({"y": [ACCEPTANCE_LINE]})).mark_rule(color="red", strokeDash=[6, 4]).encode(y="y")
        st.altair_chart(line + rule, width="stretch")
        st.subheader("Output tokens/s")
        st.altair_chart(
            alt.Chart(points).mark_line().encode(x="time:T", y="output_tokens_per_s:Q", color="class:N"),
            width="stretch",
        )
        with st.expander("data"):
            st.dataframe(points, hide_index=True, key="timeseries_table")

    st.subheader("Latency (ms)")
    answer = api.get("/api/v1/stats/latency", window_s=window_s)
    latency = answer["classes"]
    error = max((c.get("percentile_error", 0.0) for c in latency), default=0.0)
    if error:
        st.caption(f"Percentiles from hourly histograms: each within {error:.1%} of the exact value.")
    if answer.get("left_out"):
        st.warning(answer["left_out"])
    rows = [
        {"class": c["class"], "metric": name, **{q: None if v is None else round(v * 1000, 1) for q, v in c[m].items()}}
        for c in latency
        for name, m in (("TTFT", "ttft_s"), ("per token", "tpot_s"), ("end to end", "e2e_s"))
    ]
    if rows:
        st.dataframe(pd.DataFrame(rows), hide_index=True, key="latency_table")
    else:
        empty("requests")


def acceptance(api: Api, window_s: float, who: dict) -> None:
    st.header("Acceptance")
    groups = api.get("/api/v1/stats/acceptance", window_s=window_s, group_by="position")["groups"]
    rows = [{"class": g["class"], **p} for g in groups for p in g.get("positions", [])]
    st.subheader("Per draft position")
    if not rows:
        empty("drafted tokens")
    else:
        positions = pd.DataFrame(rows)
        st.altair_chart(
            alt.Chart(positions)
            .mark_line(point=True)
            .encode(
                x=alt.X("position:O", title="draft position"),
                y=alt.Y("acceptance:Q", scale=alt.Scale(domain=[0, 1])),
                color="class:N",
            ),
            width="stretch",
        )
        st.dataframe(positions, hide_index=True, key="positions_table")
        per_class = pd.DataFrame(
            [{k: g[k] for k in ("class", "requests", "drafted", "accepted", "acceptance")} for g in groups]
        )
        st.subheader("Per class")
        st.dataframe(per_class, hide_index=True, key="acceptance_by_class")
    st.subheader("Batch bucket x N")
    cells = pd.DataFrame(api.get("/api/v1/stats/acceptance", window_s=window_s, group_by="batch_bucket")["groups"])
    cells = cells[cells["n"] > 0] if not cells.empty else cells
    if cells.empty:
        empty("speculative engine steps")
    else:
        st.altair_chart(
            alt.Chart(cells)
            .mark_rect()
            .encode(
                x=alt.X("n:O", title="N"),
                y=alt.Y("batch_bucket:O", title="batch bucket"),
                color=alt.Color("acceptance:Q", scale=alt.Scale(domain=[0, 1])),
                tooltip=["batch_bucket", "n", "steps", "acceptance"],
            ),
            width="stretch",
        )
        st.dataframe(cells, hide_index=True, key="heatmap_table")


def policies(api: Api, window_s: float, who: dict) -> None:
    st.header("Policies")
    current, etag = api.policy()
    st.caption(f"Version {current['version']}, by {current['updated_by']} at {current['updated_at']}")
    st.json(current["policy"])
    st.subheader("Edit")
    if who.get("role") != "operator":
        st.warning("Your token is a viewer token: editing needs an operator token.")
    text = st.text_area(
        "Policy document (JSON)", json.dumps(current["policy"], indent=2), height=300, key="policy_text"
    )
    reason = st.text_input("Why (recorded in the audit trail)", key="policy_reason")
    if st.button("Save policy", key="save_policy"):
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            st.error(f"Not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})")
        else:
            try:
                saved = api.write_policy("PUT", body, etag, reason or None)
                st.success(f"Saved as version {saved['version']}.")
            except ApiError as exc:
                st.error(f"Rejected ({exc.status}): {exc.message}")
    st.subheader("History")
    versions = pd.DataFrame(api.get("/api/v1/policy/versions", limit=50))
    if not versions.empty:
        st.dataframe(versions.drop(columns=["policy"]), hide_index=True, key="versions_table")
    audit = pd.DataFrame(api.get("/api/v1/audit", limit=50))
    if not audit.empty:
        st.dataframe(audit, hide_index=True, key="audit_table")
    target = st.number_input(
        "Roll back to version", min_value=1, max_value=int(current["version"]), step=1, key="rollback_to"
    )
    if st.button("Roll back", key="rollback"):
        try:
            saved = api.request("POST", "/api/v1/policy/rollback", json={"version": int(target)},
                                headers={"If-Match": etag}).json()  # fmt: skip
            st.success(f"Rolled back: version {saved['version']} has the body of version {int(target)}.")
        except ApiError as exc:
            st.error(f"Rejected ({exc.status}): {exc.message}")


def _report(api: Api, report_id: int) -> None:
    r = api.get(f"/api/v1/diagnostics/{report_id}")
    st.subheader(f"Report #{r['id']} ({r['trigger']}, {r['prompt_class'] or 'all classes'}): {r['status']}")
    if r["status"] == "running":
        st.progress(0.5, text="Diagnosis running: target and draft teacher-forced on recent prompts...")
        st.caption("Turn on auto-refresh or reload to see the result.")
        return
    if r["status"] == "failed":
        st.error(f"The diagnosis failed: {r.get('error') or r.get('summary')}")
        return
    report = r["report"] or {}
    st.write(r["summary"])
    for finding in report.get("findings", []):
        st.markdown(f"- {finding}")
    latency = report.get("latency", {})
    if latency:
        st.metric(
            "Draft / target latency per token", f"{latency['ratio']:.2f}", help=f"rule of thumb: < {latency['rule']}"
        )
    rows = []
    for cls, c in report.get("classes", {}).items():
        for k, expected in enumerate(c.get("per_position_expected") or []):
            realised = c.get("per_position_realised") or [None] * (k + 1)
            rows.append({"class": cls, "position": k, "kind": "expected", "acceptance": expected})
            if k < len(realised) and realised[k] is not None:
                rows.append({"class": cls, "position": k, "kind": "realised", "acceptance": realised[k]})
    if rows:
        per_position = pd.DataFrame(rows)
        st.markdown("**Expected (sum min(p, q)) vs realised acceptance per position**")
        st.altair_chart(
            alt.Chart(per_position).mark_line(point=True).encode(
                x="position:O", y=alt.Y("acceptance:Q", scale=alt.Scale(domain=[0, 1])), color="class:N",
                strokeDash="kind:N",
            ),
            width="stretch",
        )  # fmt: skip
        st.dataframe(per_position, hide_index=True, key="report_positions")
    entropy = report.get("attention_entropy", {})
    if entropy.get("target"):
        layers = [
            {"layer": i, "model": model, "entropy": v}
            for model in ("target", "draft")
            for i, v in enumerate(entropy[model])
        ]
        st.markdown("**Attention entropy per layer**")
        st.altair_chart(
            alt.Chart(pd.DataFrame(layers)).mark_line(point=True).encode(x="layer:O", y="entropy:Q", color="model:N"),
            width="stretch",
        )
    if report.get("top_disagreements"):
        st.markdown("**Where target and draft disagree most**")
        st.dataframe(pd.DataFrame(report["top_disagreements"]), hide_index=True, key="disagreements_table")


def _fidelity(api: Api, window_s: float) -> None:
    st.subheader("Fidelity audit")
    found = api.get("/api/v1/fidelity", window_s=window_s)
    if not found["classes"]:
        st.info("No audited request yet in this window (policy: fidelity_audit_fraction; greedy requests only).")
        return
    defects = sum(c["defect"] for c in found["classes"])
    if defects:
        st.error(f"{defects} audited request(s) where speculation changed the output beyond a near-tie.")
    columns = ["class", "method", "audited", "match", "near_tie", "defect", "divergence_rate", "max_near_tie_margin"]
    st.dataframe(pd.DataFrame(found["classes"]).reindex(columns=columns), hide_index=True, key="fidelity_table")
    if found["divergences"]:
        shown = ["checked_at", "request_id", "prompt_class", "result", "diverged_at", "served_margin", "plain_margin"]
        divergences = pd.DataFrame(found["divergences"]).reindex(columns=[*shown, "reason"])
        st.dataframe(divergences, hide_index=True, key="divergences_table")


def diagnostics(api: Api, window_s: float, who: dict) -> None:
    st.header("Diagnostics")
    _fidelity(api, window_s)
    classes = [c["class"] for c in api.get("/api/v1/classes")["classes"]]
    choice = st.selectbox("Class to diagnose", ["(all classes)", *classes], key="diagnose_class")
    if st.button("Run a diagnosis", key="run_diagnosis"):
        try:
            started = api.post("/api/v1/diagnostics", {"class": None if choice.startswith("(") else choice})
            st.session_state["diagnosis_id"] = started["id"]
            st.success(f"Diagnosis #{started['id']} started.")
        except ApiError as exc:
            st.error(f"Rejected ({exc.status}): {exc.message}")
    reports = api.get("/api/v1/diagnostics", limit=200)
    if not reports:
        st.info("No diagnosis yet. Run one above, or wait for the tuner or an alert to start one.")
        return
    table = pd.DataFrame(reports)[["id", "created_at", "trigger", "prompt_class", "status", "summary"]]
    st.dataframe(table, hide_index=True, key="reports_table")
    ids = [r["id"] for r in reports]
    wanted = st.session_state.get("diagnosis_id")
    selected = st.selectbox("Report", ids, index=ids.index(wanted) if wanted in ids else 0, key="report_id")
    _report(api, int(selected))


def alerts(api: Api, window_s: float, who: dict) -> None:
    st.header("Alerts")
    events = api.get("/api/v1/alerts", limit=500)
    if not events:
        st.info("No alert has reached spectune's webhook yet.")
        return
    rows = [
        {
            "received": e["received_at"],
            "alert": e["alertname"],
            "status": e["status"],
            "class": e["labels"].get("class"),
            "summary": e["labels"].get("annotation:summary"),
            "diagnosis": e.get("diagnosis_id"),
            "fingerprint": e["fingerprint"],
        }
        for e in events
    ]
    table = pd.DataFrame(rows)
    latest = table.sort_values("received").groupby("fingerprint").tail(1)
    st.metric("Firing now", int((latest["status"] == "firing").sum()))
    st.dataframe(table.drop(columns=["fingerprint"]), hide_index=True, key="alerts_table")
    linked = [r for r in rows if r["diagnosis"] is not None]
    for r in {r["diagnosis"]: r for r in linked}.values():
        st.button(
            f"Open diagnosis #{r['diagnosis']} ({r['alert']}, {r['class']})",
            key=f"open_{r['diagnosis']}",
            on_click=_open_diagnosis,
            args=(r["diagnosis"],),
        )


def _open_diagnosis(report_id: int) -> None:
    # A callback runs before the script, so it may still change the page radio's state.
    st.session_state["diagnosis_id"] = report_id
    st.session_state["page"] = "Diagnostics"


PAGES: dict[str, Any] = {
    "Overview": overview,
    "Acceptance": acceptance,
    "Tuner": tuner,
    "Policies": policies,
    "Diagnostics": diagnostics,
    "Alerts": alerts,
}
