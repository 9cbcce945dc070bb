"""The release gate's trust model (README, Guarantees): release promotes only on evidence it checked
itself. A report that names other inputs or thresholds than its certify run logged, inputs missing from
this machine (unless --trust-remote-evidence, written on the version), inputs changed since, a world
whose files are not its manifest's, a certification looser than release's thresholds, and a champion
certified on another expert set are each refused; the registry is compared before and after."""
from __future__ import annotations

import json
import os
import shutil

import mlflow
import pytest
from click.testing import CliRunner
from test_certify import sharpened

from rlhf_mlflow.cli import cli
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.steps.reports import gate_markdown
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking.policy_model import REGISTERED_MODEL, log_policy
from rlhf_mlflow.tracking.registry import release_record
from rlhf_mlflow.tracking.world_record import world_params

LENIENT = ("--guardrail", "min_balanced_gain=-1", "--guardrail", "require_significant_gain=false",
           "--guardrail", "min_family_change=-1", "--guardrail", "waive=marker_collapse")
"""A gate a test-scale world's versions can pass, certified without a diagnostic (marker collapse waived)."""


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _client():
    return mlflow.MlflowClient()


def _register(policy_dir: str, world: str | None = None) -> str:
    """A version of `policy_dir`; with `world`, trained on it: its run records the world's files as
    train_rl's does, the version is tagged with its build hash."""
    tags = {"recipe": os.path.basename(policy_dir)}
    params = {"policy": policy_dir}
    if world:
        params.update(world_params(WorldPaths.at(world)))
        tags["world_hash"] = params["world_hash"]
    with T.tracked_run("train_rl", params):
        _, version = log_policy(policy_dir, tags=tags)
    return version.version


def _registry() -> dict:
    """Everything a release could change: each version's tags and description, the aliases, the
    registered model's description."""
    model = _client().get_registered_model(REGISTERED_MODEL)
    versions = _client().search_model_versions(f"name = '{REGISTERED_MODEL}'")
    return {"aliases": dict(model.aliases), "description": model.description,
            "versions": {v.version: (dict(v.tags), v.description) for v in versions}}


def _certify(version: str, *args) -> str:
    res = _run("certify", "--model-version", version, *args)
    assert res.exit_code == 0, res.output
    return _client().get_model_version(REGISTERED_MODEL, version).tags["certification.run_id"]


def _copy_world(world: str, dst) -> str:
    path = str(dst / "world")
    shutil.copytree(world, path)
    return path


def _refused(res, *phrases) -> None:
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    for p in phrases:
        assert p in res.output, res.output


def test_a_report_edited_in_the_store_to_name_absent_inputs_is_refused(tiny_world, tmp_path):
    """The issue's forgery: certification.json edited in the artifact store (gains 0.4, every input
    path /nonexistent/...), certification.sha256 updated. The certify run's immutable params name the
    real inputs, so release refuses instead of calling it "provenance only"."""
    v = _register(os.path.join(tiny_world, "policy"))
    run_id = _certify(v, "--world", tiny_world)
    artifact = os.path.join(mlflow.get_run(run_id).info.artifact_uri.removeprefix("file://"), "certification.json")
    with open(artifact) as f:
        report = json.load(f)
    for row in [*report["families"].values(), report["balanced"]]:
        row.update(gain=0.4, gain_lo=0.35, gain_hi=0.45)
    report["inputs"] = {k: (f"/nonexistent/{k}" if p and k != "policy" else p) for k, p in report["inputs"].items()}
    raw = json.dumps(report, indent=1).encode()
    with open(artifact, "wb") as f:
        f.write(raw)
    import hashlib
    _client().set_model_version_tag(REGISTERED_MODEL, v, "certification.sha256", hashlib.sha256(raw).hexdigest())
    before = _registry()
    _refused(_run("release", "--model-version", v), "its report names", "its certify run's parameters")
    _refused(_run("release", "--model-version", v, "--trust-remote-evidence", *LENIENT), "its report names")
    assert _registry() == before


