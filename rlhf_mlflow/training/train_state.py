"""What an RL run needs, beyond the policy's weights, to continue exactly where it stopped: the step
reached, Adam's moments, both random streams and the metric window in progress.

`capture` turns the live objects into flat tensors plus a JSON-ready dict (safetensors and JSON on
disk: save_train_state, load_train_state); `restore` puts them back. A run resumed from a checkpoint then
draws the same prompts and samples and takes the same updates as one that never stopped.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file, save_file

from rlhf_mlflow.core.errors import InputError, read_json
from rlhf_mlflow.training.family_stats import FamilyAccumulator

ADAM = "adam."
RNG_SAMPLER, RNG_TORCH = "rng.sampler", "rng.torch"
WINDOW = ("sums", "counts", "tokens")


@dataclass
class TrainState:
    step: int
    """Optimiser steps taken."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Adam's per-parameter state, the generators' states, the metric window's sums (flat names)."""
    meta: dict = field(default_factory=dict)
    """Adam's hyper-parameters, the window's scalar sums and the metric history so far (JSON-ready)."""


def capture(step: int, opt: torch.optim.Optimizer, rng: torch.Generator, acc: FamilyAccumulator,
            scalars: dict[str, float], history: list[tuple[int, dict]]) -> TrainState:
    sd = opt.state_dict()
    tensors = {f"{ADAM}{i}.{k}": v.detach().clone() for i, s in sd["state"].items() for k, v in s.items()}
    tensors[RNG_SAMPLER] = rng.get_state()
    tensors[RNG_TORCH] = torch.get_rng_state()
    tensors.update({f"window.{k}": getattr(acc, k).clone() for k in WINDOW})
    meta = {"param_groups": sd["param_groups"], "scalars": dict(scalars),
            "history": [[s, m] for s, m in history]}
    return TrainState(step, tensors, meta)


def restore(state: TrainState, opt: torch.optim.Optimizer, rng: torch.Generator, acc: FamilyAccumulator
            ) -> tuple[dict[str, float], list[tuple[int, dict]]]:
    """Put the optimiser, generators and metric window back; returns (window scalars, history)."""
    try:
        per_param: dict[int, dict[str, torch.Tensor]] = {}
        for name, t in state.tensors.items():
            if name.startswith(ADAM):
                index, key = name[len(ADAM):].split(".", 1)
                per_param.setdefault(int(index), {})[key] = t
        opt.load_state_dict({"state": per_param, "param_groups": state.meta["param_groups"]})
        rng.set_state(state.tensors[RNG_SAMPLER])
        torch.set_rng_state(state.tensors[RNG_TORCH])
        for k in WINDOW:
            getattr(acc, k).copy_(state.tensors[f"window.{k}"])
        history = [(int(s), m) for s, m in state.meta["history"]]
        return dict(state.meta["scalars"]), history
    except (KeyError, ValueError, RuntimeError) as e:
        raise InputError(f"training state at step {state.step} does not fit this run ({type(e).__name__}: {e})") from None


STATE_TENSORS, STATE_META = "train_state.safetensors", "train_state.json"


def save_train_state(state: TrainState, out_dir: str) -> None:
    """A TrainState beside a checkpoint's weights: tensors as safetensors, the rest JSON."""
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.tensors.items()}, os.path.join(out_dir, STATE_TENSORS))
    with open(os.path.join(out_dir, STATE_META), "w") as f:
        json.dump({"step": state.step, **state.meta}, f)


def load_train_state(ckpt_dir: str) -> TrainState:
    meta = read_json(os.path.join(ckpt_dir, STATE_META), "no training state (not a resumable checkpoint)")
    path = os.path.join(ckpt_dir, STATE_TENSORS)
    try:
        tensors = load_file(path)
    except Exception as e:  # safetensors raises its own error types
        raise InputError(f"{path}: not a readable safetensors file ({e})") from None
    step = meta.pop("step", None)
    if not isinstance(step, int) or step < 0:
        raise InputError(f"{ckpt_dir}/{STATE_META}: 'step' must be an integer >= 0, got {step!r}")
    return TrainState(step, tensors, meta)


def resume_problem(state: TrainState, step: int, steps: int, save_every: int) -> str | None:
    """Why a checkpoint named `step_<step>` with this training state is not one a run of `steps`
    steps, checkpointing every `save_every`, could have saved (None: it is)."""
    if not 0 < state.step < steps:
        return f"its training state is at step {state.step}, outside the run's 1..{steps - 1} (steps {steps})"
    if state.step != step:
        return f"its training state is at step {state.step}, not {step}"
    if not save_every or step % save_every:
        return f"step {step} is not a multiple of the run's save_every ({save_every})"
    history = state.meta.get("history")
    if not isinstance(history, list) or any(not isinstance(h, list) or len(h) != 2 or not isinstance(h[0], int)
                                            or not 0 < h[0] <= step for h in history):
        return f"its metric history is not one of steps 1..{step}"
    return None
