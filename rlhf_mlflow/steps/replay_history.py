"""The `replay_history` step: the seed's five historical runs (training/recipes.py) trained on a
world, each a train_rl run with the seed's note as its description."""
from __future__ import annotations

from collections.abc import Callable

from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.steps.train_rl import run_train_rl
from rlhf_mlflow.training.recipes import SEED_HISTORY, check_steps_scale, scaled
from rlhf_mlflow.training.rl_config import load_rl_config


def check_names(only: tuple[str, ...]) -> None:
    unknown = [n for n in only if n not in SEED_HISTORY]
    if unknown:
        raise InputError(f"--only: unknown run {unknown[0]!r}; valid runs are {list(SEED_HISTORY)}")


def run_replay_history(world: WorldPaths, steps_scale: float = 1.0, only: tuple[str, ...] = (),
                       echo: Callable[[str], None] = print) -> list[dict]:
    """Train the named historical runs (all by default); returns their summaries."""
    check_names(only)
    check_steps_scale(steps_scale)
    out = []
    for name, (overrides, note) in SEED_HISTORY.items():
        if only and name not in only:
            continue
        cfg = load_rl_config(world.config, scaled(overrides, steps_scale))
        echo(f"replaying {name}: {note}")
        out.append(run_train_rl(cfg, world=world, run_name=name, description=note,
                                tags={"rlhf.history": "seed"}, echo=echo))
    return out
