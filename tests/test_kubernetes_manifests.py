"""The Kubernetes manifests (docker/kubernetes) are checked offline: no cluster and no schema checker
install here, so kustomize builds them (where kubectl is installed) and the references a cluster
would only find broken at run time are checked against the code: labels and selectors, named ports,
probe paths, `spectune serve` flags, SPECTUNE_* variables, the Secret's keys."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from spectune.cli import app as cli
from spectune.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "docker" / "kubernetes"
SECRET_KEYS = {"db-url", "api-tokens", "engine-token"}  # what the README tells operators to create


def _documents() -> list[dict]:
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"] for doc in yaml.safe_load_all((MANIFESTS / name).read_text())]


def _workloads() -> list[dict]:
    return [d for d in _documents() if d["kind"] in ("Deployment", "StatefulSet")]


def _containers() -> list[dict]:
    return [c for w in _workloads() for c in w["spec"]["template"]["spec"]["containers"]]


def test_kustomize_builds_the_manifests():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed")
    out = subprocess.run([kubectl, "kustomize", str(MANIFESTS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    built = list(yaml.safe_load_all(out.stdout))
    assert sorted(d["kind"] for d in built) == ["Deployment", "Service", "Service", "Service", "StatefulSet"]
    assert all(d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "spectune" for d in built)


def test_selectors_services_and_ports_line_up():
    workloads = _workloads()
    for w in workloads:
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items(), w["metadata"]["name"]
    for service in (d for d in _documents() if d["kind"] == "Service"):
        selector = service["spec"]["selector"].items()
        (target,) = [w for w in workloads if selector <= w["spec"]["template"]["metadata"]["labels"].items()]
        ports = {p["name"] for c in target["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports, service["metadata"]["name"]
    (engines,) = [w for w in workloads if w["kind"] == "StatefulSet"]
    services = {d["metadata"]["name"]: d for d in _documents() if d["kind"] == "Service"}
    assert services[engines["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"  # headless: per-pod names


def test_commands_probes_and_variables_are_the_codes():
    from spectune.app import SPECTUNE_PATHS

    serve_help = CliRunner().invoke(cli, ["serve", "--help"], env={"COLUMNS": "200"}).output
    fields = {f"SPECTUNE_{name.upper()}" for name in Settings.model_fields}
    control = {d["metadata"]["name"]: d for d in _documents() if d["kind"] == "Service"}["spectune-control-plane"]
    for container in _containers():
        command = container["command"]
        assert command[:2] == [".venv/bin/spectune", "serve"]  # the image's venv (docker/Dockerfile.cpu)
        for flag in (a for a in command if a.startswith("--")):
            assert flag in serve_help, f"{container['name']}: spectune serve has no {flag}"
        for env in container["env"]:
            assert env["name"] in fields, f"{container['name']}: {env['name']} is no setting"
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            assert ref is None or (ref["name"] == "spectune" and ref["key"] in SECRET_KEYS), env
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
        assert command[command.index("--port") + 1] == str(port)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in container:
                path = container[probe]["httpGet"]["path"]
                assert path in SPECTUNE_PATHS, f"{container['name']} {probe}: {path}"
        if "--control-plane" in command:
            url = command[command.index("--control-plane") + 1]
            assert url == f"http://{control['metadata']['name']}:{control['spec']['ports'][0]['port']}"
            assert "SPECTUNE_CONTROL_PLANE_TOKEN" in {e["name"] for e in container["env"]}
            assert {"fieldPath": "metadata.name"} in [e.get("valueFrom", {}).get("fieldRef") for e in container["env"]]
    readme = (ROOT / "README.md").read_text()
    assert all(f"--from-literal={key}=" in readme for key in SECRET_KEYS)  # operators are told every key
