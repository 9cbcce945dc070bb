"""The release gate cannot be raced, forged or disabled: concurrent releases decide one at a time,
evidence that is not a finished certify run of exactly this version (or whose numbers do not
recompute) is refused, every threshold must be a finite number in range, and a dead release's lock
does not block the next one. Real sqlite stores (and a real PostgreSQL-backed server, slow)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import mlflow
import pytest
from click.testing import CliRunner
from conftest import copy_store, store_made_once
from test_certify import sharpened

from rlhf_mlflow.cli import cli
from rlhf_mlflow.core.process import process_tags
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking.policy_model import REGISTERED_MODEL, log_policy
from rlhf_mlflow.tracking.registry import load_certification, release_record
from rlhf_mlflow.tracking.release_lock import lock_name

LENIENT = "min_balanced_gain=-1,require_significant_gain=false,min_family_change=-1,waive=marker_collapse"
RLHF_MLFLOW = os.path.join(os.path.dirname(sys.executable), "rlhf-mlflow")
FACTORS = (0.7, 0.85, 1.0, 1.15, 1.3, 1.45)  # six policies the tiny world certifies at six different values


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _client():
    return mlflow.MlflowClient()


def _champion():
    try:
        return _client().get_model_version_by_alias(REGISTERED_MODEL, "champion")
    except mlflow.exceptions.MlflowException:
        return None


def _certified_versions(world: str, tmp_path, factors=FACTORS) -> dict[str, float]:
    """{version: certified balanced} for the reference sharpened by each factor, each certified."""
    out = {}
    for f in factors:
        path = sharpened(world, str(tmp_path / f"p{f}"), f)
        with T.tracked_run("train_rl", {"policy": path}):
            _, mv = log_policy(path, tags={"recipe": f"sharpened-{f}"})
        res = _run("certify", "--model-version", mv.version, "--world", world)
        assert res.exit_code == 0, res.output
        cert = _client().get_model_version(REGISTERED_MODEL, mv.version).tags["certification.run_id"]
        out[str(mv.version)] = load_certification(cert)[0]["balanced"]["estimate"]
    return out


@pytest.fixture(scope="module")
def certified_store(tiny_world, tmp_path_factory):
    """A store holding the six FACTORS versions, certified (made once for the module)."""
    return store_made_once(tmp_path_factory, "gate", lambda root: _certified_versions(tiny_world, root))


@pytest.fixture
def versions(certified_store, tmp_path, tracking_uri) -> dict[str, float]:
    """This test's own copy of the certified store."""
    root, versions = certified_store
    copy_store(root, tmp_path)
    return dict(versions)


def _forge(version: str, estimate: float, experiment: str | None = None, step: str | None = "certify",
           estimator: int | None = None, params: bool = True) -> str:
    """A run holding a copy of the version's genuine certification with every estimate set to
    `estimate`, its metrics logged to match, and (with `params`) the genuine run's parameters; the
    version's tags pointed at it (`estimator`: the report says an older estimator wrote it; 0 drops the
    field, as reports before it). Returns its id."""
    mv = _client().get_model_version(REGISTERED_MODEL, version)
    genuine = mv.tags["certification.run_id"]
    report = json.loads(open(mlflow.artifacts.download_artifacts(run_id=genuine, artifact_path="certification.json")).read())
    for row in [*report["families"].values(), report["balanced"]]:
        row.update(estimate=estimate, lo=estimate - 0.01, hi=estimate + 0.01, gain=0.5, gain_lo=0.4, gain_hi=0.6)
    if estimator is not None:
        report.pop("estimator", None)
        report.update({"estimator": estimator} if estimator else {})
    if experiment:
        mlflow.set_experiment(experiment)
    tags = {"rlhf.step": step} if step else {}
    with mlflow.start_run(tags=tags) as run:
        mlflow.log_params(_client().get_run(genuine).data.params if params else {"model_version": version})
        groups = {**report["families"], "balanced": report["balanced"]}
        mlflow.log_metrics({f"certify/certified/{g}": estimate for g in groups}, model_id=report["subject"]["model_id"])
        sha = T.log_json_artifact(report, "certification.json")
    mlflow.set_experiment("rlhf_mlflow")
    for k, v in {"certification.run_id": run.info.run_id, "certification.sha256": sha}.items():
        _client().set_model_version_tag(REGISTERED_MODEL, version, k, v)
    return run.info.run_id


