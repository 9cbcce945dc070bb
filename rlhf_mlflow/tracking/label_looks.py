"""How many times a version's expert labels have been looked at, as the store records it.

An interval from labels bought in rounds is valid only for the looks it was paid for: a union bound over
the looks planned (`label_looks`), or a share of the error budget fixed before the first look
(`label_spending`, decisions/labelled.py). So the look a certification is at must come from the store,
not from the user: each distinct labels file (by content, sha256) that a certify run of the version
used is one look, in the order the runs started; the same file certified again is the same look. Runs
of every experiment and lifecycle stage count (deleting a run or its experiment does not undo a look),
FINISHED and RUNNING ones (a concurrent one counts); a FAILED or KILLED run showed no interval. certify asks before
its run which look it is; release asks again up to the certification run's start and refuses a report
whose look differs (ties in start time count against it: concurrent looks fail closed).
"""
from __future__ import annotations

from rlhf_mlflow.tracking.runs import logged_param
from rlhf_mlflow.tracking.store_search import every_run

LABEL_SHA_PARAMS = ("policy_labels_sha256", "labels_sha256")
"""The parameters a certify run names its labels file's sha256 by (certify, certify-table)."""
COUNTED = ("FINISHED", "RUNNING")


def labels_sha(params: dict) -> str | None:
    """The sha256 of the labels file a certify run's parameters name, or None (no labels)."""
    return next((logged_param(params, k) for k in LABEL_SHA_PARAMS if logged_param(params, k)), None)


def looks(version: str | int, until_ms: int | None = None, exclude_run: str | None = None) -> list[str]:
    """The distinct labels files (sha256) the version's labelled certify runs used, in the order of their
    first use; `until_ms`: only runs started at or before then; `exclude_run`: leave that run out."""
    # the version as the step logged it (under `mlflow run` possibly only as `resolved.model_version`)
    runs = [r for r in every_run("tags.`rlhf.step` = 'certify'")
            if logged_param(r.data.params, "model_version") == str(version) and r.info.status in COUNTED
            and r.info.run_id != exclude_run and (until_ms is None or r.info.start_time <= until_ms)]
    out: list[str] = []
    for run in sorted(runs, key=lambda r: (r.info.start_time, r.info.run_id)):
        sha = labels_sha(run.data.params)
        if sha and sha not in out:
            out.append(sha)
    return out


def look_of(sha: str, order: list[str]) -> int:
    """Which look (1-based) a labels file is, given the looks so far (a new file is the next one)."""
    return order.index(sha) + 1 if sha in order else len(order) + 1
