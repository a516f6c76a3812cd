"""The dashboard in a real browser: Debian's chromium driven by Playwright
(``executable_path``) against a running stack (`spectune serve` with the tiny
models on a seeded database + `spectune dashboard`). Every page is opened from the
sidebar, its charts are awaited, and a full-page screenshot is saved under
var/test-artifacts/dashboard/. A page that shows an exception fails the test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import free_port, serve_tiny
from dashboard_seed import seed

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "var" / "test-artifacts" / "dashboard"
CHROMIUM = "/usr/bin/chromium"
CHARTS = {"Overview": 2, "Acceptance": 2, "Tuner": 4, "Policies": 0, "Diagnostics": 0, "Alerts": 0}


def _start_dashboard(api_url: str, root: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    ui = subprocess.Popen(
        [sys.executable, "-m", "spectune.cli", "dashboard", "--api-url", api_url, "--token", "operator-token",
         "--port", str(port)],
        stdout=(root / f"dashboard-{port}.log").open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        assert ui.poll() is None, (root / f"dashboard-{port}.log").read_text()
        try:
            if httpx.get(f"{url}/_stcore/health", timeout=2).text == "ok":
                return ui, url
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, "dashboard did not become healthy"
        time.sleep(0.5)


def _browser(pw):
    return pw.chromium.launch(
        executable_path=CHROMIUM,
        args=["--no-sandbox", "--disable-background-networking", "--disable-dev-shm-usage", "--disable-gpu"],
    )


@pytest.fixture(scope="module")
def dashboard_url(tiny, tmp_path_factory):
    if not Path(CHROMIUM).exists():
        if os.environ.get("SPECTUNE_REQUIRE_BROWSER"):
            pytest.fail("chromium not found but CI requires it (apt-get install chromium)")
        pytest.skip("Debian chromium not installed (apt-get install chromium)")
    root = tmp_path_factory.mktemp("browser")
    db = f"sqlite:///{root}/dash.db"
    seed(db)
    # the whole stack: engine (tiny models) + recorder + API + scheduler, on the seeded database
    api, api_url = serve_tiny(tiny, root, "--db", db, SPECTUNE_TUNER_INTERVAL_S="86400")
    ui, url = _start_dashboard(api_url, root)
    yield url
    for proc in (ui, api):
        proc.terminate()
        proc.wait(timeout=30)


def _assert_no_exception(page, name: str) -> None:
    exceptions = page.locator('[data-testid="stException"]')
    assert exceptions.count() == 0, f"{name}: {exceptions.first.inner_text()}"
    body = page.locator("section.main, [data-testid='stMain']").first.inner_text()
    for marker in ("Traceback", "Something went wrong", "The API answered", "The API refused"):
        assert marker not in body, f"{name} shows an error: {body[:500]}"


def test_every_page_renders_with_its_charts(dashboard_url):
    from playwright.sync_api import sync_playwright

    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    with sync_playwright() as pw:
        browser = _browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(dashboard_url, wait_until="networkidle")
        page.wait_for_selector("[data-testid='stSidebar']", timeout=60_000)
        for name, charts in CHARTS.items():
            page.locator("[data-testid='stSidebar'] label").filter(has_text=name).first.click()
            page.get_by_role("heading", name=name).first.wait_for(timeout=60_000)
            if charts:
                page.wait_for_function(
                    "n => document.querySelectorAll('.vega-embed canvas, .vega-embed svg').length >= n",
                    arg=charts,
                    timeout=60_000,
                )
            page.wait_for_timeout(1500)  # let Streamlit settle (no running indicator)
            _assert_no_exception(page, name)
            page.screenshot(path=str(ARTIFACTS / f"{name.lower()}.png"), full_page=True)
        browser.close()
    shots = sorted(p.name for p in ARTIFACTS.glob("*.png"))
    assert shots == sorted(f"{n.lower()}.png" for n in CHARTS)
    assert all((ARTIFACTS / s).stat().st_size > 20_000 for s in shots)


def test_the_check_fails_on_a_page_that_shows_an_error(dashboard_url, tmp_path):
    """The same check against a dashboard whose API is down must fail (the check can fail)."""
    from playwright.sync_api import sync_playwright

    ui, url = _start_dashboard(f"http://127.0.0.1:{free_port()}", tmp_path)
    try:
        with sync_playwright() as pw:
            browser = _browser(pw)
            page = browser.new_page()
            page.goto(url, wait_until="networkidle")
            page.get_by_text("The API refused").first.wait_for(timeout=60_000)
            with pytest.raises(AssertionError, match="shows an error"):
                _assert_no_exception(page, "Overview")
            browser.close()
    finally:
        ui.terminate()
        ui.wait(timeout=30)
