"""The `bon` step: best-of-N selection against a reward model as an MLflow run (the chosen samples
as an artifact, per-family proxy of the chosen and of a plain sample). With an expert set
(`watch_gold`), the watch's best-of-n curve too (decisions/bon_watch.py): `bon/watch/<family>` and its
se at step n for n = 1, 2, 4, ..., N, the best-of-n form's fit (the table `bon_gao_fits.json`, the tag
`rlhf.bon.peaks`: a peak's KL or 'no peak in range') and `figures/bon_gao_fits.png`."""
from __future__ import annotations

import os
import tempfile

import pandas as pd

from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core.reward_wrapper import load_wrapper
from rlhf_mlflow.decisions import bon_watch as BW
from rlhf_mlflow.decisions import watch as W
from rlhf_mlflow.evidence.bon import bon_points
from rlhf_mlflow.steps.outputs import check_out
from rlhf_mlflow.tracking import metric_names as MN
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking.policy_model import resolve_policy
from rlhf_mlflow.training.bon import best_of_n


FIGURE, FITS = "figures/bon_gao_fits.png", "bon_gao_fits.json"


def run_bon(policy: str, reward_model: str, prompts: str, n: int = 32, limit: int | None = None, seed: int = 0,
            out: str | None = None, watch_gold: str | None = None, watch_correction: str | None = None) -> dict:
    """Best-of-n on the first `limit` prompts; returns the metrics. `out` receives the samples (JSONL).
    `watch_gold` (an expert set): the watch's best-of-n curve and fit as well, the reward model
    corrected by `watch_correction` in its estimates."""
    if out:
        check_out(out, {"--policy": policy, "--reward-model": reward_model, "--prompts": prompts,
                        "--watch-gold": watch_gold, "--watch-correction": watch_correction})
    records = D.read_jsonl(prompts)
    gold = D.read_jsonl(watch_gold, labelled=True, scale=D.EXPERT) if watch_gold else None
    wrapper = load_wrapper(watch_correction) if watch_correction else None
    params = {"policy": policy, "reward_model": reward_model, "prompts": prompts, "n": n, "limit": limit,
              "seed": seed, "watch_gold": watch_gold, "watch_correction": watch_correction}
    with T.tracked_run("bon", params), tempfile.TemporaryDirectory() as tmp:
        policy_dir, model_id = resolve_policy(policy)
        T.log_records_input(records, prompts, "prompts")
        base, rm = M.load_policy(policy_dir)[0], R.load_rm(reward_model)[0]
        samples, metrics = best_of_n(base, rm, records[:limit], n, seed=seed)
        path = out or os.path.join(tmp, "samples.jsonl")
        D.write_jsonl(path, samples)
        T.log_artifact(path, "samples")
        T.log_metrics(MN.prefixed(MN.BON, metrics), model_id=model_id)
        if gold is not None:
            metrics.update(_watch(base, rm, wrapper, gold, n, seed))
    return metrics


def _watch(base, rm, wrapper, gold: list[dict], n: int, seed: int) -> dict:
    """The best-of-n curve at n = 1, 2, 4, ..., n (logged at step n) and its fits (at step n, and
    returned under watch/...)."""
    from rlhf_mlflow.steps.figures import gao_fits  # matplotlib: only when drawing
    points = bon_points(base, rm, wrapper, gold, BW.ladder(n), cfg=W.WatchConfig(seed=seed))
    for pt in points:
        T.log_metrics(MN.prefixed(MN.BON + MN.WATCH, {**pt.estimate, **{f"se/{k}": v for k, v in pt.se.items()}}),
                      step=pt.step)
    fits = BW.bon_fits(points)
    rows = W.fit_rows(fits, points)  # a peak out of range is said so, not charted
    T.log_table(pd.DataFrame(rows), FITS)
    T.set_tags({"rlhf.bon.peaks": "; ".join(f"{r['family']}: {r['peak']}" for r in rows)})
    T.log_figure(gao_fits(points, fits, {}, "best-of-n: estimated gain, fit d (alpha - beta d)"), FIGURE)
    return MN.prefixed(MN.WATCH, {**points[-1].estimate,
                                  **{f"gao_{k}/{r['family']}": r[k] for r in rows for k in ("alpha", "beta", "peak_kl")
                                     if r[k] is not None}})
