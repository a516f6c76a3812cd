"""No process outlives ``spectune serve``: engine cores, workers, helpers and their files end with it.

vLLM starts an engine-core process, which starts a worker, and both start helpers (the
multiprocessing resource tracker, compiler probes).  Killed with -9, ``spectune serve`` leaves them
all running, re-parented to init: on a GPU host they hold the device's memory, so a supervisor's
restart fails to allocate or two engines fight over one device.  Two mechanisms, because either
alone misses processes:

- **Each vLLM process follows its parent** (``plugin``, a vLLM general plugin, loaded in every
  process vLLM starts): a thread waits on a pidfd of the parent and, when the parent is gone,
  sends this process SIGTERM (vLLM's own clean shutdown, which ends its children) and exits hard
  after ``GRACE_S`` if that hangs.  A pidfd, not ``PR_SET_PDEATHSIG``: that signal fires when the
  parent *thread* that started the child ends, and a rebuild starts engines from worker threads.
- **A watcher outside the tree** (``start``, then ``python -m spectune.engine.lifeline``, in a
  session of its own) waits on the serve process and then ends every process that carries this
  run's mark in its environment, and their descendants: SIGTERM, SIGKILL after ``GRACE_S``.  The
  mark alone is not enough: vLLM renames its processes with setproctitle, which overwrites the
  memory /proc/PID/environ is read from, so the engine core and the worker lose it (the plugin
  covers them).  The watcher also removes this run's directory of vLLM IPC sockets
  (``VLLM_RPC_BASE_PATH``), which vLLM otherwise leaves in /tmp, one per engine ever started.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

MARK_ENV = "SPECTUNE_LIFELINE"
"""Environment variable every process under one ``spectune serve`` inherits: that run's mark."""
GRACE_S = 5.0
"""Seconds between SIGTERM and SIGKILL (and a follower's hard exit): vLLM's engine core stops its
worker and frees shared memory in well under that when it is not stuck."""
SWEEPS = 5
"""The watcher sweeps again while a sweep found processes: one may have started a child as it died."""

_following = False


def start() -> Path:
    """Mark this process's future children, give vLLM a private socket directory and start the
    watcher.  Call once in the serve process before any engine starts; returns the socket directory."""
    mark = f"{os.getpid()}-{secrets.token_hex(8)}"
    sockets = Path(tempfile.mkdtemp(prefix="spectune-ipc-"))
    os.environ[MARK_ENV] = mark
    os.environ["VLLM_RPC_BASE_PATH"] = str(sockets)
    me = os.pidfd_open(os.getpid())
    try:
        subprocess.Popen(
            [sys.executable, "-m", "spectune.engine.lifeline", str(me), mark, str(sockets)],
            pass_fds=(me,),
            start_new_session=True,  # a kill of the server's process group spares the watcher
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
    finally:
        os.close(me)
    return sockets


def plugin() -> None:
    """vLLM general plugin (entry point ``spectune_lifeline``): in a process vLLM started under
    ``spectune serve`` (its mark set), end this process when its parent ends."""
    if MARK_ENV in os.environ and multiprocessing.parent_process() is not None:
        follow_parent()


def follow_parent() -> None:
    """End this process when its parent ends: SIGTERM to itself, a hard exit ``GRACE_S`` later.
    Idempotent (vLLM loads plugins more than once per process)."""
    global _following
    if _following:
        return
    _following = True
    parent = os.getppid()
    try:
        pidfd = os.pidfd_open(parent)
    except ProcessLookupError:
        pidfd = None
    if pidfd is not None and os.getppid() != parent:  # re-parented between the two calls
        os.close(pidfd)
        pidfd = None
    threading.Thread(target=_end_with_parent, args=(pidfd,), name="spectune-lifeline", daemon=True).start()


def _end_with_parent(pidfd: int | None) -> None:
    if pidfd is not None:
        select.select([pidfd], [], [])  # readable once the parent has exited
    log.warning("parent process gone: process %d ends", os.getpid())
    os.kill(os.getpid(), signal.SIGTERM)
    threading.Event().wait(GRACE_S)  # still here: the SIGTERM handler is stuck
    os._exit(1)


def marked_processes(mark: str) -> list:
    """Processes whose environment holds ``MARK_ENV=mark``, with all their descendants (not this one)."""
    import psutil

    found: dict[int, psutil.Process] = {}
    for process in psutil.process_iter():
        try:
            if process.environ().get(MARK_ENV) == mark:
                found[process.pid] = process
                found.update((child.pid, child) for child in process.children(recursive=True))
        except psutil.Error:  # ended, a zombie, or another user's
            continue
    found.pop(os.getpid(), None)  # the watcher inherited the mark
    return list(found.values())


def end(processes: list) -> list:
    """SIGTERM, SIGKILL after ``GRACE_S`` for those still alive; returns those that survived both."""
    import psutil

    for process in processes:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(processes, timeout=GRACE_S)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    return psutil.wait_procs(alive, timeout=GRACE_S)[1]


def watch(pidfd: int, mark: str, sockets: Path) -> None:
    """The watcher: wait for the serve process, then end its marked processes and remove its sockets."""
    select.select([pidfd], [], [])
    for _ in range(SWEEPS):
        left = marked_processes(mark)
        if not left:
            break
        log.warning("spectune serve ended: ending %d process(es) it left: %s", len(left), [p.pid for p in left])
        survivors = end(left)
        if survivors:
            log.error("could not end %s", [p.pid for p in survivors])
    shutil.rmtree(sockets, ignore_errors=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:spectune.lifeline:%(message)s")
    watch(int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