def test_forged_failed_and_foreign_certifications_are_refused(versions):
    v1, v2 = list(versions)[:2]
    # the certify run marked FAILED after the fact
    cert = _client().get_model_version(REGISTERED_MODEL, v1).tags["certification.run_id"]
    _client().set_terminated(cert, "FAILED")
    res = _run("release", "--model-version", v1, "--guardrails", LENIENT)
    assert res.exit_code == 1 and "the certify run ended FAILED, not FINISHED" in res.output, res.output
    assert _champion() is None
    # a doctored report in another experiment, from a run that is no certify step
    _forge(v2, 0.9, experiment="elsewhere", step=None)
    res = _run("release", "--model-version", v2, "--guardrails", LENIENT)
    assert res.exit_code == 1 and "it is not a certify run" in res.output, res.output
    # the same, dressed as a certify run in the right experiment with matching tags and metrics:
    # recomputing it from its inputs gives the version's real numbers
    _forge(v2, 0.9)
    res = _run("release", "--model-version", v2, "--guardrails", LENIENT)
    assert res.exit_code == 1 and "recomputed from its inputs" in res.output and "the report says 0.9" in res.output
    assert _champion() is None
    tags = _client().get_model_version(REGISTERED_MODEL, v2).tags
    assert not any(k.startswith(("guardrail.", "release.")) for k in tags), tags  # registry untouched
    assert "Traceback" not in res.output
    # a certify run whose parameters do not name the inputs its report names
    _forge(v2, 0.9, params=False)
    res = _run("release", "--model-version", v2, "--guardrails", LENIENT)
    assert res.exit_code == 1 and "its certify run's parameters reference None" in res.output, res.output


def test_a_report_an_older_estimator_wrote_is_refused_with_why(versions):
    v1 = list(versions)[0]
    _forge(v1, 0.9, estimator=0)        # numbers that differ from today's, no estimator field: before it
    res = _run("release", "--model-version", v1, "--guardrails", LENIENT)
    assert res.exit_code == 1 and "written by certify's estimator 1 or 2" in res.output, res.output
    assert "certify the version again" in res.output and "Traceback" not in res.output
    assert _champion() is None
    assert not any(k.startswith(("guardrail.", "release.")) for k in _client().get_model_version(REGISTERED_MODEL, v1).tags)


def test_an_edited_certification_artifact_is_refused(tiny_world, tmp_path):
    (v,) = _certified_versions(tiny_world, tmp_path, FACTORS[:1])
    cert = _client().get_run(_client().get_model_version(REGISTERED_MODEL, v).tags["certification.run_id"])
    path = os.path.join(cert.info.artifact_uri.removeprefix("file://"), "certification.json")
    report = json.load(open(path))
    report["families"]["dune"]["kl"] = 0.0  # what family_kl reads; no logged metric changes with it
    json.dump(report, open(path, "w"), indent=1)
    res = _run("release", "--model-version", v, "--guardrails", LENIENT)
    assert res.exit_code == 1 and "is not the version's certification.sha256" in res.output, res.output
    assert _champion() is None


@pytest.mark.parametrize("threshold,message", [
    ("min_family_change=nan", "min_family_change must be a number in [-1, 1], got nan"),
    ("min_balanced_gain=inf", "min_balanced_gain must be a number in [-1, 1], got inf"),
    ("champion_margin=-0.5", "champion_margin must be a number in [0, 1], got -0.5"),
    ("max_family_kl=nan", "max_family_kl must be a number in (0, inf), got nan"),
])
def test_non_finite_or_out_of_range_thresholds_are_refused(threshold, message):
    res = _run("release", "--model-version", "1", "--guardrail", threshold)
    assert res.exit_code == 1 and message in res.output, res.output
    assert not mlflow.search_runs(search_all_experiments=True, output_format="list")


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_dead_releases_lock_is_broken_and_a_live_one_waited_for(versions):
    v = next(iter(versions))
    name = lock_name(REGISTERED_MODEL)
    holder = {**process_tags(), "token": "x", "run_id": "someone", "expires_at": f"{time.time() + 600:.0f}"}
    _client().create_registered_model(name, tags=holder)  # held by this (live) process
    res = _run("release", "--model-version", v, "--guardrails", LENIENT, "--lock-wait", 1)
    assert res.exit_code == 1 and "is held by run someone" in res.output and "runs --repair" in res.output
    assert _champion() is None
    assert "still valid" in _run("runs", "--repair").output  # a live holder is left alone
    _client().delete_registered_model(name)
    _client().create_registered_model(name, tags={**holder, "rlhf.pid": str(_dead_pid())})  # its holder died
    res = _run("release", "--model-version", v, "--guardrails", LENIENT, "--lock-wait", 30)
    assert res.exit_code == 0, res.output
    assert str(_champion().version) == v
    assert name not in {m.name for m in _client().search_registered_models()}


