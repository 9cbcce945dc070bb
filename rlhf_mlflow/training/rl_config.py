"""The RL recipe: one frozen config (the seed's keys and defaults, a docstring under each) and how
one is read: a JSON config file plus overrides -> a validated RLConfig with absolute paths.

Relative paths inside a config file resolve against its fixture root (the directory above
`configs/`, else the file's own directory); relative paths in overrides resolve against the current
directory (the CLI resolves its own options against the world before passing them).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core.config import MAX_SEED, check_range, from_dict, parse_override
from rlhf_mlflow.core.errors import InputError, read_json

PATH_KEYS = ("policy_init", "policy_ref", "reward_model", "prompt_file", "reward_wrapper", "watch_gold",
             "watch_correction", "reward_ensemble")
EARLY_STOP = ("off", "warn", "stop")
MAX_STEPS = 100_000
"""The seed's longest run took 1,500 steps (~2 minutes on 2 cores per 800): 100,000 is days of CPU,
and every step count (steps, log_every, save_every, the watch's) is bounded by it."""
MAX_RESPONSES = 65_536
"""Responses sampled per step (batch_prompts x samples_per_prompt; the seed's 16 x 8 = 128): a step's
activations grow with it, and 65,536 is a few GB."""
RANGES: dict[str, tuple] = {
    "kl_coef": (0, 100, False, False), "steps": (1, MAX_STEPS, True, False),
    "batch_prompts": (1, 4096, True, False), "lr": (0, 1, False, True), "temperature": (0, 100, False, True),
    "seed": (0, MAX_SEED, True, False), "log_every": (1, MAX_STEPS, True, False),
    "save_every": (0, MAX_STEPS, True, False), "max_grad_norm": (0, 1e6, False, True),
    "ensemble_penalty": (0, 100, False, False), "watch_every": (0, MAX_STEPS, True, False),
    "watch_early_every": (0, MAX_STEPS, True, False),
}
"""field: (lowest, highest, integer, lowest excluded); samples_per_prompt has its own sentence."""


def check_fields(values: dict) -> None:
    """InputError naming the first numeric field among `values` (RLConfig keys; others are ignored)
    that is not finite and inside its range: what RLConfig checks, before a command resolves its world."""
    for name, value in values.items():
        if name in RANGES:
            lo, hi, integer, lo_open = RANGES[name]
            check_range(name, value, lo, hi, integer=integer, lo_open=lo_open)
    if "samples_per_prompt" in values:
        n = values["samples_per_prompt"]
        if not isinstance(n, int) or isinstance(n, bool) or not 2 <= n <= 256:
            raise InputError("samples_per_prompt must be an integer >= 2 (the group-mean baseline compares samples "
                             f"of the same prompt) and at most 256, got {n!r}")


@dataclass(frozen=True)
class RLConfig:
    policy_init: str | None = None
    """Checkpoint directory to start from (default: policy_ref)."""
    policy_ref: str = "policy"
    """Reference policy for the KL penalty (relative paths resolve against the fixture root)."""
    reward_model: str = "reward_model"
    """Reward-model checkpoint directory (rm.safetensors + config.json)."""
    prompt_file: str = "data/prompts_train.jsonl"
    """JSONL prompt records to train on."""
    family_weights: dict | None = None
    """Sampling mix over families, e.g. {"anvil": 1, "dune": 0}; default uniform over families present."""
    kl_coef: float = 0.1
    """beta: shaped reward = R - beta * sum_t (log pi - log pi_ref)."""
    steps: int = 800
    """Optimiser steps."""
    batch_prompts: int = 16
    """Prompts per step."""
    samples_per_prompt: int = 8
    """Responses sampled per prompt; the group-mean baseline needs at least 2."""
    lr: float = 3e-4
    """Adam learning rate."""
    temperature: float = 1.0
    """Sampling temperature during training."""
    seed: int = 0
    """Seed for initialisation, prompt draws and sampling."""
    log_every: int = 20
    """Report metrics every this many steps (averaged over them)."""
    save_every: int = 0
    """Checkpoint every this many steps (0: only the final policy)."""
    reward_wrapper: str | None = None
    """Python file defining transform(records, response_tokens, rewards) -> rewards, applied before the KL term."""
    reward_ensemble: str | None = None
    """A reward-model ensemble directory (ensemble.json + member directories; `repair-rm --ensemble K`):
    the reward is its members' mean minus ensemble_penalty x their spread, in place of reward_model's score."""
    ensemble_penalty: float = 0.0
    """k in mean - k x standard deviation over the ensemble's members: how much less a response is paid
    where the members disagree (0: their mean; docs/REPAIR.md)."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip."""
    watch_every: int = 0
    """Estimate each family's true quality from the expert set every this many steps (0: no watch)."""
    watch_early_every: int = 20
    """Before the first `watch_every` step, watch every this many steps too (0: no dense start): the
    default world's corruptions are exploited within ~25 steps (docs/WATCH.md). Every 10 caught them no
    earlier there and cost two more points (docs/PERFORMANCE.md)."""
    watch_gold: str | None = None
    """The watch's expert set (labelled reference samples, JSONL); required when watch_every > 0."""
    watch_correction: str | None = None
    """Reward wrapper applied to the reward model in the watch's estimates (default: reward_wrapper)."""
    early_stop: str = "warn"
    """When the watch finds a family past its peak: off (nothing), warn (tag the run), stop (end there)."""

    def __post_init__(self):
        check_fields({k: getattr(self, k) for k in (*RANGES, "samples_per_prompt")})
        if self.batch_prompts * self.samples_per_prompt > MAX_RESPONSES:
            raise InputError(f"batch_prompts x samples_per_prompt must be at most {MAX_RESPONSES:,} responses a step, "
                             f"got {self.batch_prompts} x {self.samples_per_prompt}")
        if self.ensemble_penalty and not self.reward_ensemble:
            raise InputError(f"ensemble_penalty={self.ensemble_penalty} needs reward_ensemble, the ensemble "
                             "whose members' spread it penalises (repair-rm --ensemble K writes one)")
        D.check_family_weights(self.family_weights)
        if self.watch_every and not self.watch_gold:
            raise InputError(f"watch_every={self.watch_every} needs watch_gold, the expert set the watch "
                             "estimates from (a world's data/gold_calib.jsonl)")
        if self.early_stop not in EARLY_STOP:
            raise InputError(f"early_stop must be one of {', '.join(EARLY_STOP)}, got {self.early_stop!r}")

    def watch_due(self, step: int) -> bool:
        """Whether the watch looks at this step: 0, every watch_early_every steps before watch_every,
        then every watch_every steps."""
        if not self.watch_every:
            return False
        early = self.watch_early_every and step < self.watch_every and step % self.watch_early_every == 0
        return step % self.watch_every == 0 or bool(early)

    def resolved(self, root: str) -> "RLConfig":
        """Relative paths made absolute against `root`; policy_init defaults to policy_ref."""
        def fix(p):
            return p if p is None or os.path.isabs(p) else os.path.normpath(os.path.join(root, p))
        out = replace(self, **{k: fix(getattr(self, k)) for k in PATH_KEYS})
        return out if out.policy_init else replace(out, policy_init=out.policy_ref)


def fixture_root(config_path: str) -> str:
    d = os.path.dirname(os.path.abspath(config_path))
    return os.path.dirname(d) if os.path.basename(d) == "configs" else d


def parse_overrides(texts: list[str] | tuple[str, ...]) -> dict:
    """`key=value` strings (values parsed as JSON when they are JSON) -> {key: value}."""
    return dict(parse_override(t) for t in texts)


def load_rl_config(config_path: str | None, overrides: dict | None = None, root: str | None = None) -> RLConfig:
    """Config file (optional) + overrides {key: value} -> RLConfig with absolute paths."""
    base: dict = {}
    if config_path:
        base = read_json(config_path, "config file not found")
        if not isinstance(base, dict):
            raise InputError(f"{config_path}: expected a JSON object of config keys")
    file_root = root or (fixture_root(config_path) if config_path else os.getcwd())
    merged = {k: v for k, v in base.items() if v is not None}
    for k in PATH_KEYS:
        if isinstance(merged.get(k), str) and not os.path.isabs(merged[k]):
            merged[k] = os.path.normpath(os.path.join(file_root, merged[k]))
    for k, v in (overrides or {}).items():
        merged[k] = os.path.abspath(v) if k in PATH_KEYS and isinstance(v, str) else v
    where = (config_path or "config") + (" with overrides" if overrides else "")
    return from_dict(RLConfig, merged, where).resolved(file_root)
