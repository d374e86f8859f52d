"""Advantage estimators against hand-worked examples and naive per-sequence loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlflow.algos import advantages as adv_module
from rlflow.algos import (
    compute_advantages,
    discounted_returns,
    gae_advantages,
    get_adv_estimator,
    grpo_advantages,
    list_adv_estimators,
    register_adv_estimator,
    reinforce_plus_plus_advantages,
    remax_advantages,
    rloo_advantages,
)


def naive_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """Textbook GAE over one sequence of valid tokens, value 0 after the end."""
    advs = [0.0] * len(rewards)
    running = 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
        advs[t] = running
    return advs, [a + v for a, v in zip(advs, values)]


def test_gae_matches_hand_computed_example():
    # Row 0: three response tokens then padding; row 1: two tokens.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 0.2, 0.4, 9.0], [1.0, 0.5, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv, ret = gae_advantages(rewards, mask, values, gamma=0.9, lam=0.8, whiten=False)
    # Row 0: d2 = 1 - 0.4 = 0.6; d1 = 0.9*0.4 - 0.2 = 0.16, A1 = 0.16 + 0.72*0.6 = 0.592;
    #        d0 = 0.9*0.2 - 0.5 = -0.32, A0 = -0.32 + 0.72*0.592 = 0.10624.
    # Row 1: d1 = 2 - 0.5 = 1.5; d0 = 0.9*0.5 - 1 = -0.55, A0 = -0.55 + 0.72*1.5 = 0.53.
    expected_adv = torch.tensor([[0.10624, 0.592, 0.6, 0.0], [0.53, 1.5, 0.0, 0.0]])
    expected_ret = torch.tensor([[0.60624, 0.792, 1.0, 0.0], [1.53, 2.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected_adv)
    torch.testing.assert_close(ret, expected_ret)


def test_gae_equals_naive_loop_on_ragged_masks_and_whitens():
    gen = torch.Generator().manual_seed(0)
    batch, length = 6, 9
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=gen) < 0.7).long()  # holes anywhere, as masks allow
    mask[0] = 0
    mask[0, 0] = 1
    adv, ret = gae_advantages(rewards, mask, values, gamma=0.97, lam=0.9, whiten=False)
    for row in range(batch):
        valid = mask[row].nonzero().flatten().tolist()
        want_adv, want_ret = naive_gae(rewards[row, valid].tolist(), values[row, valid].tolist(), 0.97, 0.9)
        torch.testing.assert_close(adv[row, valid], torch.tensor(want_adv, dtype=torch.float64))
        torch.testing.assert_close(ret[row, valid], torch.tensor(want_ret, dtype=torch.float64))
    assert adv[mask == 0].abs().max() == 0 and ret[mask == 0].abs().max() == 0
    whitened, _ = gae_advantages(rewards, mask, values, gamma=0.97, lam=0.9)
    selected = whitened[mask.bool()]
    assert abs(selected.mean().item()) < 1e-9 and abs(selected.std().item() - 1.0) < 1e-6


def test_grpo_with_and_without_std_groups_by_uid():
    scores = [1.0, 0.0, 0.0, 2.0, 4.0, 7.0]
    rewards = torch.zeros(6, 3)
    rewards[:, 1] = torch.tensor(scores)  # outcome reward on the last real token
    mask = torch.tensor([[1, 1, 0]] * 6)
    index = np.array(["a", "a", "a", "b", "b", "c"], dtype=object)
    adv, ret = grpo_advantages(rewards, mask, index, norm_by_std=True, eps=0.0)
    # group a: mean 1/3, unbiased std sqrt(1/3); group b: mean 3, std sqrt(2); group c: singleton -> 0.
    std_a, std_b = math.sqrt(1 / 3), math.sqrt(2)
    expected = torch.tensor([(2 / 3) / std_a, (-1 / 3) / std_a, (-1 / 3) / std_a, -1 / std_b, 1 / std_b, 0.0])
    torch.testing.assert_close(adv[:, 0], expected)
    torch.testing.assert_close(adv, expected.unsqueeze(-1) * mask)  # broadcast over the mask
    torch.testing.assert_close(ret, adv)
    plain, _ = grpo_advantages(rewards, mask, index, norm_by_std=False)
    torch.testing.assert_close(plain[:, 0], torch.tensor([2 / 3, -1 / 3, -1 / 3, -1.0, 1.0, 0.0]))
    # Equal rewards inside a group give 0, not NaN.
    same, _ = grpo_advantages(torch.ones(2, 1), torch.ones(2, 1), torch.tensor([5, 5]))
    assert torch.equal(same, torch.zeros(2, 1))


def test_rloo_leave_one_out_baseline():
    rewards = torch.tensor([[3.0], [1.0], [2.0], [0.0], [4.0]])
    adv, _ = rloo_advantages(rewards, torch.ones(5, 1), index=[0, 0, 0, 1, 1])
    # group 0: 3 - (1+2)/2 = 1.5, 1 - (3+2)/2 = -1.5, 2 - (3+1)/2 = 0; group 1: 0 - 4, 4 - 0.
    torch.testing.assert_close(adv.squeeze(-1), torch.tensor([1.5, -1.5, 0.0, -4.0, 4.0]))
    with pytest.raises(ValueError, match="group 7 has 1 response"):
        rloo_advantages(rewards[:3], torch.ones(3, 1), index=[0, 0, 7])


def test_remax_subtracts_greedy_baseline_from_return_to_go():
    rewards = torch.tensor([[0.0, 0.5, 1.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv, ret = remax_advantages(rewards, mask, baseline_rewards=torch.tensor([1.0, 3.0]))
    torch.testing.assert_close(ret, torch.tensor([[1.5, 1.5, 1.0], [2.0, 0.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5, 0.0], [-1.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="baseline_rewards"):
        remax_advantages(rewards, mask, baseline_rewards=torch.zeros(3))


def test_reinforce_plus_plus_discounts_then_whitens_batch_wide():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    # returns: row 0: 0.25, 0.5, 1; row 1: 1.5, 3.
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0], [1.5, 3.0, 0.0]]))
    selected = torch.tensor([0.25, 0.5, 1.0, 1.5, 3.0])
    whitened = (selected - selected.mean()) / selected.std()  # unbiased std, as masked_whiten
    torch.testing.assert_close(adv[mask.bool()], whitened, atol=1e-5, rtol=1e-5)
    assert adv[0, 2] != 0 and adv[1, 2] == 0


def test_discounted_returns_skips_masked_positions():
    returns = discounted_returns(torch.tensor([[1.0, 5.0, 2.0]]), torch.tensor([[1, 0, 1]]), gamma=0.5)
    torch.testing.assert_close(returns, torch.tensor([[2.0, 0.0, 2.0]]))  # 1 + 0.5 * 2; the hole is skipped


def test_registry_refuses_duplicates_and_lists_names(monkeypatch):
    monkeypatch.setattr(adv_module, "_ADV_ESTIMATORS", dict(adv_module._ADV_ESTIMATORS))
    assert {"gae", "grpo", "rloo", "remax", "reinforce_plus_plus"} <= set(list_adv_estimators())
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        register_adv_estimator("grpo")(grpo_advantages)
    with pytest.raises(KeyError, match="registered: .*'gae'"):
        get_adv_estimator("ppo-magic")

    @register_adv_estimator("constant")
    def constant(token_level_rewards, response_mask, offset: float):
        out = (token_level_rewards * 0 + offset) * response_mask
        return out, out

    out, _ = compute_advantages(
        "constant", token_level_rewards=torch.zeros(1, 2), response_mask=torch.ones(1, 2), offset=2.0, values=None
    )
    assert torch.equal(out, torch.full((1, 2), 2.0))


def test_compute_advantages_passes_only_declared_inputs():
    rewards, mask, values = torch.tensor([[0.0, 1.0]]), torch.ones(1, 2), torch.tensor([[0.5, 0.5]])
    inputs = dict(token_level_rewards=rewards, response_mask=mask, values=values, index=[0], gamma=1.0, lam=1.0)
    adv, _ = compute_advantages("gae", whiten=False, **inputs)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5]]))
    with pytest.raises(TypeError, match="values"):
        compute_advantages("gae", token_level_rewards=rewards, response_mask=mask)


def test_shape_errors_name_the_tensor():
    with pytest.raises(ValueError, match="values"):
        gae_advantages(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="index has 1 entries"):
        grpo_advantages(torch.zeros(2, 3), torch.ones(2, 3), index=[0])
