"""The label head (core/label_head.py, core/label_head_fit.py): the lasso it is fitted by, what it
recovers from labels, and how it travels beside a seed-format reward model."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from rlhf_mlflow.core import label_head as LH
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core import label_head_fit as HF
from rlhf_mlflow.world.truth import Truth


def _rows(truth: Truth, n_per_family: int, seed: int, p_correct: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """[prompt ; response] ids and true quality: each position correct with p_correct, else a uniform token."""
    rng = np.random.default_rng(seed)
    fam = np.repeat(np.arange(len(V.FAMILIES)), n_per_family)
    attrs = rng.integers(0, V.N_VAL, size=(len(fam), V.N_ATTR))
    target = truth.targets(fam, attrs)
    tok = np.where(rng.random(target.shape) < p_correct, target, rng.integers(0, V.N_CONTENT, size=target.shape))
    prompts = torch.tensor([[V.FAM_ID[V.FAMILIES[f]]] + [V.VAL_ID[a] for a in row] + [V.SEP] for f, row in zip(fam, attrs)])
    ids = torch.cat([prompts, torch.from_numpy(tok).long() + V.CONTENT_LO], 1)
    return ids, torch.from_numpy((tok == target).mean(1)).float()


def test_the_lasso_reaches_scikit_learns_objective():
    sklearn = pytest.importorskip("sklearn.linear_model")
    truth = Truth.generate(np.random.default_rng(3))
    ids, q = _rows(truth, 60, seed=4)
    y = q + 0.03 * torch.randn(len(q), generator=torch.Generator().manual_seed(0))
    fam, flat = LH.indicator_index(ids)
    w, b = HF.lasso(HF.Blocks(flat, fam, y, len(V.FAMILIES)), alpha=2e-4)
    for f in (0, 3):
        m = fam == f
        X = np.zeros((int(m.sum()), LH.PER_FAMILY))
        for j, cols in enumerate(flat[m].numpy()):
            X[j, cols] = 1.0
        ref = sklearn.Lasso(alpha=2e-4, max_iter=100_000, tol=1e-9).fit(X, y[m].numpy())

        def objective(coef, icpt):
            return 0.5 * np.mean((y[m].numpy() - X @ coef - icpt) ** 2) + 2e-4 * np.abs(coef).sum()
        ours, theirs = objective(w[f].double().numpy(), float(b[f])), objective(ref.coef_, ref.intercept_)
        assert ours == pytest.approx(theirs, rel=1e-4)
        assert np.abs(X @ w[f].double().numpy() + float(b[f]) - ref.predict(X)).max() < 1e-3


def test_the_head_recovers_a_planted_table_and_drops_a_trunk_that_knows_nothing():
    truth = Truth.generate(np.random.default_rng(0))
    ids, q = _rows(truth, 400, seed=1)  # 267 to fit per fold: past where the lasso finds the table (~200)
    y = q + 0.03 * torch.randn(len(q), generator=torch.Generator().manual_seed(1))
    noise_trunk = torch.randn(len(y), generator=torch.Generator().manual_seed(2))
    folds = torch.arange(len(y)) % 3
    fit = HF.fit_head(ids, y, noise_trunk, folds)
    fam = LH.indicator_index(ids)[0]
    for f in range(len(V.FAMILIES)):
        m = fam == f
        assert np.corrcoef(fit.oof[m].numpy(), q[m].numpy())[0, 1] > 0.9  # out of fold
        assert fit.report[V.FAMILIES[f]]["trunk_weight"] < 0.05
    assert not fit.head.uses_trunk or float(fit.head.neural.abs().max()) < 0.05
    fresh, q2 = _rows(truth, 200, seed=9, p_correct=0.6)  # a policy that is right more often
    scores = fit.head.combine(fresh, torch.zeros(len(fresh)))
    assert np.corrcoef(scores.numpy(), q2.numpy())[0, 1] > 0.9


def _fresh_corr(head: LH.LabelHead, truth: Truth) -> float:
    """How well a head ranks the responses of a policy right more often than the labelled one."""
    fresh, q = _rows(truth, 300, seed=9, p_correct=0.6)
    return float(np.corrcoef(head.combine(fresh, torch.zeros(len(fresh))).numpy(), q.numpy())[0, 1])


def test_a_guide_that_agrees_with_the_experts_finds_the_table_from_fewer_labels():
    truth = Truth.generate(np.random.default_rng(0))
    ids, q = _rows(truth, 100, seed=1)  # below where the lasso alone finds the table
    y = q + 0.03 * torch.randn(len(q), generator=torch.Generator().manual_seed(1))
    g_ids, g_q = _rows(truth, 200, seed=11)  # the crowd's: three times the experts' noise
    guide = HF.Guide(g_ids, g_q + 0.09 * torch.randn(len(g_q), generator=torch.Generator().manual_seed(3)))
    trunk, folds = torch.randn(len(y), generator=torch.Generator().manual_seed(2)), torch.arange(len(y)) % 3
    lasso = HF.fit_head(ids, y, trunk, folds, fit="lasso")
    guided = HF.fit_head(ids, y, trunk, folds, guide=guide)
    assert all(guided.report[f]["guided"] for f in V.FAMILIES)
    assert _fresh_corr(lasso.head, truth) < 0.5 < 0.8 < _fresh_corr(guided.head, truth)
    fam = LH.indicator_index(ids)[0]
    for f in range(len(V.FAMILIES)):  # the out-of-fold scores are the expert rows', and better
        m = fam == f
        assert HF._r(guided.oof[m], q[m]) > HF._r(lasso.oof[m], q[m])


def test_a_guide_the_experts_do_not_agree_with_is_left_out():
    truth = Truth.generate(np.random.default_rng(1))
    ids, q = _rows(truth, 100, seed=2)
    y = q + 0.03 * torch.randn(len(q), generator=torch.Generator().manual_seed(1))
    g_ids, _ = _rows(truth, 100, seed=12)
    noise = HF.Guide(g_ids, 0.2 * torch.randn(len(g_ids), generator=torch.Generator().manual_seed(5)))
    trunk, folds = torch.randn(len(y), generator=torch.Generator().manual_seed(2)), torch.arange(len(y)) % 3
    alone = HF.fit_head(ids, y, trunk, folds)
    with_noise = HF.fit_head(ids, y, trunk, folds, guide=noise)
    assert not any(with_noise.report[f]["guided"] for f in V.FAMILIES)
    assert torch.equal(with_noise.head.coef, alone.head.coef) and torch.equal(with_noise.oof, alone.oof)


def test_a_head_too_few_labels_leaves_the_family_to_the_trunk():
    truth = Truth.generate(np.random.default_rng(5))
    ids, q = _rows(truth, 3, seed=6)
    fit = HF.fit_head(ids, q, q.clone(), torch.arange(len(q)) % 2)
    assert torch.equal(fit.head.neural, torch.ones(len(V.FAMILIES)))
    assert float(fit.head.coef.abs().sum()) == 0.0


def _head(seed: int, neural: float) -> LH.LabelHead:
    g = torch.Generator().manual_seed(seed)
    return LH.LabelHead(torch.randn(LH.SHAPE, generator=g) * 0.01, torch.full((len(V.FAMILIES),), neural),
                        torch.randn(len(V.FAMILIES), generator=g))


def test_a_model_with_a_head_saves_beside_the_seed_weights_and_loads_back(tmp_path):
    torch.manual_seed(0)
    rm, cfg = R.RewardModel(R.default_config()).eval(), R.default_config()
    ids, _ = _rows(Truth.generate(np.random.default_rng(1)), 5, seed=2)
    trunk = R.score(rm, ids[:, :V.PROMPT_LEN], ids[:, V.PROMPT_LEN:])
    rm.label_head = _head(0, neural=0.5)
    R.save_rm(rm, cfg, str(tmp_path / "rm"))
    assert set(load_file(str(tmp_path / "rm" / R.WEIGHTS))) == set(R.RewardModel(cfg).state_dict())  # seed keys only
    back, _ = R.load_rm(str(tmp_path / "rm"))
    both = R.score(back, ids[:, :V.PROMPT_LEN], ids[:, V.PROMPT_LEN:])
    assert torch.allclose(both, rm.label_head.combine(ids, trunk), atol=1e-5)
    assert not torch.allclose(both, trunk)
    back.label_head = _head(0, neural=0.0)  # the head alone: the trunk does not run
    alone = R.score(back, ids[:, :V.PROMPT_LEN], ids[:, V.PROMPT_LEN:])
    assert torch.allclose(alone, back.label_head.combine(ids, None))
    with torch.no_grad():
        for p in back.parameters():
            p.add_(1.0)
    assert torch.equal(R.score(back, ids[:, :V.PROMPT_LEN], ids[:, V.PROMPT_LEN:]), alone)


def test_a_damaged_or_misshapen_head_is_a_clear_error(tmp_path):
    rm, cfg = R.RewardModel(R.default_config()), R.default_config()
    R.save_rm(rm, cfg, str(tmp_path / "rm"))
    (tmp_path / "rm" / LH.FILE).write_bytes(b"not safetensors")
    with pytest.raises(InputError, match="label_head.safetensors: not a readable safetensors file"):
        R.load_rm(str(tmp_path / "rm"))
    save_file({"coef": torch.zeros(2, 3), "neural": torch.zeros(6), "bias": torch.zeros(6)}, str(tmp_path / "rm" / LH.FILE))
    with pytest.raises(InputError, match="expected"):
        R.load_rm(str(tmp_path / "rm"))
    save_file({"coef": torch.full(LH.SHAPE, float("nan")), "neural": torch.zeros(6), "bias": torch.zeros(6)},
              str(tmp_path / "rm" / LH.FILE))
    with pytest.raises(InputError, match="non-finite"):
        R.load_rm(str(tmp_path / "rm"))


def test_an_ensemble_refuses_a_member_with_a_head_it_would_not_score():
    from rlhf_mlflow.core.reward_ensemble import Stacked
    members = [R.RewardModel(R.default_config()) for _ in range(2)]
    members[1].label_head = _head(1, neural=1.0)
    with pytest.raises(InputError, match="label head"):
        Stacked(members)


def test_an_ensemble_sharing_a_head_scores_each_member_as_that_member_with_the_head(tmp_path):
    from rlhf_mlflow.core import reward_ensemble as RE
    members = []
    for seed in range(3):
        torch.manual_seed(seed)
        members.append(R.RewardModel(R.default_config()).eval())
    head = _head(2, neural=0.7)
    RE.save_ensemble(members, R.default_config(), str(tmp_path / "ens"), head=head)
    stacked = RE.Stacked.load(str(tmp_path / "ens"))
    assert stacked.head is not None
    ids, _ = _rows(Truth.generate(np.random.default_rng(4)), 3, seed=5)
    prompts, responses = ids[:, :V.PROMPT_LEN], ids[:, V.PROMPT_LEN:]
    want = []
    for m in members:
        m.label_head = head
        want.append(R.score(m, prompts, responses))
    got = stacked.score(prompts, responses, batch=5)
    assert torch.allclose(got, torch.stack(want), atol=1e-5)
    for m in members:
        m.label_head = None
    trunks = RE.Stacked(members).score(prompts, responses)
    assert torch.allclose(got.std(0), 0.7 * trunks.std(0), atol=1e-5)  # the spread is the head's share of the trunks'
