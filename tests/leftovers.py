"""No process the tests start outlives the test run (#25): pytest becomes the child subreaper, so
every process started under it stays its descendant even when its own parent dies (a killed
``spectune serve``'s engine core is re-parented to pytest, not to init), and the end-of-run check
lists what is still alive."""

from __future__ import annotations

import contextlib
import ctypes
import os
import time

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


def _pytests_own(process: psutil.Process) -> bool:
    """Helpers that live as long as pytest and end with it: multiprocessing's resource tracker,
    started by an engine that ran inside the pytest process."""
    try:
        return process.ppid() == os.getpid() and "multiprocessing.resource_tracker" in " ".join(process.cmdline())
    except psutil.Error:
        return True


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in processes if not _reap(p)]


def await_gone(processes: list[psutil.Process], deadline_s: float = 120.0) -> list[psutil.Process]:
    """Wait until every process has ended (the deadline only stops a hang); returns those still alive."""
    end = time.monotonic() + deadline_s
    left = alive(processes)
    while left and time.monotonic() < end:
        time.sleep(0.1)
        left = alive(left)
    return left


def descendants() -> list[psutil.Process]:
    """This process's live descendants, less pytest's own helpers."""
    return [p for p in alive(psutil.Process().children(recursive=True)) if not _pytests_own(p)]


def leftovers(deadline_s: float = 120.0) -> list[str]:
    """Descendants still alive once the deadline has passed (each described), ended on the way out
    (SIGTERM, then SIGKILL) so that a failed or stopped run leaves the machine clean."""
    deadline = time.monotonic() + deadline_s
    left = descendants()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = descendants()
    described = []
    for process in left:
        with contextlib.suppress(psutil.Error):
            described.append(f"{process.pid} ({' '.join(process.cmdline())[:160]})")
    end(left)
    return described
