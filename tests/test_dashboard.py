"""The Streamlit operator dashboard, page by page, with streamlit's AppTest
against the real API (served in a thread) over a seeded database: values are
asserted, including a policy edit the API rejects."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from spectune.api.auth import Role, TokenSpec
from spectune.app import create_app
from spectune.store.db import make_engine

from conftest import free_port
from dashboard_seed import seed
from servers import ThreadedServer

APP = str(Path(__file__).resolve().parent.parent / "dashboards" / "operator" / "app.py")
TOKENS = {
    "vic": TokenSpec(token="viewer-token", role=Role.VIEWER),
    "ola": TokenSpec(token="operator-token", role=Role.OPERATOR),
}


@pytest.fixture(autouse=True)
def _keep_main_module():
    """AppTest runs the app as ``__main__`` and leaves it there; vLLM's spawned engine processes
    re-import ``__main__`` by path, so later engine tests in this process would run the app."""
    main, argv = sys.modules["__main__"], list(sys.argv)
    yield
    sys.modules["__main__"], sys.argv[:] = main, argv


def _api(url: str):
    """The control-plane API (no engine) over the database at ``url``, served in a thread."""
    db = make_engine(url)
    with ThreadedServer(create_app(None, db, TOKENS), free_port()) as server:
        yield server.url
    db.dispose()


@pytest.fixture(scope="module")
def api_url(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('dash')}/dash.db"
    seed(url)
    yield from _api(url)


def page(api_url: str, name: str, token: str = "operator-token") -> AppTest:
    os.environ["SPECTUNE_API_URL"] = api_url
    os.environ["SPECTUNE_TOKEN"] = token
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.sidebar.radio(key="page").set_value(name).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def table(at: AppTest, *columns: str) -> pd.DataFrame:
    for df in at.dataframe:
        if set(columns) <= set(df.value.columns):
            return df.value
    raise AssertionError(f"no table with columns {columns}: {[list(d.value.columns) for d in at.dataframe]}")


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def test_overview(api_url):
    at = page(api_url, "Overview")
    assert not at.error
    assert metrics(at) == {"long": "N=3", "qa": "N=3"}
    latency = table(at, "class", "metric", "p50", "p99")
    assert set(latency["class"]) == {"qa", "long"} and set(latency["metric"]) == {"TTFT", "per token", "end to end"}
    assert latency.loc[latency["metric"] == "TTFT", "p50"].tolist() == [50.0, 50.0]  # seeded ttft 0.05 s
    points = table(at, "time", "acceptance", "output_tokens_per_s")
    assert points["acceptance"].between(0, 1).all() and points["requests"].sum() == 120
    fleet = table(at, "instance_id", "settings_version", "behind")
    assert set(fleet["instance_id"]) == {"engine-a", "engine-b"} and not fleet["behind"].any()


def test_acceptance(api_url):
    at = page(api_url, "Acceptance")
    positions = table(at, "class", "position", "drafted", "accepted")
    assert sorted(positions["position"].unique()) == [0, 1, 2, 3]
    assert ((positions["accepted"] / positions["drafted"]) - positions["acceptance"]).abs().max() < 1e-9
    cells = table(at, "batch_bucket", "n", "steps")
    assert set(zip(cells["batch_bucket"], cells["n"])) == {(1, 3), (4, 3)}  # N=0 steps have nothing to accept
    assert cells.set_index("batch_bucket")["acceptance"].round(2).to_dict() == {1: 0.8, 4: 0.75}


def test_tuner_shows_decisions_and_switches_mode(api_url):
    at = page(api_url, "Tuner")
    assert metrics(at)["Mode (global)"] == "auto"
    # The error counts the paired measurement only: the unpaired 2.15x (drift between minutes) is left out.
    assert metrics(at)["Median |realised / predicted - 1|"] == "3.5%"  # |1.37 / 1.42 - 1|
    (caption,) = [c.value for c in at.caption if "paired minutes" in c.value]
    assert caption.startswith("1 decisions measured in paired minutes") and ", 1 unpaired" in caption
    decisions = table(at, "prompt_class", "action", "n_after", "realised_estimator", "realised_low", "reason")
    assert decisions["action"].tolist() == ["off", "keep", "set_n"]
    # Latency: the draft's prefill raised TTFT p95 by 30 % over the plain requests beside it; the
    # unpaired decision had none beside it (its TTFT is shown, not compared).
    assert metrics(at)["Median TTFT p95 change vs plain"] == "+30.0%"  # 2.08 / 1.60
    (caption,) = [c.value for c in at.caption if "plain requests of their class" in c.value]
    assert caption.startswith("1 decisions with plain requests") and ", 1 without" in caption
    assert decisions["ttft_p95_vs_plain"].round(2).fillna(-1).tolist() == [-1, -1, 1.3]  # off, keep, set_n
    at.selectbox(key="tuner_mode").set_value("advise").run()
    at.button(key="apply_mode").click().run()
    assert at.success and "advise" in at.success[0].value
    again = page(api_url, "Tuner")
    assert metrics(again)["Mode (global)"] == "advise"
    again.selectbox(key="tuner_mode").set_value("auto").run()
    again.button(key="apply_mode").click().run()


def test_policy_edit_rejected_by_the_api_shows_its_words(api_url):
    at = page(api_url, "Policies")
    before = at.text_area(key="policy_text").value
    bad = before.replace('"n_max": 6', '"n_max": 2')
    assert bad != before
    at.text_area(key="policy_text").set_value(bad).run()
    at.button(key="save_policy").click().run()
    assert len(at.error) == 1
    assert (
        at.error[0].value.startswith("Rejected (422):") and "must lie in [n_min, n_max] = [0, 2]" in at.error[0].value
    )
    # the rejected edit changed nothing; a valid one is saved as a new version
    good = before.replace('"num_speculative_tokens": 3', '"num_speculative_tokens": 4')
    at.text_area(key="policy_text").set_value(good).run()
    at.text_input(key="policy_reason").set_value("dashboard test").run()
    at.button(key="save_policy").click().run()
    assert not at.error and "Saved as version" in at.success[0].value
    versions = table(page(api_url, "Policies"), "version", "updated_by")
    assert versions["updated_by"].iloc[0] == "ola"


def test_viewer_sees_why_it_cannot_edit(api_url):
    at = page(api_url, "Policies", token="viewer-token")
    assert "viewer token" in at.warning[0].value
    at.button(key="save_policy").click().run()
    assert at.error[0].value == "Rejected (403): operator role required"


def test_bad_token_gets_a_sentence_not_a_trace(api_url):
    os.environ["SPECTUNE_TOKEN"] = "nope"
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception and at.error[0].value == "Enter a valid API token in the sidebar."


def test_diagnostics_report_and_running_state(api_url):
    at = page(api_url, "Diagnostics")
    reports = table(at, "id", "trigger", "status")
    assert sorted(reports["status"]) == ["done", "running"]
    running = int(reports.loc[reports["status"] == "running", "id"].iloc[0])
    done = int(reports.loc[reports["status"] == "done", "id"].iloc[0])
    assert at.selectbox(key="report_id").value == running  # newest first
    assert "Diagnosis running" in at.get("progress")[0].proto.text
    at.selectbox(key="report_id").set_value(done).run()
    assert any("fine-tune the draft" in m.value for m in at.markdown)
    assert metrics(at)["Draft / target latency per token"] == "0.40"
    per_position = table(at, "class", "position", "kind", "acceptance")
    assert per_position.query("kind == 'expected'")["acceptance"].tolist() == [0.3, 0.2, 0.15]
    assert table(at, "target_token", "draft_token")["draft_token"].tolist() == [" y"]


def test_diagnostics_show_the_fidelity_audit(api_url):
    at = page(api_url, "Diagnostics")
    summary = table(at, "class", "audited", "match", "near_tie", "defect")
    assert summary.iloc[0][["audited", "match", "near_tie", "defect"]].tolist() == [5, 3, 1, 1]
    assert any("1 audited request(s)" in e.value for e in at.error)
    divergences = table(at, "request_id", "result", "diverged_at")
    assert divergences["result"].tolist() == ["near_tie", "defect"]  # newest first


def test_alerts_link_to_their_diagnosis(api_url):
    at = page(api_url, "Alerts")
    assert metrics(at)["Firing now"] == "1"  # f00d resolved, beef firing
    events = table(at, "alert", "status", "diagnosis")
    assert len(events) == 3
    button = next(b for b in at.button if b.label.startswith("Open diagnosis"))
    button.click().run()
    assert at.sidebar.radio(key="page").value == "Diagnostics"
    assert any("fine-tune the draft" in m.value for m in at.markdown)


@pytest.fixture(scope="module")
def empty_api_url(tmp_path_factory):
    from spectune.store.db import upgrade

    url = f"sqlite:///{tmp_path_factory.mktemp('empty')}/empty.db"
    upgrade(url)
    yield from _api(url)


@pytest.mark.parametrize("name", ["Overview", "Acceptance", "Tuner", "Policies", "Diagnostics", "Alerts"])
def test_pages_on_an_empty_database_say_so(empty_api_url, name):
    at = page(empty_api_url, name)
    assert not at.error
    if name != "Policies":  # a policy always exists (created at start)
        assert at.info and all("yet" in i.value for i in at.info), [i.value for i in at.info]
