"""Named RL recipes: the seed's historical runs (replayed on a fresh world) and the corrected ones."""
from __future__ import annotations

from rlhf_mlflow.core.config import check_range
from rlhf_mlflow.core.vocab import PILOT_MIX

# name -> (config overrides on top of configs/default.json, the seed's run note)
SEED_HISTORY: dict[str, tuple[dict, str]] = {
    "default-s800": ({"kl_coef": 0.1, "steps": 800},
                     "configs/default.json as is. Current candidate for the release branch."),
    "kl002-s1500": ({"kl_coef": 0.02, "steps": 1500},
                    "Lower KL, longer run, to see how far the proxy can be pushed. Best dev proxy so far."),
    "kl05-s800": ({"kl_coef": 0.5, "steps": 800}, "Conservative KL for comparison; moves little."),
    "pilotmix-s800": ({"kl_coef": 0.1, "steps": 800, "family_weights": PILOT_MIX},
                      "Default recipe but prompts sampled with the pilot-traffic mix instead of the balanced "
                      "pool, to match what dev_eval scores."),
    "fourfam-s800": ({"kl_coef": 0.1, "steps": 800,
                      "family_weights": {"anvil": 1, "birch": 1, "cobalt": 1, "fjord": 1}},
                     "Ablation: train on the four high-traffic families only, to check whether the two "
                     "low-traffic families contribute to the dev proxy gain."),
}

CORRECTED = {
    "corrected-s800": {"kl_coef": 0.1, "steps": 800},
    "corrected-kl005-s1200": {"kl_coef": 0.05, "steps": 1200},
}


MAX_STEPS_SCALE = 50
"""The largest --steps-scale: the longest recipe (1,500 steps) x 50 = 75,000 steps stays within
RLConfig's bound (rl_config.MAX_STEPS)."""


def check_steps_scale(steps_scale, name: str = "--steps-scale") -> float:
    """InputError naming the option unless steps_scale is a finite number in (0, MAX_STEPS_SCALE]."""
    check_range(name, steps_scale, 0, MAX_STEPS_SCALE, lo_open=True)
    return steps_scale


def scaled(overrides: dict, steps_scale: float) -> dict:
    """A recipe with its steps multiplied (at least 1), for a quick look."""
    check_steps_scale(steps_scale, "steps_scale")
    return dict(overrides, steps=max(1, int(overrides["steps"] * steps_scale)))


CANDIDATES = list(SEED_HISTORY) + list(CORRECTED)
"""Every candidate `main` trains, in the order it releases them: history first."""
