"""A world is what the store recorded of it, not what its own files say.

Every run that uses a world logs, as parameters (which cannot change once logged), `world_files`: the
sha256 of each of its files ({path relative to the world: sha256}, core/world_paths.IDENTITY) and
`world_sha256`, one digest over them. A world built here is named by its manifest (`world_id`: the
digest of its files as the builder wrote them); it must hold exactly the files of the store's first
record under that name, so a copy whose expert labels were rewritten, with its manifest rewritten to
match, is refused, naming the file (a copy renamed is another world, which no version was trained on).
A policy version carries its training run's record; certify and release compare the files on disk
with that record (steps/certify.py), never with anything inside the world.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import mlflow

from rlhf_mlflow.core.digest import digest_of
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.world_paths import WorldPaths, files_differ, world_files
from rlhf_mlflow.tracking.runs import MAX_PARAM
from rlhf_mlflow.tracking.store_search import every_run

DIGEST, FILES = "world_sha256", "world_files"


@dataclass(frozen=True)
class WorldRecord:
    files: dict
    """{path relative to the world: sha256}, as the run logged it."""
    digest: str
    """digest_of(files): the world's content identity."""
    run_id: str
    """The run whose parameters hold it."""


def world_params(world: WorldPaths) -> dict:
    """What a run that uses `world` logs of it: its path, build hash and seed (built here), and its
    content record. InputError, naming the first file that differs, when the store's first record of the
    world its manifest names is not these files."""
    files = world_files(world)
    params = {**world.params(), DIGEST: digest_of(files), FILES: json.dumps(files, separators=(",", ":"))}
    if len(params[FILES]) > MAX_PARAM:
        raise InputError(f"world {world.root}: its policy/ and reward_model/ hold too many files to record "
                         f"({len(files)}); a world holds a checkpoint and a reward model, nothing else")
    first = first_record(params.get("world_id"))
    if first is not None and first.digest != params[DIGEST]:
        raise InputError(f"{world.root} is not world {params['world_id'][:16]} as the store recorded it when it was "
                         f"first used (run {first.run_id}): {files_differ(first.files, files)}")
    return params


def record_of(params: dict, run_id: str) -> WorldRecord | None:
    """The world record among a run's parameters, None when it has none; InputError when its files and
    digest disagree (a record no run of this project wrote)."""
    raw, digest = params.get(FILES), params.get(DIGEST)
    if raw is None and digest is None:
        return None
    try:
        files = json.loads(raw or "")
        ok = isinstance(files, dict) and all(isinstance(v, str) for v in files.values())
    except ValueError:
        ok = False
    if not ok or digest_of(files) != digest:
        raise InputError(f"run {run_id}: its world record is inconsistent ({FILES} does not hash to {DIGEST})")
    return WorldRecord(files, digest, run_id)


def first_record(world_id: str | None) -> WorldRecord | None:
    """The earliest record in the store (any experiment, deleted experiments and runs included) of the world its builder
    named `world_id`, or None."""
    if not world_id:
        return None
    runs = every_run(f"params.world_id = '{world_id}'")
    for run in runs:
        record = record_of(run.data.params, run.info.run_id)
        if record is not None:
            return record
    return None


def version_record(version) -> WorldRecord | None:
    """The record of the world a policy version was trained on (its training run's), or None for a
    version trained on no world (its certification's inputs are then the user's own). A version that
    says it was trained on a world but whose training run recorded no files is refused: there is nothing
    to check its world's files against."""
    params = {}
    if version.run_id:
        try:
            params = mlflow.MlflowClient().get_run(version.run_id).data.params
        except mlflow.exceptions.MlflowException:
            params = {}
    record = record_of(params, version.run_id)
    trained_on = version.tags.get("world_hash") or params.get("world_hash") or params.get("world")
    if record is None and trained_on:
        raise InputError(f"version {version.version} was trained on world {trained_on}, but its training run "
                         f"({version.run_id}) recorded none of that world's files: nothing to check the world's "
                         "files against (train it again with this version of rlhf_mlflow)")
    return record
