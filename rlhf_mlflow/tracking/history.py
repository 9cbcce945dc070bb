"""Pandas over run history: a tidy per-family frame, a leaderboard, filters by recipe params.

    from rlhf_mlflow.tracking import history
    history.use_project_store()                          # the checkout's mlflow.db, from any directory
    runs = history.runs(step="train_rl")                 # one row per run
    tidy = history.family_frame(runs)                     # run_id, run_name, metric, family, value
    history.leaderboard(runs, "train/proxy/balanced")    # best first, with the recipe params
"""
from __future__ import annotations

import os

import pandas as pd

from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.tracking import metric_names as MN
from rlhf_mlflow.tracking.default_experiment import project_root
from rlhf_mlflow.tracking.runs import search_runs

FAMILY_KEYS = V.FAMILIES + ["balanced", "pilot"]
RECIPE_PARAMS = ["kl_coef", "steps", "family_weights", "reward_wrapper", "lr", "seed"]


def use_project_store() -> str:
    """Point MLflow at the project's store and return its URI: MLFLOW_TRACKING_URI when set, else the
    `mlflow.db` of the rlhf_mlflow checkout at or above the current directory, else (outside any
    checkout) of the checkout this package runs from. MLflow's own default, `sqlite:///mlflow.db`, is
    relative to the current directory: elsewhere it would create an empty store there and find no runs."""
    import mlflow
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return mlflow.get_tracking_uri()
    root = project_root() or project_root(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    store = os.path.join(root, "mlflow.db") if root else None
    if store is None or not os.path.isfile(store):
        raise InputError(f"no rlhf_mlflow tracking store at {store or 'or above ' + os.getcwd()}: run a step first "
                         "(make run), or set MLFLOW_TRACKING_URI to the store that holds the runs")
    mlflow.set_tracking_uri(f"sqlite:///{store}")
    return mlflow.get_tracking_uri()


def runs(step: str | None = None, filter_string: str = "", experiment_names: list[str] | None = None
         ) -> pd.DataFrame:
    """Runs as MLflow returns them; `step` keeps one pipeline step (train_rl, dev_eval, ...)."""
    parts = [f"tags.`rlhf.step` = '{step}'"] if step else []
    if filter_string:
        parts.append(filter_string)
    return search_runs(" and ".join(parts), experiment_names)


def family_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """Tidy: one row per (run, metric, family) for every `metrics.<metric>/<family>` column."""
    rows = []
    cols = [c for c in frame.columns if c.startswith("metrics.") and c.rsplit("/", 1)[-1] in FAMILY_KEYS]
    for _, r in frame.iterrows():
        for c in cols:
            if pd.notna(r[c]):
                metric, family = c[len("metrics."):].rsplit("/", 1)
                rows.append({"run_id": r["run_id"], "run_name": r.get("tags.mlflow.runName"),
                             "metric": metric, "family": family, "value": float(r[c])})
    return pd.DataFrame(rows, columns=["run_id", "run_name", "metric", "family", "value"])


DEFAULT_METRIC = {"train_rl": MN.TRAIN + "proxy/balanced", "dev_eval": MN.DEV + "proxy/balanced",
                  "certify": MN.CERTIFY + "certified/balanced", "grade": MN.TRUTH + "balanced",
                  "release": MN.RELEASE + "promoted", "diagnostic": MN.DIAGNOSTIC + "risk/dune"}
"""What `rlhf-mlflow runs --step S` sorts by when no --metric is given."""
STEP_PREFIX = {"train_rl": MN.TRAIN, "dev_eval": MN.DEV, "certify": MN.CERTIFY, "release": MN.RELEASE,
               "diagnostic": MN.DIAGNOSTIC, "train_rm": MN.RM, "bon": MN.BON, "main": MN.MAIN}


def metric_column(frame: pd.DataFrame, metric: str, step: str | None = None) -> str:
    """The metric's name as stored: `certified/balanced` on certify runs is `certify/certified/balanced`
    (a name from before the step prefixes still finds its column)."""
    prefix = STEP_PREFIX.get(step or "", "")
    if f"metrics.{metric}" not in frame.columns and prefix and f"metrics.{prefix}{metric}" in frame.columns:
        return prefix + metric
    return metric


def leaderboard(frame: pd.DataFrame, metric: str = MN.TRAIN + "proxy/balanced", ascending: bool = False
                ) -> pd.DataFrame:
    """Runs sorted by a metric, with their recipe params and balanced metrics beside it. Runs without
    the metric (a refused certification, a failed run) come last, with `note` saying why."""
    col = f"metrics.{metric}"
    if col not in frame.columns or frame.empty:  # the columns a board of such runs has, none in them
        return pd.DataFrame(columns=["run_id", "run_name", metric, *RECIPE_PARAMS, "note"])
    keep = ["run_id", "tags.mlflow.runName", col] + [f"params.{p}" for p in RECIPE_PARAMS if f"params.{p}" in frame]
    keep += sorted(c for c in frame.columns if c.startswith("metrics.") and c.endswith("/balanced"))
    out = frame.sort_values(col, ascending=ascending, na_position="last")[list(dict.fromkeys(keep))]
    note = frame.get("tags.rlhf.summary", pd.Series(index=frame.index, dtype=object))
    out["note"] = [("" if pd.notna(v) else _why_missing(frame.loc[i], note.get(i))) for i, v in out[col].items()]
    out.columns = [c.split(".", 1)[-1] if c.startswith(("params.", "metrics.")) else c for c in out.columns]
    return out.rename(columns={"tags.mlflow.runName": "run_name"}).reset_index(drop=True)


def _why_missing(row: pd.Series, summary) -> str:
    if row.get("status") not in (None, "FINISHED"):
        return f"run {row['status']}"
    return summary if isinstance(summary, str) and summary else "metric not logged"


def with_params(frame: pd.DataFrame, **params) -> pd.DataFrame:
    """Rows whose params equal the given values (compared as MLflow stores them, strings)."""
    mask = pd.Series(True, index=frame.index)
    for k, v in params.items():
        mask &= frame.get(f"params.{k}", pd.Series(index=frame.index, dtype=object)).astype(str) == str(v)
    return frame[mask]
