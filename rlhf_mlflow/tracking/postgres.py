"""A PostgreSQL cluster for the shared tracking server: find the binaries, initialise a cluster with a
password-protected `mlflow` role, start it on loopback only, create a database, stop it.

Binaries come from RLHF_PG_BIN, else the PATH, else Debian's /usr/lib/postgresql/<version>/bin, else
the `pgserver` package (a pip-installable PostgreSQL build). PostgreSQL refuses to run as root, so
as root the cluster runs as the `postgres` user (or `nobody`), which then owns the data directory.
"""
from __future__ import annotations

import glob
import logging
import os
import pwd
import secrets
import shutil
import subprocess
import time

from rlhf_mlflow.core.errors import InputError

log = logging.getLogger(__name__)
ROLE = "mlflow"


def find_pg_bin(explicit: str | None = None) -> str:
    """The directory holding initdb, pg_ctl and postgres."""
    candidates = [explicit, os.environ.get("RLHF_PG_BIN")]
    on_path = shutil.which("pg_ctl")
    candidates.append(os.path.dirname(os.path.realpath(on_path)) if on_path else None)
    debian = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2].split(".")[0]))
    candidates += list(reversed(debian))
    try:
        import pgserver
        candidates.append(os.path.join(os.path.dirname(pgserver.__file__), "pginstall", "bin"))
    except ImportError:
        pass
    for d in candidates:
        if d and all(os.access(os.path.join(d, b), os.X_OK) for b in ("initdb", "pg_ctl", "postgres")):
            return d
    raise InputError("no PostgreSQL server binaries found (initdb, pg_ctl, postgres): install them "
                     "(`apt-get install postgresql`, or `pip install pgserver`) or point RLHF_PG_BIN at them")


def _run_as() -> str | None:
    """The user the cluster runs as when we are root (None: ourselves)."""
    if os.geteuid() != 0:
        return None
    for name in (os.environ.get("RLHF_PG_USER"), "postgres", "nobody"):
        if name:
            try:
                return pwd.getpwnam(name).pw_name
            except KeyError:
                continue
    raise InputError("running as root, and PostgreSQL refuses root: create a `postgres` user or set RLHF_PG_USER")


class Postgres:
    """One cluster in `data_dir` listening on 127.0.0.1:`port` (no Unix socket)."""

    def __init__(self, data_dir: str, port: int, bin_dir: str | None = None):
        self.data_dir = os.path.abspath(data_dir)
        self.port = port
        self.bin_dir = find_pg_bin(bin_dir)
        self.user = _run_as()
        self.password_file = self.data_dir + ".password"

    def _cmd(self, binary: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [os.path.join(self.bin_dir, binary), *args]
        if self.user:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if check and out.returncode != 0:
            raise RuntimeError(f"{binary} failed ({out.returncode}): {(out.stderr or out.stdout).strip()[-2000:]}")
        return out

    @property
    def password(self) -> str:
        with open(self.password_file) as f:
            return f.read().strip()

    def init(self) -> None:
        """Create the cluster once (a cluster already in data_dir is kept, with its password)."""
        if os.path.isfile(os.path.join(self.data_dir, "PG_VERSION")):
            return
        os.makedirs(self.data_dir, exist_ok=True)
        password = secrets.token_urlsafe(24)
        old = os.umask(0o077)
        try:
            with open(self.password_file, "w") as f:
                f.write(password + "\n")
        finally:
            os.umask(old)
        pwfile = self.data_dir + ".initdb-pw"  # initdb reads it as the cluster's user
        with open(pwfile, "w") as f:
            f.write(password + "\n")
        if self.user:
            entry = pwd.getpwnam(self.user)
            os.chown(self.data_dir, entry.pw_uid, entry.pw_gid)
            os.chown(pwfile, entry.pw_uid, entry.pw_gid)
            if not _reachable(self.user, pwfile):
                os.remove(pwfile)
                raise InputError(f"PostgreSQL runs as user {self.user!r} (it refuses root), which cannot reach "
                                 f"{self.data_dir}: choose a directory every user can traverse (e.g. under /var/tmp)")
        os.chmod(self.data_dir, 0o700)
        try:
            # scram passwords over TCP; no Unix socket is opened, so `local` lines never apply
            self._cmd("initdb", "-D", self.data_dir, "-U", ROLE, "--pwfile", pwfile, "-E", "UTF8",
                      "--auth-host=scram-sha-256", "--auth-local=peer", "--no-instructions")
        finally:
            if os.path.exists(pwfile):
                os.remove(pwfile)

    def start(self, timeout: float = 60) -> None:
        opts = f"-c listen_addresses=127.0.0.1 -p {self.port} -c unix_socket_directories=''"
        logfile = os.path.join(self.data_dir, "server.log")
        self._cmd("pg_ctl", "-D", self.data_dir, "-o", opts, "-l", logfile, "-w", "-t", str(int(timeout)), "start")
        log.info("PostgreSQL on 127.0.0.1:%d (data %s)", self.port, self.data_dir)

    def stop(self) -> None:
        if os.path.isfile(os.path.join(self.data_dir, "postmaster.pid")):
            self._cmd("pg_ctl", "-D", self.data_dir, "-m", "fast", "-w", "stop", check=False)

    def uri(self, database: str = "mlflow", driver: str = "postgresql") -> str:
        return f"{driver}://{ROLE}:{self.password}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str = "mlflow", timeout: float = 30) -> str:
        """Create `name` unless it exists; returns its SQLAlchemy URI."""
        import psycopg
        deadline = time.monotonic() + timeout
        while True:
            try:
                conn = psycopg.connect(self.uri("postgres"), autocommit=True)
                break
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        with conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{name}"')
        return self.uri(name)


def _reachable(user: str, path: str) -> bool:
    return subprocess.run(["runuser", "-u", user, "--", "test", "-r", path]).returncode == 0
