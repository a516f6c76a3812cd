"""A throwaway PostgreSQL server for tests (Debian's postgresql package).

Runs as the ``postgres`` user (initdb refuses root) in a temp dir on a free
loopback port; ``stop``/``start`` let the outage test take it away and bring
it back.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def _bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def available() -> bool:
    return all(_bin(n) for n in ("initdb", "pg_ctl")) and _user_exists("postgres")


def _user_exists(name: str) -> bool:
    import pwd

    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


class PgServer:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="spectune-pg-"))
        self.data = self.root / "data"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self._as_root = os.geteuid() == 0

    def _run(self, *args: str) -> None:
        cmd = list(args)
        if self._as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)

    def init(self) -> PgServer:
        if self._as_root:
            shutil.chown(self.root, "postgres")
        self._run(_bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(
                f"port = {self.port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{self.root}'\n"
                "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n"
            )
        return self.start()

    def start(self) -> PgServer:
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.root / "log"), "-w", "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def _processes(self) -> list:
        import psutil

        postmaster = psutil.Process(int((self.data / "postmaster.pid").read_text().split()[0]))
        return [postmaster, *postmaster.children(recursive=True)]

    def freeze(self) -> None:
        """SIGSTOP the server and every backend: connections stay open, nothing answers (a hung database)."""
        for process in self._processes():
            process.suspend()

    def thaw(self) -> None:
        for process in self._processes():
            process.resume()

    def destroy(self) -> None:
        try:
            self.stop("immediate")
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)

    def reset(self) -> None:
        """Drop everything in the public schema (between tests)."""
        import psycopg

        deadline = time.time() + 10
        while True:
            try:
                with psycopg.connect(
                    f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True
                ) as conn:
                    conn.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
                return
            except psycopg.OperationalError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
