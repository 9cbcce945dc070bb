"""Certify and release against a real registry: the champion alias only ever points at a version
whose guardrail tags all pass, and bad input never moves it."""
from __future__ import annotations

import os

import mlflow
import pytest
from click.testing import CliRunner
from test_certify import sharpened

from rlhf_mlflow.cli import cli
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking.registry import release_record
from rlhf_mlflow.tracking.policy_model import REGISTERED_MODEL, log_policy

# a tiny world cannot show a real certified gain, so the first release relaxes the gain thresholds
LENIENT = "min_balanced_gain=-1,require_significant_gain=false,min_family_change=-1,waive=marker_collapse"


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _register(policy_dir: str) -> str:
    with T.tracked_run("train_rl", {"policy": policy_dir}):
        _, version = log_policy(policy_dir, tags={"recipe": os.path.basename(policy_dir)})
    return version.version


def _champion():
    try:
        return mlflow.MlflowClient().get_model_version_by_alias(REGISTERED_MODEL, "champion")
    except mlflow.exceptions.MlflowException:
        return None


def _assert_champion_all_pass():
    champ = _champion()
    if champ is None:
        return
    guard = release_record(champ)["guardrails"]  # the release run that promoted it
    assert guard and all(g["pass"] for g in guard.values()), guard


def _last_run(step):
    (run,) = mlflow.search_runs(search_all_experiments=True, filter_string=f"tags.`rlhf.step` = '{step}'",
                                output_format="list", max_results=1, order_by=["attributes.start_time DESC"])
    return run


@pytest.mark.filterwarnings("ignore")
def test_release_moves_the_champion_only_on_all_pass(tiny_world, tmp_path):
    good = _register(os.path.join(tiny_world, "policy"))
    far = _register(sharpened(tiny_world, str(tmp_path / "far")))
    uncertified = _register(sharpened(tiny_world, str(tmp_path / "other"), factor=1.5))

    # no certification yet: refused with a clear message, the run FAILED, no alias
    res = _run("release", "--model-version", good)
    assert res.exit_code == 1 and "has no certification" in res.output
    assert _last_run("release").info.status == "FAILED" and _champion() is None

    assert _run("certify", "--model-version", good, "--world", tiny_world).exit_code == 0
    cert_good = mlflow.MlflowClient().get_model_version(REGISTERED_MODEL, good).tags["certification.run_id"]
    run = mlflow.get_run(cert_good)
    assert "certify/certified/balanced" in run.data.metrics and "certify/families_certified" in run.data.metrics
    arts = {a.path for a in mlflow.MlflowClient().list_artifacts(cert_good)}
    assert {"certification.json", "certification.md", "certify_families.json", "figures"} <= arts

    # an unknown guardrail key: refused before anything moves
    res = _run("release", "--model-version", good, "--guardrails", "max_kl=3")
    assert res.exit_code == 1 and "unknown guardrail key 'max_kl'" in res.output and _champion() is None
    res = _run("release", "--model-version", good, "--guardrail", "min_ess=10", "--guardrail", "max_kl=3")
    assert res.exit_code == 1 and "unknown guardrail key 'max_kl'" in res.output and _champion() is None

    res = _run("release", "--model-version", good, "--guardrails", LENIENT)
    assert res.exit_code == 0, res.output
    assert _champion().version == good
    _assert_champion_all_pass()

    # a failing candidate after a passing one: tagged with what failed, alias unchanged
    assert _run("certify", "--model-version", far, "--world", tiny_world).exit_code == 0
    res = _run("release", "--model-version", far, "--guardrails", LENIENT)
    assert res.exit_code == 0 and '"decision": "refused"' in res.output
    mv = mlflow.MlflowClient().get_model_version(REGISTERED_MODEL, far)
    assert mv.tags["release.decision"] == "refused" and not release_record(mv)["guardrails"]["certifiable"]["pass"]
    assert mv.description.startswith(f"REFUSED v{far}: certifiable")
    assert mv.tags["failed.certifiable"]  # and the registry's list shows it whole, as a tag
    assert _champion().version == good
    _assert_champion_all_pass()

    # a certification of another version is refused, whoever passes it
    res = _run("release", "--model-version", uncertified, "--certification-run", cert_good, "--guardrails", LENIENT)
    assert res.exit_code == 1 and f"refused for {REGISTERED_MODEL} version {uncertified}: the certify run was for version" in res.output
    assert _champion().version == good
    _assert_champion_all_pass()


def test_a_report_certified_before_the_widening_is_recomputed_without_it():
    from rlhf_mlflow.steps.release import _certify_config
    old = {"config": {"min_ess": 12.0, "seed": 3}}                      # written before ess_widening existed
    assert _certify_config(old).ess_widening == 0.0 and _certify_config(old).min_ess == 12.0
    assert _certify_config({"config": {"ess_widening": 10.0}}).ess_widening == 10.0
    assert _certify_config({}).ess_widening == 0.0
