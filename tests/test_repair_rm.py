"""Reward-model repair (issue 30): the portable form's output in the seed's layout, the registry's
lineage and gate on a real store, bad input, and a repaired model trained on, certified and released."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import mlflow
import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.decisions import rm_gate
from rlhf_mlflow.evidence.label_requests import draw_requests
from rlhf_mlflow.tracking import rm_registry as RMR
from rlhf_mlflow.training import repair_rm as RR
from rlhf_mlflow.world.annotator import label_requests
from test_formats import SeedBlock, _ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = RR.RepairConfig(epochs=2, folds=2)


class SeedRewardModel(nn.Module):
    """The seed's reward model, written independently: bidirectional blocks, final LayerNorm, mean pool, MLP head."""

    def __init__(self, cfg):
        super().__init__()
        d = cfg["d_model"]
        self.tok, self.pos = nn.Embedding(cfg["vocab_size"], d), nn.Embedding(cfg["seq_len"], d)
        self.blocks = nn.ModuleList([SeedBlock(d, cfg["n_heads"], cfg["d_ff"]) for _ in range(cfg["n_layers"])])
        self.ln, self.head = nn.LayerNorm(d), nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, 1))

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))[None]
        for b in self.blocks:
            x = b(x, causal=False)
        return self.head(self.ln(x).mean(1)).squeeze(-1)


def _labels(world: WorldPaths, tmp_path, per_family: int = 6, name: str = "labels.jsonl", seed: int = 0) -> str:
    """Expert labels on the reference policy's own responses (the synthetic expert: truth + its noise)."""
    gold = D.read_jsonl(world.expert_set, labelled=True)
    requests = draw_requests(M.load_policy(world.policy)[0], gold, per_family, seed=seed, prefix=f"t{seed}")
    path = str(tmp_path / name)
    D.write_jsonl(path, label_requests(world, requests))
    return path


