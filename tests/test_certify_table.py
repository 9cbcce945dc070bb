"""Certify a policy trained anywhere from a table of its samples (issue 46): the same intervals as certify
on the same arrays, bad tables named in one line, and the loop sample -> request -> label -> certify ->
release through the registry with no model of ours in the process."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import mlflow
import pytest
import torch
from click.testing import CliRunner
from test_certify import sharpened

from cli_checks import fails as _fails
from rlhf_mlflow.cli import cli
from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.decisions.certify import CertifyConfig
from rlhf_mlflow.decisions.table_certify import table_report
from rlhf_mlflow.evidence.certify import certify
from rlhf_mlflow.evidence.certify_evidence import family_evidence, scores
from rlhf_mlflow.evidence.label_requests import draw_requests
from rlhf_mlflow.world.annotator import label_requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPARED = ("certifiable", "estimate", "lo", "hi", "gain", "gain_lo", "gain_hi", "labels", "reference", "kl")


def _write(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


@torch.no_grad()
def export_tables(policy_dir: str, world: WorldPaths, labels_path: str, tmp_path, cfg=CertifyConfig()) -> dict:
    """What a team would log from its own stack, here from this project's models: the policy's samples on
    the expert prompts (K each, drawn as certify draws them) and the labelled responses, each with the
    reward model's score and both log-probs; the expert set with its scores and log-probs; the labels."""
    policy, reference, rm = M.load_policy(policy_dir)[0], M.load_policy(world.policy)[0], R.load_rm(world.reward_model)[0]
    gold, labelled = D.read_jsonl(world.expert_set, labelled=True), D.read_jsonl(labels_path, labelled=True)
    gen = torch.Generator().manual_seed(cfg.seed)
    samples, expert = [], []
    for f in V.FAMILIES:
        rows = [r for r in gold if r["family"] == f]
        ev = family_evidence(policy, reference, rm, None, rows, cfg, [], gen)
        own = ev["policy_ids"]
        prompts, responses = own[:, :-V.RESP_LEN], own[:, -V.RESP_LEN:]
        lp, ref_lp = M.sequence_logprobs(policy, prompts, responses), M.sequence_logprobs(reference, prompts, responses)
        for j in range(len(own)):
            drawn_on = rows[j // cfg.samples_per_prompt]
            samples.append({"id": f"own-{f}-{j}", "family": f, "attrs": drawn_on["attrs"], "prompt_id": drawn_on["id"],
                            "response": " ".join(V.decode_response(responses[j].tolist())),
                            "score": float(ev["policy_scores_all"][j]), "logp_policy": float(lp[j]),
                            "logp_reference": float(ref_lp[j])})
        p_xp, r_xp = D.prompts_tensor(rows), D.responses_tensor(rows)
        lp, ref_lp = M.sequence_logprobs(policy, p_xp, r_xp), M.sequence_logprobs(reference, p_xp, r_xp)
        expert += [{**r, "prompt_id": r["id"], "score": float(ev["scores"][i]), "logp_policy": float(lp[i]),
                    "logp_reference": float(ref_lp[i])} for i, r in enumerate(rows)]
        first = {}  # a label on a prompt the expert set drew twice belongs to its first draw (as certify pairs it)
        for r in rows:
            first.setdefault(tuple(r["attrs"]), r["id"])
        mine = [r for r in labelled if r["family"] == f]
        if mine:
            s = scores(rm, None, mine, D.prompts_tensor(mine), D.responses_tensor(mine))
            samples += [{"id": r["id"], "family": f, "attrs": r["attrs"], "response": " ".join(r["response"]),
                         "prompt_id": first[tuple(r["attrs"])], "score": float(s[i])} for i, r in enumerate(mine)]
    return {"samples": _write(tmp_path / "samples.jsonl", samples), "expert_set": _write(tmp_path / "expert.jsonl", expert),
            "labels": _write(tmp_path / "labels_table.jsonl", [{"id": r["id"], "label": r["label"]} for r in labelled])}


def _labels(policy_dir: str, world: WorldPaths, per_family: int, path) -> str:
    requests = draw_requests(M.load_policy(policy_dir)[0], D.read_jsonl(world.expert_set, labelled=True), per_family)
    return _write(path, label_requests(world, requests))


def _close(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4)
    return a == b


def test_the_table_certifies_our_own_policy_as_certify_does(tiny_world, tmp_path):
    """Parity: our policy's own samples and scores, exported to tables, give certify's intervals family
    by family (labelled, joint and off-policy alike) and balanced, to float tolerance."""
    world = WorldPaths.at(tiny_world)
    policy = sharpened(tiny_world, str(tmp_path / "policy"), 1.6)
    labels = _labels(policy, world, 20, tmp_path / "labels.jsonl")
    ours = certify(policy, world.policy, world.expert_set, rm_dir=world.reward_model, policy_labels=labels)
    tables = export_tables(policy, world, labels, tmp_path)
    theirs = table_report(tables)
    used = theirs["labels_used"]  # every label of the table named, with the samples it was bought on
    assert used["sha256"] == theirs["input_sha256"]["labels"] and used["bought_on"]["samples"] == tables["samples"]
    assert sum(len(v) for v in used["ids"].values()) == used["labels"] == len(open(labels).readlines())
    evidence = {r.get("evidence") for r in ours["families"].values()}
    assert any("policy labels" in str(e) for e in evidence), evidence  # the labelled path is exercised
    for f in [*V.FAMILIES, "balanced"]:
        a = ours["balanced"] if f == "balanced" else ours["families"][f]
        b = theirs["balanced"] if f == "balanced" else theirs["families"][f]
        for key in COMPARED:
            if key in a or key in b:
                assert _close(a.get(key), b.get(key)), (f, key, a.get(key), b.get(key))
        if f != "balanced":
            assert a.get("evidence") == b.get("evidence") and (a.get("ppi") or {}).get("predictor") == \
                (b.get("ppi") or {}).get("predictor"), f


def _bad(tmp_path, rows, name="samples.jsonl") -> str:
    return _write(tmp_path / name, rows)


ROW = {"id": "a", "family": "dune", "prompt": "p1", "response": "r", "score": 0.5}


@pytest.mark.parametrize("samples, labels, needles", [
    ([{k: v for k, v in ROW.items() if k != "score"}], [{"id": "a", "label": 0.5}],
     ("samples.jsonl:1", "column 'score' is missing")),
    ([{**ROW, "family": "quartz"}], [{"id": "a", "label": 0.5}], ("samples.jsonl:1", "unknown family 'quartz'", "dune")),
    ([ROW, ROW], [{"id": "a", "label": 0.5}], ("samples.jsonl:2", "column 'id'", "duplicates row 1")),
    ([{**ROW, "score": float("nan")}], [{"id": "a", "label": 0.5}], ("samples.jsonl:1", "column 'score'", "finite")),
    ([ROW], [{"id": "zz", "label": 0.5}], ("labels.jsonl:1", "'zz' is not a row of the samples table")),
    ([ROW], [{"id": "a", "label": 9.0}], ("labels.jsonl:1", "column 'label'")),
])
def test_a_bad_table_is_one_line_naming_file_row_and_column_and_registers_nothing(tmp_path, samples, labels, needles):
    s, lab = _bad(tmp_path, samples), _bad(tmp_path, labels, "labels.jsonl")
    res = CliRunner().invoke(cli, ["certify-table", "--samples", s, "--labels", lab, "--register", "theirs",
                                   "--model-uri", str(tmp_path)])
    _fails(res, *needles)
    assert not mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert not mlflow.MlflowClient().search_model_versions("name = 'rlhf-policy'")


def test_a_csv_table_names_its_line_counting_the_header(tmp_path):
    path = tmp_path / "samples.csv"
    path.write_text("id,family,prompt,response,score\na,dune,p,r,0.1\nb,dune,p,r,inf\n")
    lab = _bad(tmp_path, [{"id": "a", "label": 0.5}], "labels.jsonl")
    _fails(CliRunner().invoke(cli, ["certify-table", "--samples", str(path), "--labels", lab, "--register", "x",
                                    "--model-uri", str(tmp_path)]), "samples.csv:3", "column 'score'")


def test_the_portable_form_needs_no_mlflow(tiny_world, tmp_path):
    """`python -m rlhf_mlflow.certify_table` writes the same report without importing mlflow."""
    world = WorldPaths.at(tiny_world)
    labels = _labels(world.policy, world, 20, tmp_path / "labels.jsonl")
    tables = export_tables(world.policy, world, labels, tmp_path)
    out = tmp_path / "report.json"
    code = ("import sys, runpy; sys.argv = ['x', " + ", ".join(repr(a) for a in [
        "--samples", tables["samples"], "--labels", tables["labels"], "--expert-set", tables["expert_set"],
        "--out", str(out)]) + "]\ntry:\n    runpy.run_module('rlhf_mlflow.certify_table', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\nassert 'mlflow' not in sys.modules, 'mlflow imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["kind"] == "table" and set(report["families"]) == set(V.FAMILIES)
    assert report == json.loads(json.dumps(table_report(tables)))


def test_a_certify_table_that_fails_after_registering_leaves_no_version(tiny_world, tmp_path, monkeypatch):
    """--register makes the version inside the run; a failure after it (here, writing the report) deletes
    it again: the run ends FAILED and the registry is as it was."""
    from rlhf_mlflow.steps import certify_table as CT
    world = WorldPaths.at(tiny_world)
    labels = _labels(world.policy, world, 20, tmp_path / "labels.jsonl")
    tables = export_tables(world.policy, world, labels, tmp_path)

    def broken(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(CT, "_log_report", broken)
    res = CliRunner().invoke(cli, ["certify-table", "--samples", tables["samples"], "--labels", tables["labels"],
                                   "--expert-set", tables["expert_set"], "--register", "theirs", "--model-uri",
                                   str(tmp_path)])
    assert res.exit_code != 0
    assert not mlflow.MlflowClient().search_model_versions("name = 'rlhf-policy'")
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert run.info.status == "FAILED"
