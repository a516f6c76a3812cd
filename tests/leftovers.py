"""No process the tests start outlives the test run (#25): pytest becomes the child subreaper, so
every process started under it stays its descendant even when its own parent dies (a killed
``spectune serve``'s engine core is re-parented to pytest, not to init), and the end-of-run check
lists what is still alive."""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections.abc import Callable

import psutil

from spectune.engine.lifeline import end

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _reap(process: psutil.Process) -> bool:
    """True when ``process`` has ended (a zombie of ours is reaped on the way)."""
    try:
        if process.status() != psutil.STATUS_ZOMBIE:
            return False
        if process.ppid() == os.getpid():
            with contextlib.suppress(ChildProcessError):
                os.waitpid(process.pid, os.WNOHANG)
        return True
    except psutil.NoSuchProcess:
        return True


def cmdline(process: psutil.Process) -> str:
    """A process's command line; "" for one that ended or is a zombie (psutil raises ZombieProcess
    on its cmdline: a server an earlier test killed and its Popen never reaped)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def _pytests_own(process: psutil.Process) -> bool:
    """Helpers that live as long as pytest and end with it: multiprocessing's resource tracker,
    started by an engine that ran inside the pytest process."""
    try:
        return process.ppid() == os.getpid() and "multiprocessing.resource_tracker" in cmdline(process)
    except psutil.Error:
        return True


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in processes if not _reap(p)]


def _until_none(alive_now: Callable[[], list[psutil.Process]], deadline_s: float) -> list[psutil.Process]:
    """Poll ``alive_now`` until it is empty (the deadline only stops a hang); returns its last answer."""
    deadline = time.monotonic() + deadline_s
    left = alive_now()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = alive_now()
    return left


def await_gone(processes: list[psutil.Process], deadline_s: float = 120.0) -> list[psutil.Process]:
    """Wait until every process has ended; returns those still alive at the deadline."""
    return _until_none(lambda: alive(processes), deadline_s)


def descendants() -> list[psutil.Process]:
    """This process's live descendants, less pytest's own helpers."""
    return [p for p in alive(psutil.Process().children(recursive=True)) if not _pytests_own(p)]


def leftovers(deadline_s: float = 120.0) -> list[str]:
    """Descendants still alive once the deadline has passed (each described), ended on the way out
    (SIGTERM, then SIGKILL) so that a failed or stopped run leaves the machine clean."""
    left = _until_none(descendants, deadline_s)
    described = [f"{process.pid} ({line[:160]})" for process in left if (line := cmdline(process))]  # "": it ended
    end(left)
    return described
