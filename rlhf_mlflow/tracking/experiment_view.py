"""What a user sees first when they open the experiment in MLflow's UI.

An experiment's `mlflow.experimentKind` tag says which page MLflow's UI opens it on; `mark_kind` makes
it custom model development (its runs). MLflow 3.17's UI reads it only without its browser-side GenAI /
Model training switch, which defaults to GenAI (a GenAI overview with the runs one toggle away): the
`rlhf` server app (ui_app.py) defaults that switch to model training.

The experiment's description (`mlflow.note.content`, shown above the runs) is `main`'s front page:
who is champion and why not the others. Its link opens a *shared view* of the runs table (an
experiment tag `mlflow.sharedViewState.<key>` holding the table's state, the UI's own "share
view" format): the candidates' verdict, certified quality and truth as columns (tags on each
candidate's training run, `rlhf.view.*`), and every run on the charts rather than the first ten.

How MLflow 3.17's runs table draws that state (read from its bundle, checked by tests/test_ui_browser.py):
- it nests child runs under their parent, fetching a parent the filter left out, only when sorted by
  creation time or unfiltered; the view is filtered to the candidates and sorted by their verdict
  (`champion` < `refused` < `superseded`), so each candidate is a top-level row and `main` is not shown;
- it applies `columnWidths` only to the columns listed in `columnOrder`, so both name the view's columns.
"""
from __future__ import annotations

import json

import mlflow

KIND_TAG = "mlflow.experimentKind"
KIND = "custom_model_development"  # the UI's value that opens on the runs table
NOTE_TAG = "mlflow.note.content"
VIEW_KEY = "rlhf-candidates"
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
VERDICT, CERTIFIED, TRUTH = "rlhf.view.verdict", "rlhf.view.certified", "rlhf.view.truth"
COLUMNS = [f"tags.`{VERDICT}`", f"tags.`{CERTIFIED}`", f"tags.`{TRUTH}`", "attributes.`Models`",
           "attributes.`Duration`"]
WIDTHS = {f"tags.`{VERDICT}`": 560, f"tags.`{CERTIFIED}`": 200, f"tags.`{TRUTH}`": 110}
"""Pixels: a verdict naming every guardrail (`refused v2: certifiable, balanced_gain, family_change,
family_kl, marker_collapse`) and an interval (`0.502 [0.470, 0.536]`) whole, at the UI's 13 px font."""


def mark_kind(experiment_id: str) -> None:
    """Tag the experiment as custom model development unless a user chose a kind already."""
    client = mlflow.MlflowClient()
    if KIND_TAG not in client.get_experiment(experiment_id).tags:
        client.set_experiment_tag(experiment_id, KIND_TAG, KIND)


def view_link(experiment_id: str) -> str:
    """The UI's link (relative to the server root) to the candidates view of the runs table."""
    return f"#/experiments/{experiment_id}/runs?viewStateShareKey={VIEW_KEY}"


def publish_view(experiment_id: str) -> str:
    """Write the candidates view on the experiment; returns its link."""
    state = {"selectedColumns": COLUMNS, "columnOrder": COLUMNS, "columnWidths": WIDTHS, "runsHiddenMode": "SHOW_ALL",
             "hideEmptyCharts": True, "orderByKey": f"tags.`{VERDICT}`", "orderByAsc": True,
             "searchFilter": f"tags.`{VERDICT}` LIKE '%'"}  # the candidates only, as top-level rows
    mlflow.MlflowClient().set_experiment_tag(experiment_id, VIEW_TAG_PREFIX + VIEW_KEY, json.dumps(state))
    return view_link(experiment_id)


def publish_front_page(experiment_id: str, markdown: str) -> None:
    """The experiment's description: shown above its runs in the UI."""
    mlflow.MlflowClient().set_experiment_tag(experiment_id, NOTE_TAG, markdown)


def label_candidate(run_id: str, verdict: str, certified: str, truth: str) -> None:
    """A candidate's training run says its verdict, certified quality and truth (the view's columns)."""
    client = mlflow.MlflowClient()
    for key, value in ((VERDICT, verdict), (CERTIFIED, certified), (TRUTH, truth)):
        client.set_tag(run_id, key, value)


def relabel_former_champions(experiment_id: str, champion: str) -> None:
    """Candidate runs whose verdict still says `champion vN` for a version the alias has left now say
    `superseded vN by v<champion>`."""
    client = mlflow.MlflowClient()
    for run in client.search_runs([experiment_id], f"tags.`{VERDICT}` LIKE 'champion v%'"):
        version = run.data.tags[VERDICT].split()[1][1:]
        if version != champion:
            client.set_tag(run.info.run_id, VERDICT, f"superseded v{version} by v{champion}")
