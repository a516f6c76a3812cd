"""`spectune grafana ...` and `spectune dashboard`: the operator-facing views."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

grafana_app = typer.Typer(help="Grafana dashboards and alert rules as code.", no_args_is_help=True)


@grafana_app.command("build")
def grafana_build() -> None:
    """Regenerate dashboards/grafana/ (dashboard JSON and provisioning YAML) from the code."""
    from spectune.dashboards.grafana.build import write

    for path in write():
        typer.echo(path)


@grafana_app.command("push")
def grafana_push(
    url: Annotated[str, typer.Option(help="Grafana base URL, e.g. http://grafana:3000")],
    token: Annotated[str, typer.Option(envvar="GRAFANA_TOKEN", help="Grafana service-account token")],
    webhook_url: Annotated[
        str, typer.Option(help="spectune's Alertmanager-compatible webhook, as Grafana reaches it")
    ] = "http://spectune:8000/api/v1/alerts/alertmanager",
    webhook_token: Annotated[
        str, typer.Option(envvar="SPECTUNE_OPERATOR_TOKEN", help="operator token Grafana sends to the webhook")
    ] = "",
) -> None:
    """Upload the dashboard, contact point, notification route and alert rule (idempotent)."""
    from grafana_client.client import GrafanaClientError

    from spectune.dashboards.grafana.push import push

    if not webhook_token:
        raise typer.BadParameter("set --webhook-token or SPECTUNE_OPERATOR_TOKEN", param_hint="--webhook-token")
    try:
        report = push(url, token, webhook_url, webhook_token)
    except GrafanaClientError as exc:
        typer.echo(f"Grafana refused: {exc.status_code} {exc.message}", err=True)
        raise typer.Exit(1) from exc
    except Exception as exc:  # connection refused, DNS, timeouts: a clear line, not a traceback
        typer.echo(f"could not reach Grafana at {url}: {exc}", err=True)
        raise typer.Exit(1) from exc
    for step in report.steps:
        typer.echo(step)


def dashboard(
    api_url: Annotated[
        str, typer.Option(envvar="SPECTUNE_API_URL", help="spectune REST API")
    ] = "http://127.0.0.1:8000",
    token: Annotated[str | None, typer.Option(envvar="SPECTUNE_TOKEN", help="viewer or operator token")] = None,
    port: Annotated[int, typer.Option(help="port for the dashboard")] = 8501,
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
) -> None:
    """Start the Streamlit operator dashboard (reads everything through the REST API)."""
    from spectune.dashboards.operator import __file__ as operator_init  # editable or installed alike

    app = Path(operator_init).parent / "app.py"
    env = dict(os.environ, SPECTUNE_API_URL=api_url)
    if token:
        env["SPECTUNE_TOKEN"] = token
    args = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(app),
        "--server.port",
        str(port),
        "--server.address",
        host,
        "--server.headless",
        "true",
        "--browser.gatherUsageStats",
        "false",
        "--client.toolbarMode",
        "viewer",
    ]
    # Streamlit replaces this process: a SIGTERM (systemd, docker stop, a test) reaches the server
    # itself, which shuts down, instead of killing a parent and orphaning a listening child.
    sys.stdout.flush()
    os.execve(sys.executable, args, env)
