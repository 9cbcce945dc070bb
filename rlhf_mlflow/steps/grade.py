"""The `grade` step (synthetic worlds only): the oracle's true quality per family of a version or a
checkpoint, on its own run: `truth/balanced` as a metric, per family the table `grade_families.json`.
Release never reads it."""
from __future__ import annotations

from collections.abc import Callable

import pandas as pd

from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.tracking import registry as REG
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.training.evaluate import first_per_family
from rlhf_mlflow.world.oracle import Oracle

BALANCED, TABLE = "truth/balanced", "grade_families.json"
"""The one metric (the per-family numbers are the table's)."""


def run_grade(version: str, world: WorldPaths, n: int = 4, echo: Callable[[str], None] = print) -> dict:
    """The oracle's true quality of a registered version, on its own run linked to the version's model."""
    REG.version_for_world(version, world)
    policy_dir, model_id = REG.download_policy(version)
    out = run_grade_checkpoint(policy_dir, world, n, model_id=model_id, run_name=f"grade-v{version}",
                               params={"model_version": version})
    echo(f"grade version {version}: truth/balanced {out['truth']['truth/balanced']:.3f}")
    return out


def run_grade_checkpoint(policy_dir: str, world: WorldPaths, n: int = 4, model_id: str | None = None,
                         run_name: str = "grade", params: dict | None = None) -> dict:
    """`truth/<family>` and `truth/balanced` of a checkpoint on the world's balanced prompts (returned;
    logged: the balanced one, and the table)."""
    params = {**(params or {}), "policy": policy_dir, "world": world.root, "n": n}
    with T.tracked_run("grade", params, run_name=run_name) as run:
        oracle = Oracle(world.root)
        prompts = first_per_family(D.read_jsonl(world.prompts_train))
        truth = oracle.grade_policy(M.load_policy(policy_dir)[0], prompts, n=n)
        T.log_metrics({k: v for k, v in truth.items() if k == BALANCED}, model_id=model_id)
        T.log_table(pd.DataFrame([{"family": k.split("/", 1)[1], "truth": v} for k, v in truth.items()]), TABLE)
    return {"run_id": run.info.run_id, "truth": truth}

