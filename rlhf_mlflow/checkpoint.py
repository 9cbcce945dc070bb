"""Safetensors checkpoints with a config.json beside them (the seed's layout). Never unpickles."""
from __future__ import annotations

import json
import os

import torch.nn as nn
from safetensors.torch import load_file, save_file

from .errors import InputError, read_json


def save_module(module: nn.Module, cfg: dict, out_dir: str, weights_name: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
    save_file(tensors, os.path.join(out_dir, weights_name))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


def read_config(ckpt_dir: str, required: tuple[str, ...]) -> dict:
    path = os.path.join(ckpt_dir, "config.json")
    cfg = read_json(path, "no config.json (expected a checkpoint directory)")
    missing = [k for k in required if k not in cfg]
    if missing:
        raise InputError(f"{path}: missing config keys {missing}; required keys are {list(required)}")
    return cfg


def load_weights(module: nn.Module, ckpt_dir: str, weights_name: str) -> None:
    path = os.path.join(ckpt_dir, weights_name)
    if not os.path.isfile(path):
        raise InputError(f"{path}: missing weights file")
    try:
        state = load_file(path)
    except Exception as e:  # safetensors raises its own error types
        raise InputError(f"{path}: not a readable safetensors file ({e})") from None
    try:
        module.load_state_dict(state)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        detail = "; ".join(line.strip() for line in first[1:4]) or first[0]
        raise InputError(f"{path}: weights do not match {ckpt_dir}/config.json: {detail}") from None
    module.eval()


def freeze(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        p.requires_grad_(False)
    return module.eval()


STATE_TENSORS, STATE_META = "train_state.safetensors", "train_state.json"


def save_train_state(state, out_dir: str) -> None:
    """A TrainState (train_state.py) beside a checkpoint's weights: tensors as safetensors, the rest JSON."""
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.tensors.items()}, os.path.join(out_dir, STATE_TENSORS))
    with open(os.path.join(out_dir, STATE_META), "w") as f:
        json.dump({"step": state.step, **state.meta}, f)


def has_train_state(ckpt_dir: str) -> bool:
    return all(os.path.isfile(os.path.join(ckpt_dir, n)) for n in (STATE_TENSORS, STATE_META))


def load_train_state(ckpt_dir: str):
    from .train_state import TrainState
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


def content_sha256(path: str) -> str:
    """sha256 of a file, or of a checkpoint directory's config.json and top-level weights (what loading
    it reads; other files beside them do not count)."""
    import hashlib
    h = hashlib.sha256()
    if os.path.isfile(path):
        names, root = [os.path.basename(path)], os.path.dirname(path)
    else:
        names, root = sorted(n for n in os.listdir(path) if n == "config.json" or n.endswith(".safetensors")), path
    for name in names:
        with open(os.path.join(root, name), "rb") as f:
            h.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
    return h.hexdigest()
