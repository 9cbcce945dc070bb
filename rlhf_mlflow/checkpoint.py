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
