"""Reward-model ensembles (issue 30): one stacked forward scores like each member's own, the directory
format refuses what it cannot trust, members disagree, and train_rl pays mean - k x spread."""
from __future__ import annotations

import json

import pytest
import torch

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import reward_ensemble as RE
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.training import repair_rm as RR
from rlhf_mlflow.training.rl_config import RLConfig
from rlhf_mlflow.training.rm_ensemble import train_members
from rlhf_mlflow.training.train_rl import train_rl
from test_formats import _ids


def _members(k: int = 3) -> list[R.RewardModel]:
    out = []
    for seed in range(k):
        torch.manual_seed(seed)
        out.append(R.RewardModel(R.default_config()).eval())
    return out


def test_one_stacked_forward_scores_as_each_member_alone():
    members = _members()
    prompts, responses = _ids(11)
    want = torch.stack([R.score(m, prompts, responses) for m in members])
    got = RE.Stacked(members).score(prompts, responses, batch=4)  # three chunks, the last one short
    assert got.shape == (3, 11)
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got[0], got[1])


def test_penalised_is_mean_minus_k_spread():
    scores = torch.tensor([[1.0, 0.0], [3.0, 0.0]])
    assert torch.allclose(RE.penalised(scores, 0.0), torch.tensor([2.0, 0.0]))
    assert torch.allclose(RE.penalised(scores, 1.0), torch.tensor([2.0 - 2 ** 0.5, 0.0]))


def test_ensemble_directory_round_trips_and_bad_manifests_are_named(tmp_path):
    members = _members(2)
    RE.save_ensemble(members, R.default_config(), str(tmp_path / "ens"), {"recipe": "test"})
    assert RE.is_ensemble(str(tmp_path / "ens"))
    prompts, responses = _ids(5)
    assert torch.allclose(RE.Stacked.load(str(tmp_path / "ens")).score(prompts, responses)[1],
                          R.score(members[1], prompts, responses), atol=1e-5)
    with pytest.raises(InputError, match="at least 2 members"):
        RE.save_ensemble(members[:1], R.default_config(), str(tmp_path / "one"))
    assert not (tmp_path / "one").exists()
    (tmp_path / "ens" / RE.MANIFEST).write_text(json.dumps({"members": ["member-0", "../elsewhere"]}))
    with pytest.raises(InputError, match="outside the ensemble directory"):
        RE.Stacked.load(str(tmp_path / "ens"))
    with pytest.raises(InputError, match="no ensemble.json"):
        RE.Stacked.load(str(tmp_path))


def test_members_trained_on_bootstraps_with_new_heads_disagree(tiny_world):
    world = WorldPaths.at(tiny_world)
    crowd = D.read_jsonl(world.qa, labelled=True)
    cfg = RR.RepairConfig(epochs=1, folds=2)
    data = RR.RepairData.build(world.reward_model, crowd, D.read_jsonl(world.expert_set, labelled=True), cfg)
    members = train_members(world.reward_model, data, 2, cfg)
    prompts, responses = D.prompts_tensor(crowd[:64]), D.responses_tensor(crowd[:64])
    scores = RE.Stacked(members).score(prompts, responses)
    assert float(scores.std(0).mean()) > 1e-3
    # each still learned the labels: its scores track them
    labels = D.labels_tensor(crowd[:64])
    assert all(float(torch.corrcoef(torch.stack([s, labels]))[0, 1]) > 0 for s in scores)


def test_train_rl_pays_the_penalised_ensemble_and_logs_its_spread_per_family(tiny_world, tmp_path):
    world = WorldPaths.at(tiny_world)
    members = [R.load_rm(world.reward_model)[0]] + _members(1)
    RE.save_ensemble(members, R.load_rm(world.reward_model)[1], str(tmp_path / "ens"))
    base = dict(steps=2, batch_prompts=6, samples_per_prompt=4, log_every=1, reward_ensemble=str(tmp_path / "ens"))
    mean = train_rl(RLConfig(**base).resolved(tiny_world)).history[0][1]
    cautious = train_rl(RLConfig(**base, ensemble_penalty=2.0).resolved(tiny_world)).history[0][1]
    assert mean["spread/balanced"] > 0 and any(k.startswith("spread/") and k != "spread/balanced" for k in mean)
    # the same first batch (same seed): the penalty takes 2 x spread off the members' mean
    assert cautious["proxy/balanced"] == pytest.approx(mean["proxy/balanced"] - 2 * mean["spread/balanced"], abs=1e-4)
    plain = train_rl(RLConfig(**{k: v for k, v in base.items() if k != "reward_ensemble"}).resolved(tiny_world))
    assert "spread/balanced" not in plain.history[0][1]


def test_a_penalty_without_an_ensemble_is_refused():
    with pytest.raises(InputError, match="ensemble_penalty=1.0 needs reward_ensemble"):
        RLConfig(ensemble_penalty=1.0)
    with pytest.raises(InputError, match="ensemble must be 0"):
        RR.RepairConfig(ensemble=1)
