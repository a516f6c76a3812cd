"""engine/lifeline.py on a stand-in for `spectune serve` (no vLLM: seconds, not minutes): whether the
server is killed with -9 or simply exits, every process it started ends -- the engine-core-like
child that follows its parent, a helper that ignores SIGTERM, an orphan known only by its mark --
its socket directory goes, and a process it did not start is left alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from leftovers import await_gone

STAND_IN = textwrap.dedent(
    """
    import json, multiprocessing, os, signal, subprocess, sys, time
    from spectune.engine import lifeline

    STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"
    SLEEP = [sys.executable, "-c", STUBBORN]

    def engine_core(out):
        lifeline.plugin()  # what vLLM's plugin loader runs in every process it starts
        stubborn = subprocess.Popen(SLEEP)  # a helper that ignores SIGTERM: only SIGKILL ends it
        with open(out, "w") as f:
            json.dump({"core": os.getpid(), "stubborn": stubborn.pid}, f)
        time.sleep(3600)

    if __name__ == "__main__":
        sockets = lifeline.start()
        # an orphan: its parent exits at once, so only the mark in its environment ties it to us
        orphan = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                                   "print(subprocess.Popen(sys.argv[1:]).pid)", *SLEEP], stdout=subprocess.PIPE)
        orphan_pid = int(orphan.stdout.readline())
        orphan.wait()
        core = multiprocessing.get_context("spawn").Process(target=engine_core, args=(sys.argv[1] + ".core",))
        core.start()
        while not os.path.exists(sys.argv[1] + ".core"):
            time.sleep(0.05)
        tree = json.load(open(sys.argv[1] + ".core"))
        with open(sys.argv[1], "w") as f:
            json.dump({**tree, "orphan": orphan_pid, "sockets": str(sockets)}, f)
        if sys.argv[2] == "exit":
            os._exit(0)  # an exit that stops nothing it started
        time.sleep(3600)
    """
)


def _start_stand_in(tmp_path: Path, how: str) -> tuple[subprocess.Popen, dict]:
    script, out = tmp_path / "stand_in.py", tmp_path / "tree.json"
    script.write_text(STAND_IN)
    env = {k: v for k, v in os.environ.items() if k != "SPECTUNE_LIFELINE"}
    proc = subprocess.Popen([sys.executable, str(script), str(out), how], env=env)
    deadline = time.monotonic() + 120  # only stops a hang
    while not out.exists() or not out.read_text().endswith("}"):
        assert proc.poll() is None or how == "exit", "stand-in died"
        assert time.monotonic() < deadline, "stand-in never started its tree"
        time.sleep(0.05)
    return proc, json.loads(out.read_text())


def _tree(found: dict) -> list[psutil.Process]:
    return [psutil.Process(found[name]) for name in ("core", "stubborn", "orphan")]


@pytest.mark.parametrize("how", ["kill -9", "exit"])
def test_nothing_the_server_started_outlives_it(tmp_path, how):
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        proc, found = _start_stand_in(tmp_path, "exit" if how == "exit" else "wait")
        tree = _tree(found)
        assert Path(found["sockets"]).is_dir()
        if how == "kill -9":
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        ended_at = time.monotonic()
        assert await_gone(tree) == [], "processes outlived the server"
        print(f"tree ended {time.monotonic() - ended_at:.1f} s after the server")
        deadline = time.monotonic() + 60
        while Path(found["sockets"]).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(found["sockets"]).exists(), "the socket directory was left behind"
        assert bystander.poll() is None, "a process the server did not start was ended"
    finally:
        bystander.kill()
        bystander.wait()


def test_the_plugin_does_nothing_outside_spectune_serve(monkeypatch):
    from spectune.engine import lifeline

    monkeypatch.delenv(lifeline.MARK_ENV, raising=False)
    lifeline.plugin()  # no mark: a plain `vllm serve` with spectune installed is left as it is
    monkeypatch.setenv(lifeline.MARK_ENV, "x")
    lifeline.plugin()  # the mark but no multiprocessing parent: the serve process itself
    assert not lifeline._following


INNER_TEST = textwrap.dedent(
    """
    import subprocess, sys, time

    def test_a_server_in_flight():
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
        open({out!r}, "w").write(str(child.pid))
        time.sleep(3600)
    """
)


def test_a_stopped_test_run_ends_what_its_tests_started(tmp_path):
    """SIGTERM to a pytest run (a CI job cancelled, a developer's kill) ends it as an interrupted run,
    and tests/conftest.py's end-of-run check ends the processes its tests had started."""
    out = tmp_path / "child.pid"
    (tmp_path / "test_inner.py").write_text(INNER_TEST.format(out=str(out)))
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent)])}
    inner = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q", "test_inner.py"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120  # only stops a hang
    while not out.exists() or not out.read_text():
        assert inner.poll() is None, inner.stdout.read()
        assert time.monotonic() < deadline, "the inner test never started its child"
        time.sleep(0.1)
    child = psutil.Process(int(out.read_text()))
    inner.send_signal(signal.SIGTERM)
    output = inner.communicate(timeout=300)[0]
    assert "outlived them (now ended)" in output, output
    assert await_gone([child]) == [], "the stopped run's child is still alive"
