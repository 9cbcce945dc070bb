"""A policy nobody here wrote the model for (issue 46): examples/external_policy trains with its own
REINFORCE and its own model code (it imports nothing of rlhf_mlflow: asserted), exports its samples, and
they go label-requests --samples -> the synthetic expert -> certify-table --register -> release, as the
example's README says. Release recomputes from the tables, refuses a changed one, and refuses a guardrail
whose evidence the table lacks (no log-probs: family_kl unknown) unless waived, the waiver on the version."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import mlflow
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from rlhf_mlflow.cli import cli
from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core import tables as TB
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.decisions.certify import CertifyConfig
from rlhf_mlflow.decisions.label_requests import draw_table_requests
from rlhf_mlflow.decisions.table_certify import family_arrays
from rlhf_mlflow.tracking.policy_model import REGISTERED_MODEL
from rlhf_mlflow.tracking.registry import certification_for, release_record
from rlhf_mlflow.world.annotator import label_requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "external_policy")
LENIENT = ("--guardrails", "min_balanced_gain=-1,require_significant_gain=false,min_family_change=-1")
"""Gain thresholds a few steps of training on a test-scale world can pass (as other release tests use)."""
NO_RLHF_MLFLOW = """import importlib.abc, os, runpy, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition('.')[0] == 'rlhf_mlflow':
            raise ImportError('the example imported ' + name)
sys.meta_path.insert(0, Refuse())
script, sys.argv = sys.argv[1], sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name='__main__')
assert not [m for m in sys.modules if m.partition('.')[0] == 'rlhf_mlflow'], 'rlhf_mlflow imported'
"""
"""Runs an example script as `python SCRIPT ARGS` would, with any import of rlhf_mlflow an error."""


def _example(script: str, *args) -> str:
    proc = subprocess.run([sys.executable, "-c", NO_RLHF_MLFLOW, os.path.join(EXAMPLE, script), *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def trained(tiny_world, tmp_path_factory) -> str:
    """The example trained a few steps on the tiny world and exported (3 samples per expert prompt)."""
    d = tmp_path_factory.mktemp("external")
    _example("train.py", "--world", tiny_world, "--steps", 3, "--batch-prompts", 4, "--samples-per-prompt", 4,
             "--lr", 1e-3, "--log-every", 1, "--out", d / "ckpt")
    _example("export.py", "--world", tiny_world, "--checkpoint", d / "ckpt", "--per-prompt", 3, "--out-dir",
             d / "tables")
    return str(d)


def _run(*args):
    res = CliRunner().invoke(cli, [str(a) for a in args])
    return res


def _ok(*args) -> dict:
    res = _run(*args)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def _tables(trained: str, tmp_path, drop: tuple[str, ...] = ()) -> tuple[str, str]:
    """This test's copy of the exported tables (samples, expert set), without the columns `drop`."""
    out = []
    for name in ("samples.jsonl", "expert_set.jsonl"):
        rows = [json.loads(line) for line in open(os.path.join(trained, "tables", name))]
        D.write_jsonl(str(tmp_path / name), [{k: v for k, v in r.items() if k not in drop} for r in rows])
        out.append(str(tmp_path / name))
    return out[0], out[1]


def _certified(world: str, samples: str, expert: str, tmp_path, model_uri: str) -> str:
    """label-requests -> expert-label -> certify-table --register, as the example's README runs them."""
    _ok("label-requests", "--samples", samples, "--per-family", 20, "--out", tmp_path / "req.jsonl")
    _ok("expert-label", "--world", world, "--requests", tmp_path / "req.jsonl", "--out", tmp_path / "labels.jsonl")
    return _ok("certify-table", "--samples", samples, "--labels", tmp_path / "labels.jsonl", "--expert-set", expert,
               "--register", "reinforce-elsewhere", "--model-uri", model_uri)["model_version"]


def _version(v: str):
    return mlflow.MlflowClient().get_model_version(REGISTERED_MODEL, v)


def test_the_examples_own_models_read_the_worlds_weights_and_it_trains_its_own_format(tiny_world, trained):
    """Its own implementation scores and log-probs as ours do; its checkpoint is safetensors under its own
    names (no pickle), and training moved the weights."""
    spec = importlib.util.spec_from_file_location("tinylm", os.path.join(EXAMPLE, "tinylm.py"))
    tinylm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tinylm)
    reference, rm, _, gold = tinylm.load_world(tiny_world)
    prompts = D.prompts_tensor(gold).repeat_interleave(2, 0)
    responses = reference.sample(D.prompts_tensor(gold), 2, torch.Generator().manual_seed(0))
    ours = M.sequence_logprobs(M.load_policy(os.path.join(tiny_world, "policy"))[0], prompts, responses + V.CONTENT_LO)
    with torch.no_grad():
        assert torch.allclose(reference.logprobs(prompts, responses), ours, atol=1e-4)
    scored = R.score(R.load_rm(os.path.join(tiny_world, "reward_model"))[0], prompts, responses + V.CONTENT_LO)
    assert torch.allclose(rm.score(prompts, responses), scored, atol=1e-5)
    assert sorted(os.listdir(os.path.join(trained, "ckpt"))) == ["meta.json", "weights.safetensors"]
    weights = load_file(os.path.join(trained, "ckpt", "weights.safetensors"))
    assert "unembed.weight" in weights and not any(k.startswith(("blocks.", "tok.", "head.")) for k in weights)
    assert not torch.equal(weights["unembed.weight"], reference.unembed.weight)