def test_repair_fails_runs_whose_process_is_gone_and_settles_cut_short_releases(versions):
    v = next(iter(versions))
    dead = _client().create_run(mlflow.get_experiment_by_name("rlhf_mlflow").experiment_id,
                                tags={**process_tags(), "rlhf.pid": str(_dead_pid()), "rlhf.step": "train_rl"})
    _client().set_registered_model_alias(REGISTERED_MODEL, "champion", v)
    _client().set_model_version_tag(REGISTERED_MODEL, v, "release.decision", "promoting")
    res = _run("runs", "--repair", "--dry-run")
    assert res.exit_code == 0 and dead.info.run_id in res.output
    assert _client().get_run(dead.info.run_id).info.status == "RUNNING"  # a dry run changes nothing
    res = _run("runs", "--repair")
    assert res.exit_code == 0 and "-> FAILED" in res.output and "--resume " + dead.info.run_id in res.output
    assert _client().get_run(dead.info.run_id).info.status == "FAILED"
    assert _client().get_model_version(REGISTERED_MODEL, v).tags["release.decision"] == "promoted"


def race(versions: dict[str, float], rounds: int, env: dict) -> None:
    """Start one release per version at once, `rounds` times, each time from no champion, and check
    the outcome: the champion is the best certified version, and the versions tagged promoted held
    the alias one after another in order of increasing certified quality."""
    client = _client()
    best = max(versions, key=versions.get)
    for _ in range(rounds):
        try:
            client.delete_registered_model_alias(REGISTERED_MODEL, "champion")
        except mlflow.exceptions.MlflowException:
            pass
        for v in versions:
            for k in client.get_model_version(REGISTERED_MODEL, v).tags:
                if k.startswith(("release.", "guardrail.")):
                    client.delete_model_version_tag(REGISTERED_MODEL, v, k)
        order = random.sample(list(versions), len(versions))
        procs = [subprocess.Popen([RLHF_MLFLOW, "release", "--model-version", str(v),
                                   "--guardrails", LENIENT], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for v in order]
        outs = [p.communicate(timeout=600)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), outs
        assert str(_champion().version) == best
        mvs = {v: client.get_model_version(REGISTERED_MODEL, v) for v in versions}
        records = {v: release_record(mv) for v, mv in mvs.items()}  # each version's release run's release.json
        promoted = sorted((r["decided_at"], v) for v, r in records.items() if r["decision"] == "promoted")
        chain = [v for _, v in promoted]
        assert chain[-1] == best
        assert [versions[v] for v in chain] == sorted(versions[v] for v in chain) and len(set(chain)) == len(chain)
        assert [records[v]["champion_before"] and str(records[v]["champion_before"]) for v in chain] == \
            [None] + chain[:-1]
        for v, mv in mvs.items():  # the alias's history on the versions: each champion it left says by whom
            decision = mv.tags["release.decision"]
            want = ("promoted" if v == best else f"superseded by v{chain[chain.index(v) + 1]}") if v in chain \
                else "refused"
            assert decision == want and mv.description.startswith(f"{decision.split()[0].upper()} v{v}"), (v, decision)
            if decision == "refused":
                assert not records[v]["guardrails"]["beats_champion"]["pass"], records[v]


def _env(uri: str) -> dict:
    return {**os.environ, "MLFLOW_TRACKING_URI": uri, "RLHF_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                           os.environ.get("PYTHONPATH", "")])}


def test_six_concurrent_releases_decide_one_at_a_time(versions, tracking_uri):
    race(versions, rounds=1, env=_env(tracking_uri))


@pytest.mark.slow
def test_concurrent_releases_on_sqlite_five_rounds(versions, tracking_uri):
    race(versions, rounds=5, env=_env(tracking_uri))


@pytest.mark.slow
def test_concurrent_releases_on_the_postgres_server_five_rounds(tiny_world, tmp_path, pg_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", pg_server.uri)
    mlflow.set_tracking_uri(pg_server.uri)
    race(_certified_versions(tiny_world, tmp_path), rounds=5, env=_env(pg_server.uri))


def test_release_reads_the_min_ess_certify_ran_with(versions, tiny_world):
    """Regression: one min_ess. A certification run with --min-ess 5 is refused by a release that
    requires 10, in words; a release that requires 5 accepts the families certify accepted."""
    v = next(iter(versions))
    assert _run("certify", "--model-version", v, "--world", tiny_world, "--min-ess", 5).exit_code == 0
    res = _run("release", "--model-version", v, "--guardrails", LENIENT)
    assert res.exit_code == 0 and '"decision": "refused"' in res.output
    why = release_record(_client().get_model_version(REGISTERED_MODEL, v))["guardrails"]["certifiable"]
    assert not why["pass"] and why["reason"].startswith("certified with min_ess 5, below the 10 required")
    res = _run("release", "--model-version", v, "--guardrails", LENIENT + ",min_ess=5")
    assert res.exit_code == 0 and '"decision": "promoted"' in res.output, res.output
