"""One release decision at a time, on any MLflow store, for clients that reach it only over HTTP.

The lock is a registered model named `<model>.release-lock`. Creating a registered model is atomic in
every MLflow backend (its name is the table's primary key: a second create fails with
RESOURCE_ALREADY_EXISTS, on sqlite, PostgreSQL or MySQL, directly or through `mlflow server`), and its
tags are written in the same transaction, so the holder (a random token, host, pid, run, time) is
known the moment the lock exists. Releasing deletes it.

A holder that died leaves the lock behind. It is broken when its process is gone (same host) or its
lease has run out (any host; `lease_seconds`, far longer than a release takes); `rlhf-mlflow runs
--repair` breaks it by hand. The holder checks that it still holds the lock right before it moves
the alias, so a release that outlived its lease stops instead of writing.
"""
from __future__ import annotations

import logging
import random
import time
import uuid

import mlflow
from mlflow.exceptions import MlflowException

from rlhf_mlflow.core.errors import GateError
from rlhf_mlflow.core.process import process_state, process_tags

log = logging.getLogger(__name__)
SUFFIX = ".release-lock"


class LockTimeout(GateError):
    pass


class LockLost(GateError):
    pass


def lock_name(registered_model: str) -> str:
    return registered_model + SUFFIX


def _tags_of(name: str) -> dict | None:
    """The lock's tags, or None when nobody holds it."""
    try:
        return dict(mlflow.MlflowClient().get_registered_model(name).tags)
    except MlflowException:
        return None


def stale_reason(tags: dict, now: float | None = None) -> str | None:
    """Why a held lock may be broken (its holder is gone, or its lease ran out), or None."""
    if process_state(tags) == "gone":
        return f"its holder (pid {tags.get('rlhf.pid')} on {tags.get('rlhf.host')}) is gone"
    try:
        expires = float(tags["expires_at"])
    except (KeyError, ValueError):
        return "it carries no lease"
    if (now or time.time()) > expires:
        return f"its lease ran out at {time.strftime('%H:%M:%S', time.localtime(expires))}"
    return None


def break_lock(name: str, tags: dict, reason: str) -> bool:
    """Delete the lock if it is still the one described by `tags`; True when it was deleted."""
    current = _tags_of(name)
    if current is None or current.get("token") != tags.get("token"):
        return False
    log.warning("breaking release lock %s held by run %s: %s", name, tags.get("run_id"), reason)
    try:
        mlflow.MlflowClient().delete_registered_model(name)
    except MlflowException:
        return False
    return True


class ReleaseLock:
    """`with ReleaseLock(model, run_id):` holds the model's release lock; `check()` raises LockLost
    if it is no longer ours."""

    def __init__(self, registered_model: str, run_id: str | None = None, wait_seconds: float = 600.0,
                 lease_seconds: float = 300.0):
        self.name = lock_name(registered_model)
        self.run_id = run_id
        self.wait_seconds = wait_seconds
        self.lease_seconds = lease_seconds
        self.token = uuid.uuid4().hex

    def acquire(self) -> None:
        client = mlflow.MlflowClient()
        deadline = time.monotonic() + self.wait_seconds
        delay = 0.05
        while True:
            tags = {**process_tags(), "token": self.token, "run_id": self.run_id or "",
                    "acquired_at": f"{time.time():.3f}", "expires_at": f"{time.time() + self.lease_seconds:.3f}"}
            try:
                client.create_registered_model(self.name, tags=tags, description=(
                    "Transient lock: a release decision for this model is in progress (deleted when it ends)."))
                return
            except MlflowException as e:
                # taken; or freed while the store built its "already exists" error (it reads the lock back)
                if e.error_code not in ("RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST"):
                    raise
            held = _tags_of(self.name)
            if held is not None:
                why = stale_reason(held)
                if why and break_lock(self.name, held, why):
                    continue
                if time.monotonic() > deadline:
                    raise LockTimeout(f"the release lock {self.name} is held by run {held.get('run_id') or '?'} "
                                      f"(pid {held.get('rlhf.pid')} on {held.get('rlhf.host')}); waited "
                                      f"{self.wait_seconds:g} s. If that release is gone, `rlhf-mlflow runs --repair` "
                                      "clears the lock")
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 1.5, 1.0)

    def check(self) -> None:
        tags = _tags_of(self.name)
        if tags is None or tags.get("token") != self.token:
            raise LockLost(f"the release lock {self.name} is no longer held by this release (it outlived its "
                           f"{self.lease_seconds:g} s lease and was broken): nothing was promoted")

    def release(self) -> None:
        tags = _tags_of(self.name)
        if tags is not None and tags.get("token") == self.token:
            try:
                mlflow.MlflowClient().delete_registered_model(self.name)
            except MlflowException:
                pass

    def __enter__(self) -> "ReleaseLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