def test_an_external_policy_goes_from_its_samples_to_a_guarded_release(tiny_world, trained, tmp_path):
    samples, expert = _tables(trained, tmp_path)
    uri = os.path.join(trained, "ckpt")
    v = _certified(tiny_world, samples, expert, tmp_path, uri)
    mv = _version(v)
    assert mv.source == uri and mv.tags["external"] == "true" and mv.tags["recipe"] == "reinforce-elsewhere"
    _, report = certification_for(mv)
    assert report["kind"] == "table" and report["inputs"]["samples"] == samples
    assert all(report["families"][f]["labels"] == 20 and report["families"][f]["certifiable"] for f in V.FAMILIES)
    assert all(isinstance(report["families"][f]["kl"], float) for f in V.FAMILIES)  # its log-probs: KL measured
    _ok("release", "--model-version", v, *LENIENT, "--guardrail", "waive=marker_collapse")
    record = release_record(_version(v))
    results = record["guardrails"]
    assert record["evidence"] == "recomputed"
    assert record["decision"] == ("promoted" if all(r["pass"] for r in results.values()) else "refused")
    assert record["decision"] == "promoted", results  # every guardrail passes at these thresholds
    assert results["family_kl"]["reason"].startswith("max family KL")
    assert results["marker_collapse"]["reason"].startswith("waived (unknown: no diagnostic")
    assert str(mlflow.MlflowClient().get_model_version_by_alias(REGISTERED_MODEL, "champion").version) == v

    rows = [json.loads(line) for line in open(samples)]  # the samples change after certification
    rows[-1]["score"] += 0.5
    D.write_jsonl(samples, rows)
    before = (dict(_version(v).tags), _version(v).description)
    res = _run("release", "--model-version", v, *LENIENT, "--guardrail", "waive=marker_collapse")
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "changed after it was certified" in res.output and samples in res.output, res.output
    assert (dict(_version(v).tags), _version(v).description) == before


def test_without_log_probs_family_kl_is_unknown_and_refuses_unless_waived_on_the_version(tiny_world, trained,
                                                                                         tmp_path):
    samples, expert = _tables(trained, tmp_path, drop=("logp_policy", "logp_reference"))
    v = _certified(tiny_world, samples, expert, tmp_path, os.path.join(trained, "ckpt"))
    strict = _ok("release", "--model-version", v, *LENIENT, "--guardrail", "waive=marker_collapse")
    assert strict["decision"] == "refused"
    kl = strict["guardrails"]["family_kl"]
    assert not kl["pass"] and kl["reason"].startswith("unknown: no KL measured"), kl
    assert [k for k, r in strict["guardrails"].items() if not r["pass"]] == ["family_kl"]
    assert "failed.family_kl" in _version(v).tags

    waived = _ok("release", "--model-version", v, *LENIENT, "--guardrail", "waive=marker_collapse+family_kl")
    assert waived["decision"] == "promoted"
    mv = _version(v)
    assert release_record(mv)["guardrails"]["family_kl"]["reason"].startswith("waived (unknown: no KL measured")
    assert "waive=marker_collapse+family_kl" in mv.description.splitlines()[0]
    assert "waive=marker_collapse+family_kl" in release_record(mv)["non_default"]
    assert "non_default" in mv.tags and "failed.family_kl" not in mv.tags


def test_labels_drawn_from_the_table_keep_the_label_head(tiny_world, trained):
    """Labels drawn from the table's own rows leave their prompts one unlabelled sample short: the label
    head (cross-fitted by prompt) still predicts, whatever each prompt holds."""
    samples = TB.read_samples(os.path.join(trained, "tables", "samples.jsonl"))
    expert = [r for r in TB.read_expert_set(os.path.join(trained, "tables", "expert_set.jsonl")) if r["family"] == "anvil"]
    requests = draw_table_requests(samples, 10, ["anvil"])
    labels = {r["id"]: r["label"] for r in label_requests(WorldPaths.at(tiny_world), requests)}
    ev, labelled = family_arrays([r for r in samples if r["family"] == "anvil"], labels, expert, [], CertifyConfig())
    assert len(labelled) == 10 and ev["paired"]  # on the expert set's prompts, one group each, in order
    assert ev["label_head"]
