"""The reward models' registry: every reward model a world's pipeline trains on is a version of
`rlhf-reward-model`, and the alias `production` names the one it trains on now.

A world's own reward model is its lineage's root (registered the first time a repair starts from it);
each repaired model is a version whose tags name its parent version, the world, the recipe and the
sha256 of every file of its directory, which its run also records as a parameter (what a copy is
verified against: a tag can be changed, a parameter cannot). Only the repair gate moves
`production`, under the registered model's release lock (tracking/release_lock.py), reading the alias
back; a refused version says why in its description (`REFUSED vN: ...`) and in `failed.<guardrail>` tags.
"""
from __future__ import annotations

import mlflow

from rlhf_mlflow.core.checkpoint import content_sha256
from rlhf_mlflow.core.errors import GateError, InputError
from rlhf_mlflow.tracking import registry as REG
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking.release_lock import ReleaseLock

RM_MODEL = "rlhf-reward-model"
PRODUCTION = "production"
ARTIFACT = "reward_model"
DESCRIPTION = ("Reward models: each world's own (the root of its lineage) and every repair of it "
               "(tag parent_version). `production` is the one the pipeline trains on; only a repair that "
               "agrees with the experts at least as well as its parent and pays no flagged shortcut again "
               "takes it (repair_rm).")


def _ensure_model() -> None:
    c = REG.client()
    try:
        c.get_registered_model(RM_MODEL)
    except mlflow.exceptions.MlflowException:
        try:
            c.create_registered_model(RM_MODEL, description=DESCRIPTION)
        except mlflow.exceptions.MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":  # another writer made it first
                raise


def register(run_id: str, rm_dir: str, tags: dict, description: str = "", artifact: str = ARTIFACT) -> str:
    """A new version for the reward model the run logged under `artifact` (rm_dir: its local copy). The
    sha256 of every file of its directory is logged first as the run's parameter `sha256.<artifact>`
    (which cannot change: what the version is checked against) and tagged on the version (what the
    registry page shows); returns the version."""
    _ensure_model()
    sha = content_sha256(rm_dir)
    REG.client().log_param(run_id, SHA_PARAM + artifact, sha)
    tags = {**tags, "artifact": artifact}
    mv = REG.client().create_model_version(RM_MODEL, source=f"runs:/{run_id}/{artifact}", run_id=run_id,
                                           tags={**tags, "sha256": sha}, description=description)
    return str(mv.version)


SHA_PARAM = "sha256."
"""The run parameter `sha256.<artifact>` holding the sha256 of a registered reward model's directory."""


def _run_params(mv) -> dict:
    try:
        return REG.client().get_run(mv.run_id).data.params if mv.run_id else {}
    except mlflow.exceptions.MlflowException:
        return {}


def recorded_sha256(mv) -> str | None:
    """The sha256 of the version's directory as its run recorded it (a parameter), or None when its run
    recorded none (a version registered by hand, or before these records): such a version matches no
    files."""
    return _run_params(mv).get(SHA_PARAM + mv.tags.get("artifact", ARTIFACT))


def world_of(mv) -> str | None:
    """The content digest of the world the version's run used (its `world_sha256` parameter), or None."""
    return _run_params(mv).get("world_sha256")


def find(world_sha256: str, sha256: str):
    """The version repaired on (or the own model of) the world with content digest `world_sha256` whose
    directory is exactly these files, as its run recorded both; or None."""
    try:
        found = REG.client().search_model_versions(f"name = '{RM_MODEL}'")
    except mlflow.exceptions.MlflowException:
        return None
    for mv in sorted(found, key=lambda m: int(m.version)):
        if mv.tags.get("sha256") == sha256 and recorded_sha256(mv) == sha256 and world_of(mv) == world_sha256:
            return mv
    return None


def get(version: str | int, world_sha256: str | None):
    """The version, refused when its run used another world (by the worlds' content digests)."""
    mv = REG.get_version(version, RM_MODEL)
    if world_sha256 and world_of(mv) != world_sha256:
        raise InputError(f"reward model {RM_MODEL}/{version} was not made on this world (its run recorded world "
                         f"{str(world_of(mv))[:12]}, this world is {world_sha256[:12]})")
    return mv


def production():
    return REG.champion_version(RM_MODEL, alias=PRODUCTION)


def download(version: str | int, dst: str) -> str:
    """The version's files under dst, verified against the sha256 its run recorded."""
    mv = REG.get_version(version, RM_MODEL)
    path = T.download_artifact(mv.run_id, mv.tags.get("artifact", ARTIFACT), dst)
    recorded = recorded_sha256(mv)
    if path is None or recorded is None or content_sha256(path) != recorded:
        raise GateError(f"reward model {RM_MODEL}/{version}: its files do not match the sha256 its run recorded "
                        "when it was registered")
    return path


def decide(version: str, failed: dict[str, str], description: str, run_id: str | None) -> bool:
    """Record the gate's decision on the version under the lock; move `production` to it when nothing
    failed (read back). Returns True when it was promoted."""
    with ReleaseLock(RM_MODEL, run_id) as lock:
        REG.set_failed(version, failed, RM_MODEL)
        REG.describe(version, description, RM_MODEL)
        REG.set_tags(version, {"gate.decision": "refused" if failed else "promoted"}, RM_MODEL)
        if failed:
            return False
        lock.check()
        REG.move_champion(version, RM_MODEL, alias=PRODUCTION)
    return True
