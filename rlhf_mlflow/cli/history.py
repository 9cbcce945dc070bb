"""`rlhf-mlflow runs`: run history from the tracking store, and its repair after a crash."""
from __future__ import annotations

import click


@click.command("runs")
@click.option("--step", default="train_rl", show_default=True, help="Pipeline step (train_rl, dev_eval, ...).")
@click.option("--metric", default="proxy/balanced", show_default=True, help="Sort by this metric.")
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
    import pandas as pd

    from rlhf_mlflow.tracking import history
    frame = history.runs(step=step)
    out = history.family_frame(frame) if tidy else history.leaderboard(frame, metric)
    with pd.option_context("display.max_rows", 200, "display.width", 200, "display.max_columns", 30):
        click.echo(out.to_string(index=False) if len(out) else f"no {step} runs with metric {metric}")


COMMANDS = (runs_cmd,)
