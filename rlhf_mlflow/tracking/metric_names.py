"""One prefix per step kind for every metric the pipeline logs, so that a name means one thing across
the whole store (`train/kl/dune` is the training batch's KL, `dev/kl/dune` the dev prompts',
`certify/kl/dune` the expert prompts') and the MLflow UI charts each step in a section of its own.
The README's metric table lists every name; tests/test_story.py holds the store to it."""
from __future__ import annotations

TRAIN = "train/"
"""train_rl: the training batch, per logged step: `train/proxy/<family>` and `train/kl/<family>` (per family
and balanced), the sections the MLflow UI shows first."""
TRAIN_STATS = TRAIN + "stats/"
"""train_rl's other numbers, in one section after train/proxy: the balanced means of reward, shaped,
kl_k3, entropy and top_token_share (`train/stats/entropy`) and loss, grad_norm, steps_per_s."""
WATCH = "watch/"
"""train_rl with its watch on: each family's true quality estimated from the expert set on the training
step axis (`watch/<family>`, `watch/se/<family>`, `watch/vouched/<family>`) and
`watch/past_peak/<family>` (0/1); the Gao fits are a table and a figure, not metrics."""
DEV = "dev/"
"""dev_eval: the dev prompts, sampled from the policy (proxy, kl, the reward model against the expert set;
balanced and summary numbers, per family a table)."""
CERTIFY = "certify/"
"""certify: the expert set, reweighted to the policy (the balanced certified quality, its interval and
gain, families certified, labels spent; per family a table)."""
TRUTH = "truth/"
"""grade: the oracle's true quality, balanced (per family a table; benchmarks and the story's last
column; never read by a decision)."""
RELEASE = "release/"
"""release: whether the version was promoted, and how many guardrails failed (which: release.json)."""
TRIAL = "trial/"
"""A sweep trial's train_rl run: its dev evaluation and guardrails, copied onto it for the sweep table."""
DIAGNOSTIC = "diagnostic/"
LABELS = "labels/"
"""expert_label: labels written per family."""
REQUESTS = "requests/"
"""label_requests: responses asked to be labelled, per family."""
RM = "rm/"
"""train_rm: loss per epoch and the fit to crowd and expert labels."""
REPAIR = "repair/"
"""repair_rm: the fine-tune's loss per epoch; the cross-validated agreement with the expert labels (balanced,
the parent's beside it; per family a table), expert labels used, promoted (0/1)."""
BUILD = "build/"
"""build_world: seconds per phase."""
MAIN = "main/"
"""main: the story's outcome (the champion's certified quality, labels bought, candidates refused)."""
BON = "bon/"
SWEEP = "sweep/"


def prefixed(prefix: str, metrics: dict) -> dict:
    """The metrics under `prefix` (a name that already has it is left as it is)."""
    return {(k if k.startswith(prefix) else prefix + k): v for k, v in metrics.items()}
