"""Reward wrappers: a Python file defining transform(records, response_tokens, rewards) -> rewards.

train_rl applies one to the reward model's scores before the KL term; certify applies the
diagnostic's correction (a wrapper written by rlhf_mlflow.correction) the same way. The file is read
once: the bytes that are hashed (and logged as provenance) are the bytes that are executed. It is
executed as Python code, so only trusted files belong here.
"""
from __future__ import annotations

import hashlib
import math
import os
import types
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from rlhf_mlflow.core import shortcut_rules as SR
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import InputError

Transform = Callable[[list, list, list], list]


@dataclass(frozen=True)
class RewardWrapper:
    """A loaded wrapper file: its path, the sha256 of the bytes executed, and their transform; `rules`,
    the shortcut rules it corrects when it says which (a correction file's RULES: what the watch counts)."""
    path: str
    sha256: str
    source: bytes
    transform: Transform
    rules: tuple = ()

    def __call__(self, records: list, response_tokens: list, rewards: list) -> list:
        return self.transform(records, response_tokens, rewards)


def load_wrapper(path: str | None) -> RewardWrapper | None:
    """Read, hash and execute a wrapper file (in a fresh module); None when no path is given."""
    if not path:
        return None
    if not os.path.isfile(path):
        raise InputError(f"reward_wrapper {path}: file not found")
    with open(path, "rb") as f:
        source = f.read()
    module = types.ModuleType("reward_wrapper")
    module.__file__ = path
    try:
        exec(compile(source, path, "exec"), module.__dict__)
    except SystemExit as e:
        raise InputError(f"reward_wrapper {path}: importing it called sys.exit({e.code!r})") from None
    except Exception as e:  # a SyntaxError included
        raise InputError(f"reward_wrapper {path}: failed to import ({type(e).__name__}: {e})") from None
    transform = getattr(module, "transform", None)
    if not callable(transform):
        raise InputError(f"reward_wrapper {path}: defines no function transform(records, response_tokens, rewards)")
    return RewardWrapper(path, hashlib.sha256(source).hexdigest(), source, transform, _rules(module, path))


def _rules(module: types.ModuleType, path: str) -> tuple:
    """The module's RULES (shortcut_rules' schema; extra keys such as a fit's standard error dropped),
    or () when it has none."""
    rules = getattr(module, "RULES", None)
    if rules is None:
        return ()
    if not isinstance(rules, list) or not all(isinstance(r, dict) for r in rules):
        raise InputError(f"reward_wrapper {path}: RULES must be a list of shortcut rules (JSON objects)")
    keep = [{k: v for k, v in r.items() if k in ("family", "kind", "bonus") + SR.KINDS.get(r.get("kind"), ())}
            for r in rules]
    return tuple(SR.validate(keep, f"reward_wrapper {path}: RULES", bonus=False))


def apply_wrapper(wrap: Transform, name: str, records: list[dict], responses: torch.Tensor,
                  raw: torch.Tensor) -> torch.Tensor:
    """Call a reward wrapper and check that it returned one finite number per response."""
    tokens = [V.decode_response(r) for r in responses.tolist()]
    try:
        out = wrap(records, tokens, raw.tolist())
    except SystemExit as e:
        raise InputError(f"reward_wrapper {name}: transform called sys.exit({e.code!r})") from None
    except Exception as e:
        raise InputError(f"reward_wrapper {name}: transform raised {type(e).__name__}: {e}") from None
    rewards = _numbers(out, name)
    if len(rewards) != raw.numel():
        raise InputError(f"reward_wrapper {name}: transform returned {len(rewards)} rewards "
                         f"for {raw.numel()} responses")
    bad = [i for i, r in enumerate(rewards) if not math.isfinite(r)]
    if bad:
        raise InputError(f"reward_wrapper {name}: transform returned a non-finite reward ({rewards[bad[0]]}) "
                         f"at index {bad[0]}")
    return torch.tensor(rewards, dtype=torch.float32)


def _numbers(out, name: str) -> list[float]:
    """The wrapper's output as floats; anything but a flat sequence of numbers is refused precisely."""
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__iter__"):
        raise InputError(f"reward_wrapper {name}: transform must return a list of numbers, one per response, "
                         f"got {type(out).__name__}")
    rewards = []
    for i, x in enumerate(out):
        if isinstance(x, (list, tuple)) or getattr(x, "ndim", 0):
            raise InputError(f"reward_wrapper {name}: element {i} of transform's result is a list ({x!r}), "
                             "not a number: return one flat number per response")
        if isinstance(x, (bool, np.bool_)) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool):
            raise InputError(f"reward_wrapper {name}: element {i} of transform's result is a bool ({x!r}), "
                             "not a number")
        try:
            rewards.append(float(x))
        except (TypeError, ValueError):
            raise InputError(f"reward_wrapper {name}: element {i} of transform's result is "
                             f"{type(x).__name__} ({x!r}), not a number") from None
    return rewards
