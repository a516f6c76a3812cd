"""The docker stack is validated, not run (no Docker engine here): compose
parses, every service has a healthcheck, the images run the README's
commands, and Prometheus' config (with the rules) checks out."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str, env_flag: str) -> str:
    found = shutil.which(name)
    if found is None:
        if os.environ.get(env_flag):
            pytest.fail(f"{name} not found but {env_flag} is set")
        pytest.skip(f"{name} not installed")
    return found


def test_compose_validates_and_every_service_has_a_healthcheck():
    compose = _tool("docker-compose", "SPECTUNE_REQUIRE_COMPOSE")
    out = subprocess.run(
        [compose, "-f", str(ROOT / "docker" / "compose.yaml"), "config", "-q"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]
    assert {"postgres", "control-plane", "engine", "router", "prometheus", "alertmanager"} <= set(services)
    assert [name for name, s in services.items() if "healthcheck" not in s] == []


def test_the_fleet_scales_engines_behind_a_router_and_one_control_plane():
    compose = _tool("docker-compose", "SPECTUNE_REQUIRE_COMPOSE")
    out = subprocess.run(
        [compose, "-f", str(ROOT / "docker" / "compose.yaml"), "config"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]  # as compose resolved it
    engine, control = services["engine"], services["control-plane"]
    assert "ports" not in engine and "container_name" not in engine  # scalable: no fixed host port or name
    assert engine["command"][-2:] == ["--control-plane", "http://control-plane:8000"]
    assert "--no-engine" in control["command"]
    assert engine["environment"]["SPECTUNE_DB"] == control["environment"]["SPECTUNE_DB"]  # one store
    router = (ROOT / "docker" / "router.conf").read_text()
    assert "server engine:8000 resolve" in router
    prometheus = yaml.safe_load((ROOT / "dashboards" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert jobs["spectune-engines"]["dns_sd_configs"][0]["names"] == ["engine"]


def test_images_run_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"```bash\n(.+?)\n```", readme).group(1)
    assert first == "scripts/bootstrap && .venv/bin/spectune models prepare && .venv/bin/spectune serve"
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.gpu"):
        text = (ROOT / "docker" / dockerfile).read_text()
        assert "scripts/bootstrap" in text and ".venv/bin/spectune models prepare" in text
        assert 'CMD [".venv/bin/spectune", "serve"' in text


def test_prometheus_config_checks_out():
    promtool = _tool("promtool", "SPECTUNE_REQUIRE_PROMTOOL")
    out = subprocess.run(
        [promtool, "check", "config", str(ROOT / "dashboards" / "prometheus" / "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    am = yaml.safe_load((ROOT / "dashboards" / "alertmanager" / "alertmanager.yml").read_text())
    (hook,) = am["receivers"][0]["webhook_configs"]
    assert hook["url"].endswith("/api/v1/alerts/alertmanager") and hook["send_resolved"]


def test_grafana_and_dashboard_services_use_the_generated_files():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    grafana = compose["services"]["grafana"]
    for volume in grafana["volumes"]:
        source = volume.split(":")[0]
        if source.startswith(".."):
            assert (ROOT / "docker" / source).resolve().exists(), source
    assert (ROOT / "dashboards" / "grafana" / "provisioning" / "alerting" / "spectune.yaml").exists()
    assert compose["services"]["dashboard"]["command"][:2] == [".venv/bin/spectune", "dashboard"]