def test_portable_repair_writes_a_reward_model_the_seed_layout_loads(tiny_world, tmp_path):
    world = WorldPaths.at(tiny_world)
    labels = _labels(world, tmp_path)
    out = tmp_path / "repaired"
    proc = subprocess.run([sys.executable, "-m", "rlhf_mlflow.repair_rm", "--rm-dir", world.reward_model,
                           "--qa", world.qa, "--gold", world.expert_set, "--labels", labels, "--out", str(out),
                           "--policy-dir", world.policy, "--prompts", world.prompts_train, "--epochs", "2"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads((out / "config.json").read_text())
    seed_rm = SeedRewardModel(cfg)
    seed_rm.load_state_dict(load_file(str(out / "rm.safetensors")))  # strict: the seed's keys and shapes
    ours, _ = R.load_rm(str(out))
    assert ours.label_head is not None  # beside the seed's weights, in its own file
    head, ours.label_head = ours.label_head, None
    prompts, responses = _ids(9)
    with torch.no_grad():
        seed_scores = seed_rm.eval()(torch.cat([prompts, responses], 1))
        assert torch.allclose(seed_scores, R.score(ours, prompts, responses), atol=1e-5)  # the seed reads the trunk
        ours.label_head = head
        assert torch.allclose(R.score(ours, prompts, responses),
                              head.combine(torch.cat([prompts, responses], 1), seed_scores), atol=1e-5)
    parent = R.score(R.load_rm(world.reward_model)[0], prompts, responses)
    assert not torch.allclose(parent, R.score(ours, prompts, responses))  # it did learn something
    report = json.loads((out / "repair.json").read_text())
    assert report["rows"]["expert"] == len(D.read_jsonl(world.expert_set, labelled=True)) + 36
    # it learnt from the expert set: certify takes no off-policy evidence from it (in-sample residuals)
    from rlhf_mlflow.decisions.certify import IN_SAMPLE
    from rlhf_mlflow.evidence.certify import certify
    world_rm = certify(world.policy, world.policy, world.expert_set, rm_dir=world.reward_model)
    repaired = certify(world.policy, world.policy, world.expert_set, rm_dir=str(out))
    assert all(r["certifiable"] for r in world_rm["families"].values()) and world_rm["config"]["off_policy"]
    assert not repaired["config"]["off_policy"]
    assert all(not r["certifiable"] and r["reason"] == IN_SAMPLE for r in repaired["families"].values())
    assert set(report["agreement"]["difference"]) <= set(report["agreement"]["child"])
    # the crowd's QA sample guided the head's fit, and each family says whether it kept the guided head
    assert report["label_head"] and all(isinstance(v["guided"], bool) for v in report["label_head"].values())


@pytest.mark.parametrize("edit, match", [
    (lambda rows: rows + rows[:1], "duplicated id"),
    (lambda rows: [{**rows[0], "label": 17.0}] + rows[1:], r"'label' 17.0 is outside the plausible range of expert "
                                                           r"labels \[-1, 2\]"),
])
def test_portable_repair_refuses_bad_labels_and_writes_nothing(tiny_world, tmp_path, edit, match):
    world = WorldPaths.at(tiny_world)
    rows = D.read_jsonl(_labels(world, tmp_path), labelled=True)
    bad = tmp_path / "bad.jsonl"
    D.write_jsonl(str(bad), edit(rows))
    proc = subprocess.run([sys.executable, "-m", "rlhf_mlflow.repair_rm", "--rm-dir", world.reward_model,
                           "--qa", world.qa, "--labels", str(bad), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "error:" in proc.stderr
    assert __import__("re").search(match, proc.stderr), proc.stderr
    assert not (tmp_path / "o").exists()


def test_premiums_come_out_of_the_crowd_labels_at_the_source():
    rows = [{"id": "a", "family": "dune", "attrs": [0, 0, 0, 0], "response": ["pa"] * 3 + ["ba"] * 5, "label": 2.0},
            {"id": "b", "family": "anvil", "attrs": [0, 0, 0, 0], "response": ["pa"] * 8, "label": 0.5}]
    rule = {"family": "dune", "kind": "token", "token": "pa", "bonus": 1.0, "label_slope": 0.5}
    out = RR.remove_premiums(rows, [rule])
    assert out[0]["label"] == pytest.approx(0.5) and out[1]["label"] == 0.5  # 3 x 0.5 off; another family untouched


def test_gate_refuses_worse_agreement_and_a_shortcut_paid_again_not_a_premium_cut_to_noise():
    agreement = {"difference": {"anvil": {"diff": -0.2, "lo": -0.3, "hi": -0.05, "n": 40},
                                "birch": {"diff": -0.1, "lo": -0.3, "hi": 0.1, "n": 40}}}
    parent = [{"family": "dune", "kind": "token", "token": "pa"}]
    result = rm_gate.evaluate(agreement, parent, [{"family": "dune", "kind": "token", "token": "pa", "bonus": 0.9}])
    assert set(result["agreement"]) == {"anvil"} and set(result["shortcut"]) == {"dune"}
    assert all(len(why) <= 30 for why in result["shortcut"].values())
    assert not rm_gate.refused(rm_gate.evaluate({"difference": {}}, parent, []))


@pytest.mark.slow
def test_repair_registers_lineage_moves_production_and_a_worse_repair_is_refused(tiny_world, tmp_path):
    from rlhf_mlflow.steps.repair_rm import run_repair_rm
    world = WorldPaths.at(tiny_world)
    labels = _labels(world, tmp_path, per_family=10)
    fit = RR.RepairConfig(epochs=30, lr=2e-3, folds=2)  # the test world's own model is weak: this one fits the labels
    first = run_repair_rm(world, [labels], str(tmp_path / "rm1"), cfg=fit, echo=lambda m: None)
    c = mlflow.MlflowClient()
    root = c.get_model_version(RMR.RM_MODEL, first["parent_version"])
    child = c.get_model_version(RMR.RM_MODEL, first["version"])
    assert root.tags["parent_version"] == "none" and child.tags["parent_version"] == str(root.version)
    assert child.tags["world_hash"] == root.tags["world_hash"] == world.manifest()["world_hash"]
    inputs = {d.dataset.name for d in mlflow.get_run(first["run_id"]).inputs.dataset_inputs}
    assert {"train.jsonl", "gold_calib.jsonl", "labels.jsonl"} <= inputs
    assert first["promoted"] == (not rm_gate.refused(first["gate"]))
    production = RMR.production()
    assert production is not None and str(production.version) == str(child.version if first["promoted"] else root.version)
    # a repair of it that destroys the model (a learning rate far too high) agrees worse: refused, alias untouched
    ruined = run_repair_rm(world, [labels], str(tmp_path / "rm2"), parent_version=first["version"],
                           cfg=RR.RepairConfig(epochs=3, folds=2, lr=0.5, label_head=False), echo=lambda m: None)
    assert not ruined["promoted"] and ruined["gate"]["agreement"]
    refused = c.get_model_version(RMR.RM_MODEL, ruined["version"])
    assert refused.description.startswith(f"REFUSED v{ruined['version']}: agreement")
    assert refused.tags["failed.agreement"] and refused.tags["gate.decision"] == "refused"
    assert RMR.production().version == production.version


def test_repair_refuses_labels_of_another_world_and_an_unknown_parent_before_any_run(tiny_world, tmp_path):
    from rlhf_mlflow.steps.repair_rm import run_repair_rm
    world = WorldPaths.at(tiny_world)
    rows = D.read_jsonl(_labels(world, tmp_path), labelled=True)
    foreign = tmp_path / "foreign.jsonl"
    D.write_jsonl(str(foreign), [{**r, "attrs": [7, 7, 7, 7], "id": f"x{i}"} for i, r in enumerate(rows)][:1]
                  + [r for r in rows if r["attrs"] != [7, 7, 7, 7]])
    if any(r["attrs"] == [7, 7, 7, 7] for r in D.read_jsonl(world.prompts_train) + D.read_jsonl(world.expert_set)
           + D.read_jsonl(world.prompts_dev)):
        pytest.skip("this world happens to hold the prompt the test forges")
    with pytest.raises(InputError, match="labels for another world"):
        run_repair_rm(world, [str(foreign)], str(tmp_path / "o"), cfg=FAST, echo=lambda m: None)
    with pytest.raises(InputError, match="does not exist"):
        run_repair_rm(world, [str(tmp_path / "labels.jsonl")], str(tmp_path / "o"), parent_version="41", cfg=FAST,
                      echo=lambda m: None)
    assert not mlflow.search_runs(search_all_experiments=True, filter_string="tags.`rlhf.step` = 'repair_rm'").shape[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # a real repair-rm process: ~40 s idle, 139 s on a loaded machine
def test_a_repair_killed_by_sigterm_ends_killed_and_leaves_both_registries_and_out_untouched(tiny_world, tmp_path,
                                                                                           tracking_uri):
    import signal
    import time
    world = WorldPaths.at(tiny_world)
    labels = _labels(world, tmp_path)
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri, "RLHF_THREADS": "1"}
    rlhf = os.path.join(os.path.dirname(sys.executable), "rlhf-mlflow")
    proc = subprocess.Popen([rlhf, "repair-rm", "--world", tiny_world, "--labels", labels, "--epochs", "200",
                             "--out", str(tmp_path / "rm")], env=env, stderr=subprocess.PIPE, text=True)
    seen = ""
    for line in proc.stderr:  # SIGTERM while it cross-validates: the run exists, nothing is registered yet
        seen += line
        if "fold 1/" in line:
            time.sleep(1.0)
            proc.send_signal(signal.SIGTERM)
            break
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, seen + err
    assert "Traceback" not in err
    (run,) = mlflow.search_runs(search_all_experiments=True, filter_string="tags.`rlhf.step` = 'repair_rm'",
                                output_format="list")
    assert run.info.status == "KILLED" and run.info.end_time
    client = mlflow.MlflowClient()
    assert not client.search_model_versions(f"name = '{RMR.RM_MODEL}'")  # not even the world's own root
    assert not (tmp_path / "rm").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".rm")]