def test_inputs_missing_here_are_refused_unless_trusted_and_then_recorded(tiny_world, tmp_path):
    world = _copy_world(tiny_world, tmp_path)
    v = _register(os.path.join(world, "policy"), world)
    _certify(v, "--world", world)
    os.rename(os.path.join(world, "data", "gold_calib.jsonl"), str(tmp_path / "gold_elsewhere.jsonl"))
    before = _registry()
    _refused(_run("release", "--model-version", v, *LENIENT), "its inputs are not on this machine (gold ",
             "--trust-remote-evidence")
    assert _registry() == before
    res = _run("release", "--model-version", v, "--trust-remote-evidence", *LENIENT)
    assert res.exit_code == 0 and '"decision": "promoted"' in res.output, res.output
    mv = _client().get_model_version(REGISTERED_MODEL, v)
    assert release_record(mv)["evidence"].startswith("provenance only (--trust-remote-evidence): not recomputed")
    assert "Evidence: provenance only (--trust-remote-evidence): not recomputed" in mv.description
    assert "Evidence provenance only (--trust-remote-evidence)" in mv.description.splitlines()[0]


@pytest.mark.slow
def test_an_expert_set_changed_after_certification_is_refused(tiny_world, tmp_path):
    world = _copy_world(tiny_world, tmp_path)
    v = _register(os.path.join(world, "policy"), world)
    _certify(v, "--world", world)
    with open(os.path.join(world, "data", "gold_calib.jsonl"), "a") as f:
        f.write("\n")
    before = _registry()
    for trust in ((), ("--trust-remote-evidence",)):  # the flag is for absent inputs, never changed ones
        _refused(_run("release", "--model-version", v, *trust, *LENIENT), "its input gold ",
                 "changed after it was certified")
    assert _registry() == before


