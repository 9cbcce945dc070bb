"""The shared tracking server: `mlflow server` on a PostgreSQL backend store (or a sqlite file) with an
artifact root it serves itself, bound to 127.0.0.1 unless told otherwise.

    with TrackingServer(ServerConfig(root="mlflow-server", port=5000)) as server:
        os.environ["MLFLOW_TRACKING_URI"] = server.uri    # every entry point now logs there

This module starts and stops processes; it imports no mlflow (the server runs as `python -m mlflow`).
The database password never appears on a command line: it lives in `<root>/pgdata.password` (mode
600) and reaches `mlflow server` through its environment.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

from rlhf_mlflow.core.config import check_range
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.tracking.postgres import Postgres

log = logging.getLogger(__name__)
BACKENDS = ("postgresql", "sqlite")


@dataclass(frozen=True)
class ServerConfig:
    root: str = "mlflow-server"
    """Directory for the database (pgdata/ or mlflow.db), the artifacts (artifacts/) and the logs."""
    host: str = "127.0.0.1"
    """Interface the tracking server binds to; 0.0.0.0 shares it beyond this machine."""
    port: int = 5000
    """Tracking server port (0: any free port)."""
    backend: str = "postgresql"
    """Backend store: 'postgresql' (a cluster under root, on loopback) or 'sqlite' (root/mlflow.db)."""
    db_port: int = 0
    """PostgreSQL port on 127.0.0.1 (0: any free port)."""
    workers: int = 1
    """Tracking server worker processes (each ~0.4 GB; MLflow's default 4 takes ~35 s to start)."""
    timeout: float = 180.0
    """Seconds to wait for the server to answer /health."""

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise InputError(f"backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        check_range("port", self.port, 0, 65535, integer=True)
        check_range("db_port", self.db_port, 0, 65535, integer=True)
        check_range("workers", self.workers, 1, 64, integer=True)
        check_range("timeout", self.timeout, 0, None, lo_open=True)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_env(**extra: str) -> dict:
    """The environment of an `mlflow server` this project starts: MLflow 3.17's server also starts its
    GenAI job runners (seven Huey consumers, about 4 s and 1.7 GB more per start), which nothing here
    uses; a user's own MLFLOW_SERVER_ENABLE_JOB_EXECUTION wins."""
    return {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **os.environ, **extra}


class TrackingServer:
    """Starts the database (PostgreSQL) and `mlflow server`; `stop()` ends both. A context manager."""

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.root = os.path.abspath(cfg.root)
        self.port = cfg.port or free_port(cfg.host)
        self.postgres: Postgres | None = None
        self.process: subprocess.Popen | None = None
        self.logfile = os.path.join(self.root, "mlflow-server.log")

    @property
    def uri(self) -> str:
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "") else self.cfg.host
        return f"http://{host}:{self.port}"

    def backend_store_uri(self) -> str:
        if self.cfg.backend == "sqlite":
            return f"sqlite:///{os.path.join(self.root, 'mlflow.db')}"
        self.postgres = Postgres(os.path.join(self.root, "pgdata"), self.cfg.db_port or free_port())
        self.postgres.init()
        self.postgres.start()
        return self.postgres.create_database("mlflow")

    def start(self) -> str:
        """Start everything and wait until the server answers; returns the tracking URI."""
        os.makedirs(self.root, exist_ok=True)
        try:
            env = server_env(MLFLOW_BACKEND_STORE_URI=self.backend_store_uri())
            cmd = [sys.executable, "-m", "mlflow", "server", "--host", self.cfg.host, "--port", str(self.port),
                   "--workers", str(self.cfg.workers), "--app-name", "rlhf",  # the UI opens on runs (ui_app.py)
                   "--artifacts-destination", os.path.join(self.root, "artifacts")]
            with open(self.logfile, "ab") as out:
                # its own process group, so stop() ends the server and the workers it forks
                self.process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                start_new_session=True, cwd=self.root)
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        log.info("MLflow tracking server at %s (backend %s, root %s)", self.uri, self.cfg.backend, self.root)
        return self.uri

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.cfg.timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited with code {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"mlflow server did not answer {self.uri}/health within {self.cfg.timeout:.0f}s:\n"
                           f"{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.logfile, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None
        if self.postgres is not None:
            self.postgres.stop()
            self.postgres = None

    def wait(self) -> int:
        """Block until the server exits (Ctrl-C ends the wait); returns its exit code."""
        return self.process.wait()

    def __enter__(self) -> "TrackingServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
