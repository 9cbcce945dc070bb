"""The story a user reads after a small `main` on the test-scale world: one meaning per metric name
(every name in the README's table, none logged by two kinds of step), each version's verdict in its
description, the champion in the main run's description; and the real MLflow UI, in headless
Chromium, showing them."""
from __future__ import annotations

import os
import re
from collections import defaultdict

import mlflow
import pytest
from click.testing import CliRunner

from rlhf_mlflow.cli import cli
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.decisions.guardrails import NAMES as GUARDRAILS
from rlhf_mlflow.decisions.guardrails import TAG as NON_DEFAULT
from rlhf_mlflow.tracking.registry import release_record

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
FAMILY_LIKE = set(V.FAMILIES) | {"balanced", "pilot", "total"}


def _runs():
    return mlflow.search_runs(search_all_experiments=True, output_format="list")


def _generic(name: str) -> str:
    """`certify/certified/dune` -> `certify/certified/<family>`; a guardrail's name -> `<guardrail>`."""
    parts = name.split("/")
    if parts[-1] in FAMILY_LIKE and parts[-1] != "total":
        parts[-1] = "<family>"
    elif len(parts) > 1 and parts[-2] == "guardrail" and parts[-1] in GUARDRAILS:
        parts[-1] = "<guardrail>"
    return "/".join(parts)


def _readme_metric_names() -> set[str]:
    text = open(README).read()
    section = text[text.index("### Metric names"):]
    section = section[:section.index("\n### ", 1)]
    return set(re.findall(r"`([a-z_]+/[^`]*)`", section))


def _check_metric_names(expected_steps: set[str]) -> None:
    by_step: dict[str, set[str]] = defaultdict(set)
    logged: dict[str, set[str]] = defaultdict(set)
    for run in _runs():
        by_step[run.data.tags["rlhf.step"]] |= {_generic(k) for k in run.data.metrics}
        logged[run.data.tags["rlhf.step"]] |= set(run.data.metrics)
    assert expected_steps <= set(by_step)
    documented = _readme_metric_names()
    for step, names in by_step.items():  # a name is documented as it is (`train/stats/entropy`) or generic
        missing = sorted(n for n in logged[step] if n not in documented and _generic(n) not in documented
                         and not n.startswith("trial/dev/"))
        assert not missing, f"{step} logs names the README's metric table does not list: {missing}"
        for other, theirs in by_step.items():
            assert other == step or not names & theirs, f"{step} and {other} both log {sorted(names & theirs)}"


def test_each_step_logs_only_names_in_the_readme_and_no_name_another_step_logs(tiny_world):
    """The steps one by one on the test-scale world (the whole `main` below is slow)."""
    def run(*args):
        res = CliRunner().invoke(cli, [str(a) for a in args])
        assert res.exit_code == 0, (args, res.output)
    run("train-rl", "--world", tiny_world, "--steps", 2, "--batch-prompts", 4, "--log-every", 1)
    run("dev-eval", "--policy", "models:/rlhf-policy/1", "--world", tiny_world)
    run("certify", "--model-version", 1, "--world", tiny_world)
    run("release", "--model-version", 1)
    run("grade", "--model-version", 1, "--world", tiny_world)
    _check_metric_names({"train_rl", "dev_eval", "certify", "release", "grade"})


@pytest.mark.slow
def test_every_metric_name_main_logs_is_in_the_readme_and_logged_by_one_kind_of_step(story):
    _check_metric_names({"train_rl", "dev_eval", "certify", "release", "grade", "diagnostic", "main"})


@pytest.mark.slow
def test_each_version_says_its_verdict_and_the_main_run_names_the_champion(story):
    client = mlflow.MlflowClient()
    versions = client.search_model_versions("name = 'rlhf-policy'")
    assert len(versions) == 7
    champion = client.get_model_version_by_alias("rlhf-policy", "champion")
    for v in versions:
        decision, record = v.tags["release.decision"], release_record(v)  # record: its release run's release.json
        # the registry page reads at a glance: at most 8 tags besides the decision's own (each failed
        # guardrail, and the non-default thresholds it was released under), which the list shows whole
        shown = {k for k in v.tags if not k.startswith("failed.") and k != NON_DEFAULT}
        assert len(shown) <= 8, v.tags
        assert len(NON_DEFAULT) + len(v.tags.get(NON_DEFAULT, "")) <= 30, v.tags
        # each guardrail the version's last release failed: a tag the registry's list shows whole
        failed_tags = {k[len("failed."):]: val for k, val in v.tags.items() if k.startswith("failed.")}
        assert set(failed_tags) == {g for g in GUARDRAILS if not record["guardrails"][g]["pass"]}, (v.version, v.tags)
        assert all(len("failed.") + len(g) + len(val) <= 30 for g, val in failed_tags.items()), failed_tags
        first = v.description.splitlines()[0]  # what the registry's list shows
        verdict = first.split(" NON-DEFAULT THRESHOLDS:")[0]  # those come in full, after the verdict
        assert first.startswith(f"{decision.split()[0].upper()} v{v.version}") and len(verdict) <= 110, v.description
        assert decision.startswith("superseded by v") == (record["decision"] == "promoted"
                                                          and str(v.version) != str(champion.version))
        for name in GUARDRAILS:  # every failing guardrail on a line of its own and named on the first, none that passed
            failed = not record["guardrails"][name]["pass"]
            assert (f"- **{name}**:" in v.description) == failed, (v.version, name, v.description)
            assert not failed or name in first
        train_run = mlflow.get_run(v.run_id)
        assert train_run.data.tags["rlhf.release_decision"] == decision
        model_id = mlflow.models.get_model_info(f"models:/rlhf-policy/{v.version}").model_id
        assert client.get_logged_model(model_id).name == v.tags["recipe"]
    gate = client.get_registered_model("rlhf-policy").description
    assert "beats_champion" in gate and gate.startswith(f"Champion: v{champion.version} ({champion.tags['recipe']})")
    (main,) = [r for r in _runs() if r.data.tags["rlhf.step"] == "main"]
    description = main.data.tags["mlflow.note.content"]
    assert f"**Champion: version {champion.version} ({champion.tags['recipe']})**" in description
    # the loosened gate is on top of the story, on the main run and on every version it released
    loosened = "min_balanced_gain=-1, require_significant_gain=false"
    assert description.startswith(f"**Released under non-default guardrails: {loosened}**")
    assert main.data.tags["rlhf.non_default"] == loosened
    assert all(", ".join(release_record(v)["non_default"]) == loosened
               and f"NON-DEFAULT THRESHOLDS: {loosened}." in v.description for v in versions)
    assert "main/champion_certified_balanced" in main.data.metrics
    # a counter per decision, adding up to the candidates (a superseded version is neither promoted nor refused)
    counts = {d: main.data.metrics[f"main/candidates_{d}"] for d in ("promoted", "superseded", "refused")}
    assert counts == {d: sum(v.tags["release.decision"].split()[0] == d for v in versions) for d in counts}
    assert sum(counts.values()) == len(versions) and counts["promoted"] == 1
    assert max(len(line) for line in description.splitlines()) < 140  # reads without scrolling
    for cert in (r for r in _runs() if r.data.tags["rlhf.step"] == "certify"):
        assert "certification_table.json" in {a.path for a in client.list_artifacts(cert.info.run_id)}
        assert len(cert.data.metrics) <= 8  # what a reader compares across versions; per family a table