def _doctored(world: str, dst) -> str:
    """The issue's forgery: a copy of `world` with every expert label +0.4, its manifest's sha256 of
    that file (and its digest of the files) rewritten to match."""
    from rlhf_mlflow.core.digest import digest_of, file_sha256
    from rlhf_mlflow.core.world_paths import world_files
    doctored = _copy_world(world, dst)
    gold = os.path.join(doctored, "data", "gold_calib.jsonl")
    with open(gold) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(gold, "w") as f:
        f.writelines(json.dumps({**r, "label": r["label"] + 0.4}) + "\n" for r in rows)
    with open(os.path.join(doctored, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["files"]["data/gold_calib.jsonl"] = file_sha256(gold)
    renamed = {**manifest, "world_sha256": digest_of(world_files(WorldPaths.at(doctored)))}
    with open(os.path.join(doctored, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    return doctored, renamed


def test_a_world_is_what_the_store_recorded(tiny_world, tmp_path):
    """A copy of the world with every expert label +0.4 and its manifest rewritten to match: certify
    refuses a version trained on the world (naming the file) before any run starts; train-rl refuses the
    copy under the world's name; renamed in its manifest it is another world, which the version was not
    trained on. A copy whose files are the world's, byte for byte, is the world wherever it lies."""
    v = _register(os.path.join(tiny_world, "policy"), tiny_world)
    doctored, renamed = _doctored(tiny_world, tmp_path)
    runs_before, before = len(mlflow.search_runs(search_all_experiments=True)), _registry()
    _refused(_run("certify", "--model-version", v, "--world", doctored), "--gold: version", "recorded by its training run",
             "data/gold_calib.jsonl is not the world's data/gold_calib.jsonl (sha256 ")
    _refused(_run("train-rl", "--world", doctored, "--steps", 2), "is not world", "as the store recorded it when it was "
             "first used", "data/gold_calib.jsonl differs")
    with open(os.path.join(doctored, "manifest.json"), "w") as f:
        json.dump(renamed, f)  # a world of its own now: nothing recorded under its name
    _refused(_run("certify", "--model-version", v, "--world", doctored),
             "data/gold_calib.jsonl is not the world's data/gold_calib.jsonl")
    rm_copy = str(tmp_path / "rm_copy")
    shutil.copytree(os.path.join(doctored, "reward_model"), rm_copy)
    with open(os.path.join(rm_copy, "notes.txt"), "w") as f:
        f.write("an extra file is not the world's reward model either\n")
    _refused(_run("certify", "--model-version", v, "--world", tiny_world, "--rm-dir", rm_copy),
             "--rm-dir: version", "not the world's reward_model: notes.txt is not one of its files")
    assert len(mlflow.search_runs(search_all_experiments=True)) == runs_before and _registry() == before
    moved = _copy_world(tiny_world, tmp_path / "moved")
    res = _run("certify", "--model-version", v, "--world", moved)
    assert res.exit_code == 0, res.output


def test_a_looser_certification_and_a_loosened_release_are_written_on_the_version(tiny_world):
    """`certify --max-khat 5` then a default release: refused (certifiable names the threshold);
    released with --guardrail max_khat=5 it passes, and the version says so in its first line and
    its release run's release.json; the registered model's description names it champion, then the gate's
    account."""
    v = _register(os.path.join(tiny_world, "policy"))
    _certify(v, "--world", tiny_world, "--max-khat", 5)
    res = _run("release", "--model-version", v, *LENIENT)
    assert res.exit_code == 0 and '"decision": "refused"' in res.output, res.output
    mv = _client().get_model_version(REGISTERED_MODEL, v)
    why = release_record(mv)["guardrails"]["certifiable"]
    assert not why["pass"] and why["reason"].startswith("certified with max_khat 5, above the 0.7 required")
    assert mv.description.startswith(f"REFUSED v{v}: certifiable (certified with max_khat 5")  # cut to fit: "…"
    assert "- **certifiable**: certified with max_khat 5, above the 0.7 required" in mv.description  # in full
    assert _client().get_registered_model(REGISTERED_MODEL).description == gate_markdown()
    res = _run("release", "--model-version", v, *LENIENT, "--guardrail", "max_khat=5")
    assert res.exit_code == 0 and '"decision": "promoted"' in res.output, res.output
    assert "under non-default thresholds" in res.output
    mv = _client().get_model_version(REGISTERED_MODEL, v)
    loosened = "min_balanced_gain=-1, require_significant_gain=false, min_family_change=-1, max_khat=5, " \
               "waive=marker_collapse, certify.max_khat=5"
    assert ", ".join(release_record(mv)["non_default"]) == loosened
    assert f"NON-DEFAULT THRESHOLDS: {loosened}." in mv.description.splitlines()[0]
    assert _client().get_registered_model(REGISTERED_MODEL).description == gate_markdown(v, "policy")
    assert gate_markdown(v, "policy").startswith(f"Champion: v{v} (policy)")


@pytest.mark.slow
def test_the_champion_is_compared_only_on_the_same_expert_set(tiny_world, tmp_path):
    """Versions of a fixture built elsewhere (no world hash): the candidate certified on an expert set
    with every label +0.4 cannot be compared with a champion certified on the real one."""
    champion = _register(os.path.join(tiny_world, "policy"))
    _certify(champion, "--world", tiny_world)
    assert '"decision": "promoted"' in _run("release", "--model-version", champion, *LENIENT).output
    gold = str(tmp_path / "inflated.jsonl")
    with open(os.path.join(tiny_world, "data", "gold_calib.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(gold, "w") as f:
        f.writelines(json.dumps({**r, "label": r["label"] + 0.4}) + "\n" for r in rows)
    candidate = _register(sharpened(tiny_world, str(tmp_path / "candidate"), 1.1))
    _certify(candidate, "--world", tiny_world, "--gold", gold)
    res = _run("release", "--model-version", candidate, *LENIENT)
    assert res.exit_code == 0 and '"decision": "refused"' in res.output, res.output
    why = release_record(_client().get_model_version(REGISTERED_MODEL, candidate))["guardrails"]["beats_champion"]
    assert not why["pass"] and why["reason"].startswith("cannot compare with the champion")
    assert "same expert set" in why["reason"]
    assert _client().get_model_version_by_alias(REGISTERED_MODEL, "champion").version == champion
    # the champion certified (and so recomputed) on the candidate's expert set: now they compare, and
    # the alias moves exactly when the candidate's certification beats the champion's on that set
    _certify(champion, "--world", tiny_world, "--gold", gold)
    _run("release", "--model-version", candidate, *LENIENT)
    why = release_record(_client().get_model_version(REGISTERED_MODEL, candidate))["guardrails"]["beats_champion"]
    assert why["reason"].startswith("certified balanced"), why
    now = _client().get_model_version_by_alias(REGISTERED_MODEL, "champion").version
    assert now == (candidate if why["pass"] else champion), (now, why)


def test_a_repaired_reward_model_is_every_file_of_its_directory(tiny_world, tmp_path):
    """A repaired model's identity covers every file of its directory: with repair.json moved away it
    would be taken for a model that never learnt from the expert set (and certified from that set); it
    is no longer the registered version, so certify refuses it before any run, naming the option."""
    from test_repair_rm import FAST, _labels

    from rlhf_mlflow.steps.repair_rm import run_repair_rm
    from rlhf_mlflow.tracking import rm_registry as RMR
    world = WorldPaths.at(tiny_world)
    repaired = run_repair_rm(world, [_labels(world, tmp_path)], str(tmp_path / "rm"), cfg=FAST, echo=lambda m: None)
    v = _register(os.path.join(tiny_world, "policy"), tiny_world)
    mv = _client().get_model_version(RMR.RM_MODEL, repaired["version"])
    assert RMR.recorded_sha256(mv) == mv.tags["sha256"]  # the run's parameter, which cannot change
    os.rename(tmp_path / "rm" / "repair.json", tmp_path / "repair.json")
    runs_before, before = len(mlflow.search_runs(search_all_experiments=True)), _registry()
    _refused(_run("certify", "--model-version", v, "--world", tiny_world, "--rm-dir", tmp_path / "rm"),
             "--rm-dir: version", "not the world's reward_model: ")
    assert len(mlflow.search_runs(search_all_experiments=True)) == runs_before and _registry() == before
    os.rename(tmp_path / "repair.json", tmp_path / "rm" / "repair.json")
    res = _run("certify", "--model-version", v, "--world", tiny_world, "--rm-dir", tmp_path / "rm")
    assert res.exit_code == 0, res.output


def test_a_guardrail_without_its_evidence_refuses_unless_waived(tiny_world):
    """Certified without --diagnostic, nobody counted a shortcut: marker_collapse is unknown and refuses
    (it used to pass with "0 flagged shortcut(s)"). Waived, it passes, and the waiver is written on the
    version like any other non-default threshold: its description, release.json and a tag the registry's
    list shows whole."""
    v = _register(os.path.join(tiny_world, "policy"), tiny_world)
    _certify(v, "--world", tiny_world)
    strict = LENIENT[:-2]  # without the waiver
    res = _run("release", "--model-version", v, *strict)
    assert res.exit_code == 0 and '"decision": "refused"' in res.output, res.output
    mv = _client().get_model_version(REGISTERED_MODEL, v)
    why = release_record(mv)["guardrails"]["marker_collapse"]
    assert not why["pass"] and why["reason"].startswith("unknown: no diagnostic")
    assert mv.tags["failed.marker_collapse"].startswith("unknown")
    res = _run("release", "--model-version", v, *LENIENT)
    assert res.exit_code == 0 and '"decision": "promoted"' in res.output, res.output
    mv = _client().get_model_version(REGISTERED_MODEL, v)
    assert release_record(mv)["guardrails"]["marker_collapse"]["reason"].startswith("waived (unknown: no diagnostic")
    assert "waive=marker_collapse" in mv.description.splitlines()[0]
    assert mv.tags["non_default"] == "gain,sig,change+1"  # waive is the fourth: "+1"
    assert len("non_default: " + mv.tags["non_default"]) <= 30 and "failed.marker_collapse" not in mv.tags
