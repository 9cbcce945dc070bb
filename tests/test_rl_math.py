"""The maths of the RL step against hand-computed numbers."""
import math

import pytest
import torch

from rlhf_mlflow.training import rl_math


def test_kl_k1_sums_log_ratios_per_sequence():
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]])
    ref = torch.tensor([[-1.5, -1.0], [-0.5, -0.5]])
    assert rl_math.kl_k1(lp, ref).tolist() == pytest.approx([0.5 - 1.0, 0.0])


def test_kl_k3_is_non_negative_and_matches_the_formula():
    lp = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    r = 0.25 / 0.5
    assert float(rl_math.kl_k3(lp, ref)) == pytest.approx(r - 1 - math.log(r))
    assert float(rl_math.kl_k3(ref, lp)) >= 0


def test_group_advantages_subtract_each_prompts_mean():
    shaped = torch.tensor([1.0, 3.0, 10.0, 20.0])
    assert rl_math.group_advantages(shaped, 2).tolist() == [-1.0, 1.0, -5.0, 5.0]


def test_shaped_rewards_and_loss():
    shaped = rl_math.shaped_rewards(torch.tensor([1.0, 2.0]), torch.tensor([2.0, 0.0]), 0.1)
    assert shaped.tolist() == pytest.approx([0.8, 2.0])
    seq_lp = torch.tensor([-3.0, -1.0], requires_grad=True)
    loss = rl_math.policy_gradient_loss(torch.tensor([-0.5, 0.5]), seq_lp)
    assert float(loss.detach()) == pytest.approx(-((-0.5 * -3.0) + (0.5 * -1.0)) / 2)
    loss.backward()
    assert seq_lp.grad.tolist() == pytest.approx([0.25, -0.25])