@pytest.mark.slow
def test_the_log_says_the_expert_set_pass_before_bought_labels_is_no_verdict(story):
    """A candidate certify refused from the expert set and `main` then bought labels for: its log says why
    labels are bought, not "NOT certifiable", and each look after says how many labels it had."""
    bought = {m.group(1) for m in re.finditer(r"version (\d+): \d+ expert labels on its own responses", story)}
    assert bought, story
    for v in bought:
        assert re.search(rf"^expert set alone cannot certify v{v} \([a-z, ]+\): buying 20 labels per family$", story,
                         re.M), story
        assert f"certify version {v}: balanced quality NOT certifiable" not in story
        assert re.search(rf"^  \d+ expert labels: certify version {v}: ", story, re.M), story
    refused_unlabelled = set(re.findall(r"^certify version (\d+): balanced quality NOT certifiable", story, re.M))
    assert refused_unlabelled and not refused_unlabelled & bought  # their verdict, printed as before


@pytest.mark.slow
def test_runs_lists_refused_certifications_with_their_reason(story):
    res = CliRunner().invoke(cli, ["runs", "--step", "certify", "--metric", "certified/balanced"])
    assert res.exit_code == 0, res.output
    certify_runs = [r for r in _runs() if r.data.tags["rlhf.step"] == "certify"]
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 + len(certify_runs)
    refused = [r for r in certify_runs if "certify/certified/balanced" not in r.data.metrics]
    assert sum("not certifiable: " in line for line in lines) == len(refused)
    assert max(map(len, lines)) <= 120


def test_mains_counters_name_every_decision_and_add_up_to_the_candidates():
    import pandas as pd

    from rlhf_mlflow.steps.main.run import _outcome_metrics
    decisions = ["refused", "refused", "superseded by v7", "superseded by v1", "promoted", "refused"]
    table = pd.DataFrame({"decision": decisions, "champion": [d == "promoted" for d in decisions],
                          "certified_balanced": [None, None, 0.36, 0.40, 0.73, 0.51]})
    metrics = _outcome_metrics(table)
    assert {k: v for k, v in metrics.items() if k.startswith("main/candidates_")} == {
        "main/candidates_promoted": 1.0, "main/candidates_superseded": 2.0, "main/candidates_refused": 3.0}
    assert metrics["main/champion_certified_balanced"] == 0.73
    assert _outcome_metrics(table.iloc[0:0]) == {f"main/candidates_{d}": 0.0
                                                 for d in ("promoted", "superseded", "refused")}


def test_the_rounds_table_shows_each_rounds_champion_with_its_certified_quality_and_truth():
    import pandas as pd

    from rlhf_mlflow.steps.reports import rounds_markdown
    table = pd.DataFrame([{"model_version": 1, "certified_balanced": 0.526, "certified_lo": 0.471, "certified_hi": 0.576,
                           "truth_balanced": 0.518},
                          {"model_version": 9, "certified_balanced": 0.734, "certified_lo": 0.703, "certified_hi": 0.763,
                           "truth_balanced": 0.722}])
    records = [{"round": 2, "rm_version": "2", "rm_promoted": True, "rm_agreement": 0.834, "repair_labels": 480,
                "champion_before": 1, "labels_before": 360, "champion": 9, "labels_spent": 840}]
    lines = rounds_markdown(records, table).strip().splitlines()
    assert lines[-2] == "| 1 | the world's | — | v1 | 0.526 [0.471, 0.576] | 0.518 | 0 | 360 |"
    assert lines[-1] == "| 2 | v2 (production) | 0.834 | v9 | 0.734 [0.703, 0.763] | 0.722 | 480 | 840 |"
    assert rounds_markdown([], table) == ""
