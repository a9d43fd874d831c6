"""The suite's real PostgreSQL server: one session fixture (`postgres`, a plugin of conftest.py) that every test
module asking for it shares. Debian's `postgresql` package is installed when it is missing and this user can (root
and apt-get; otherwise those tests skip and say why), a fresh cluster is made with `initdb` in a temporary folder
(as the `postgres` user when this is root, since initdb refuses root) with its own port and socket folder,
listening on 127.0.0.1 only, and the server is stopped by its PID afterwards."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import apt_install_or_skip, free_port


def postgres_bin() -> Path | None:
    """The folder of initdb and postgres: Debian's /usr/lib/postgresql/<version>/bin, newest first, or PATH."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name)
                   if p.parent.parent.name.isdigit() else 0)
    if found:
        return found[-1].parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def ensure_postgres() -> Path:
    """The server's binaries, installing Debian's postgresql when they are missing and possible; else skip."""
    pytest.importorskip("psycopg", reason="the PostgreSQL driver is an extra: pip install -e .[postgres]")
    if postgres_bin() is not None:
        return postgres_bin()
    apt_install_or_skip("PostgreSQL is not installed (no initdb)", ["postgresql"], "PostgreSQL")
    if postgres_bin() is None:
        pytest.skip("apt-get installed postgresql, but no initdb was found under /usr/lib/postgresql")
    return postgres_bin()


class PostgresServer:
    """One PostgreSQL cluster in a temporary folder: initdb, the server process, databases, stop by PID."""

    def __init__(self, bindir: Path) -> None:
        self.bindir, self.port, self.proc = bindir, free_port(), None
        # initdb refuses root: as root the cluster belongs to the `postgres` user, in a folder it can reach
        self.user = "postgres" if os.geteuid() == 0 else None
        self.dir = Path(tempfile.mkdtemp(prefix="attnlab-pg-"))
        if self.user:
            os.chown(self.dir, pwd.getpwnam(self.user).pw_uid, pwd.getpwnam(self.user).pw_gid)
        self.log = self.dir / "server.log"

    def run(self, *cmd: str) -> None:
        r = subprocess.run([str(self.bindir / cmd[0]), *cmd[1:]], capture_output=True, text=True, timeout=120,
                           user=self.user, cwd=self.dir)
        if r.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr or r.stdout}")

    def start(self) -> None:
        data, sock = self.dir / "data", self.dir / "socket"
        self.run("initdb", "-D", str(data), "-U", "attnlab", "-A", "trust", "-E", "UTF8", "--locale=C.UTF-8",
                 "--no-sync", "--no-instructions")
        os.makedirs(sock)
        if self.user:
            os.chown(sock, pwd.getpwnam(self.user).pw_uid, pwd.getpwnam(self.user).pw_gid)
        out = open(self.log, "w")
        self.proc = subprocess.Popen([str(self.bindir / "postgres"), "-D", str(data), "-p", str(self.port), "-k",
                                      str(sock), "-c", "listen_addresses=127.0.0.1", "-c", "max_connections=200"],
                                     stdout=out, stderr=subprocess.STDOUT, user=self.user, cwd=self.dir)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                self.connect("postgres").close()
                return
            except Exception:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.2)
        raise AssertionError(f"PostgreSQL did not start:\n{self.log.read_text(errors='replace')[-3000:]}")

    def connect(self, db: str):
        import psycopg  # the optional driver (the postgres extra)

        return psycopg.connect(host="127.0.0.1", port=self.port, user="attnlab", dbname=db, connect_timeout=5,
                               autocommit=True)

    def new_database(self, name: str) -> str:
        conn = self.connect("postgres")
        try:
            conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()
        return f"postgresql://attnlab@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # "fast shutdown": disconnects clients, then stops
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres():
    server = PostgresServer(ensure_postgres())
    try:
        server.start()
        yield server
    finally:
        server.stop()
