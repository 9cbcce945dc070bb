"""A train_rl run's checkpoints, written locally and uploaded so that each appears whole or not at all,
and found again for a resume.

A checkpoint directory is written whole (files.atomic_dir) with a MANIFEST.json last (every file's
path, size and sha256: checkpoint.write_manifest); the upload copies the manifest after every other
file. An upload cut short (a SIGKILL, a lost machine) leaves no manifest, or files that disagree with
it; `last_checkpoint` downloads the newest checkpoint whose files match its manifest and whose
training state fits the run's config, and says which newer ones it skipped and why.
"""
from __future__ import annotations

import os
from collections.abc import Callable

from rlhf_mlflow.core import checkpoint as CK
from rlhf_mlflow.core import files as F
from rlhf_mlflow.core import model as M
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.training import train_state as TS
from rlhf_mlflow.training.rl_config import RLConfig
from rlhf_mlflow.training.train_rl import Resume

FOLDER = "checkpoints"


def write_checkpoint(path: str, policy: M.Policy, state: TS.TrainState | None = None, watch=None) -> None:
    """The policy, its training state and the watch's files (when given) and their manifest, appearing
    together at `path`."""
    with F.atomic_dir(path) as staging:
        M.save_policy(policy, policy.cfg, staging)
        if state is not None:
            TS.save_train_state(state, staging)
        if watch is not None:
            watch.save(staging)
        CK.write_manifest(staging)


def upload(path: str, name: str) -> None:
    """The checkpoint directory `path` as the run's artifact `checkpoints/<name>`, its manifest last."""
    T.log_dir_last(path, f"{FOLDER}/{name}", CK.MANIFEST)


def last_checkpoint(run_id: str, cfg: RLConfig, tmp: str, echo: Callable[[str], None]) -> Resume | None:
    """The newest `checkpoints/step_N` of the run that is whole and fits `cfg`, downloaded under `tmp`;
    each newer one is skipped with a line saying why. None when there is none."""
    steps = sorted((int(name[len("step_"):]) for name in T.list_artifact_names(run_id, FOLDER)
                    if name.startswith("step_") and name[len("step_"):].isdigit()), reverse=True)
    for step in steps:
        resume, problem = _checked(run_id, step, cfg, os.path.join(tmp, f"candidate_{step}"))
        if resume is not None:
            return resume
        echo(f"skipped {FOLDER}/step_{step}: {problem}")
    return None


def _checked(run_id: str, step: int, cfg: RLConfig, tmp: str) -> tuple[Resume | None, str]:
    """(the downloaded checkpoint, "") when it is usable; else (None, why not)."""
    name = f"{FOLDER}/step_{step}"
    path = T.download_artifact(run_id, name, tmp)
    if path is None:
        return None, "could not be downloaded"
    problem = CK.verify_manifest(path)
    if problem:
        return None, f"incomplete upload ({problem})"
    try:  # what loading it reads, read now: an error names the artifact, not a temporary directory
        state = TS.load_train_state(path)
        M.load_policy(path)
    except InputError as e:
        return None, str(e).replace(path, name)
    problem = TS.resume_problem(state, step, cfg.steps, cfg.save_every)
    if problem:
        return None, problem
    return Resume(path, state), ""
