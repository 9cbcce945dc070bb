"""The reward models' registry: every reward model a world's pipeline trains on is a version of
`rlhf-reward-model`, and the alias `production` names the one it trains on now.

A world's own reward model is its lineage's root (registered the first time a repair starts from it);
each repaired model is a version whose tags name its parent version, the world, the recipe and the
sha256 of its files (the checked-out copy is verified against it). Only the repair gate moves
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
    """A new version for the reward model the run logged under `artifact` (rm_dir: its local copy,
    hashed into the `sha256` tag; the artifact path is tagged too); returns the version."""
    _ensure_model()
    tags = {**tags, "artifact": artifact}
    mv = REG.client().create_model_version(RM_MODEL, source=f"runs:/{run_id}/{artifact}", run_id=run_id,
                                           tags={**tags, "sha256": content_sha256(rm_dir)},
                                           description=description)
    return str(mv.version)


def find(world_hash: str, sha256: str):
    """The version of this world holding exactly these files, or None."""
    try:
        found = REG.client().search_model_versions(f"name = '{RM_MODEL}'")
    except mlflow.exceptions.MlflowException:
        return None
    for mv in sorted(found, key=lambda m: int(m.version)):
        if mv.tags.get("world_hash") == world_hash and mv.tags.get("sha256") == sha256:
            return mv
    return None


def get(version: str | int, world_hash: str | None):
    """The version, refused when it belongs to another world."""
    mv = REG.get_version(version, RM_MODEL)
    if world_hash and mv.tags.get("world_hash") not in (None, world_hash):
        raise InputError(f"reward model {RM_MODEL}/{version} belongs to world {mv.tags.get('world_hash')}, "
                         f"not {world_hash}")
    return mv


def production():
    return REG.champion_version(RM_MODEL, alias=PRODUCTION)


def download(version: str | int, dst: str) -> str:
    """The version's files under dst, verified against its sha256 tag."""
    mv = REG.get_version(version, RM_MODEL)
    path = T.download_artifact(mv.run_id, mv.tags.get("artifact", ARTIFACT), dst)
    if path is None or content_sha256(path) != mv.tags.get("sha256"):
        raise GateError(f"reward model {RM_MODEL}/{version}: its files do not match the sha256 it was registered with")
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
