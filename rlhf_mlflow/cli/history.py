"""`rlhf-mlflow runs`: run history from the tracking store, and its repair after a crash."""
from __future__ import annotations

import click


@click.command("runs")
@click.option("--step", default="train_rl", show_default=True, help="Pipeline step (train_rl, dev_eval, ...).")
@click.option("--metric", default=None,
              help="Sort by this metric (default: the step's headline, e.g. train/proxy/balanced, certify/certified/balanced).")
@click.option("--tidy", is_flag=True, help="Print the tidy per-family frame instead of the leaderboard.")
@click.option("--repair", is_flag=True,
              help="Instead: mark RUNNING runs whose process is gone FAILED, clear a stale release lock, "
                   "settle cut-short releases.")
@click.option("--dry-run", is_flag=True, help="With --repair: say what would be done, change nothing.")
def runs_cmd(step, metric, tidy, repair, dry_run):
    """Print run history: a leaderboard (or the tidy per-family frame) from the tracking store."""
    if repair:
        from rlhf_mlflow.tracking.repair import repair as repair_store
        lines = repair_store(dry_run)
        click.echo("\n".join(lines) if lines else "nothing to repair")
        return
    if dry_run:
        raise click.UsageError("--dry-run goes with --repair")
    from rlhf_mlflow.tracking import history
    from rlhf_mlflow.tracking import metric_names as MN
    frame = history.runs(step=step)
    metric = history.metric_column(frame, metric or history.DEFAULT_METRIC.get(step, MN.TRAIN + "proxy/balanced"), step)
    out = history.family_frame(frame) if tidy else history.leaderboard(frame, metric)
    if not len(out):
        click.echo(f"no {step} runs with metric {metric}")
        return
    click.echo(fit_width(out, WIDTH))


WIDTH = 120
"""Columns of the printed table: the widest that reads without wrapping in a usual terminal."""


def fit_width(frame, width: int) -> str:
    """The frame as text no wider than `width`: long cells shortened, then columns dropped from the
    right (the sort metric and the note stay)."""
    import pandas as pd
    frame = frame.drop(columns=["run_id"], errors="ignore").copy()
    for c in frame.columns:
        if not pd.api.types.is_numeric_dtype(frame[c]):  # object or pandas' str dtype
            frame[c] = [v if not isinstance(v, str) or len(v) <= 48 else v[:47] + "…" for v in frame[c]]
    first, last = list(frame.columns[:2]), [c for c in ("note",) if c in frame]
    optional = [c for c in frame.columns if c not in first + last]
    while True:
        text = frame[first + optional + last].to_string(index=False, na_rep="—", float_format=lambda v: f"{v:.3f}")
        if max(len(line) for line in text.splitlines()) <= width or not optional:
            return text
        optional.pop()


COMMANDS = (runs_cmd,)
