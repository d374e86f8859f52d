"""The comparison arithmetic of benchmarks/bench_update_parity.py, on hand-made step records.

TRL is not installed here: the records stand for what rlflow's recorder and
``benchmarks/trl_update.py`` write, and the figures are checked against numpy.
"""

from __future__ import annotations

import copy
import doctest

import numpy as np
import pytest
import torch

from benchmarks import bench_update_parity, trl_update
from benchmarks.bench_update_parity import (
    RLFLOW_ADVANTAGE_EPS,
    TRL_ADVANTAGE_EPS,
    compare_step,
    cosine,
    relative_difference,
    replay_of,
    update_difference,
)

PAD, EOS = 0, 2


def _batch() -> dict[str, torch.Tensor]:
    """Two rows of one prompt (left-padded to 3 columns), responses of up to 3 tokens."""
    input_ids = torch.tensor([[0, 7, 8, 5, 6, EOS], [PAD, 7, 8, 9, PAD, PAD]])
    attention_mask = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]])
    response_mask = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 0, 0]])
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "rewards": torch.tensor([1.0, 0.0]),
    }


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(3, 4, generator=g), "b.bias": torch.randn(5, generator=g)}


def _records() -> tuple[dict, dict]:
    """An rlflow step and the TRL step that agrees with it (up to the gradients and weights drawn here)."""
    before, grads = {k: 0.01 * v for k, v in _tensors(0).items()}, _tensors(1)
    rl = {
        "batch": _batch(),
        "advantages": torch.tensor([[0.0, 0.0, 0.0, 0.7, 0.7, 0.7], [0.0, 0.0, 0.0, -0.7, 0.0, 0.0]]),
        "grads": grads,
        "before": before,
        "after": {k: v - 1e-4 * torch.sign(grads[k]) for k, v in before.items()},
        "metrics": {"pg_loss": -0.08, "grad_norm": 3.4},
    }
    trl = {
        "prompt_ids": [[7, 8], [7, 8]],
        "completion_ids": torch.tensor([[5, 6, EOS], [9, PAD, PAD]]),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 0, 0]]),
        "rewards": torch.tensor([1.0, 0.0]),
        "advantages": torch.tensor([0.7, -0.6]),
        "grads": {k: 1.01 * v for k, v in grads.items()},
        "before": {k: v.clone() for k, v in before.items()},
        "after": {k: v - 2e-4 * torch.sign(grads[k]) for k, v in before.items()},
        "loss": -0.081,
        "grad_norm": 3.5,
    }
    return rl, trl


def _flat(tensors: dict[str, torch.Tensor]) -> np.ndarray:
    return np.concatenate([tensors[k].double().numpy().ravel() for k in sorted(tensors)])


def test_agreeing_steps_compare_as_identical_and_the_figures_are_numpys():
    rl, trl = _records()
    figures = compare_step(rl, trl, n_samples=2)
    assert figures["prompt_ids_identical"] and figures["loss_tokens_identical"] and figures["rewards_identical"]
    assert figures["rows"] == 2 and figures["reward_mean"] == 0.5
    assert figures["advantage_max_abs_diff"] == pytest.approx(0.1, rel=1e-3)  # row 2: -0.7 against -0.6
    # TRL's -0.6 at rlflow's epsilon: the group's rewards 1, 0 have the unbiased std 2 ** -0.5
    std = 2**-0.5
    same_eps = abs(-0.7 + 0.6 * (std + TRL_ADVANTAGE_EPS) / (std + RLFLOW_ADVANTAGE_EPS))
    assert figures["advantage_max_abs_diff_same_eps"] == pytest.approx(same_eps, rel=1e-3)
    g_rl, g_trl = _flat(rl["grads"]), _flat(trl["grads"])
    assert figures["grad_rel_diff"] == pytest.approx(np.linalg.norm(g_rl - g_trl) / np.linalg.norm(g_trl), rel=1e-3)
    assert figures["grad_rel_diff"] == pytest.approx(0.01 / 1.01, rel=1e-3)
    assert figures["grad_cosine"] == pytest.approx(1.0)  # the same direction, scaled
    assert figures["clipped_grad_norm"]["trl"] == pytest.approx(1.01 * np.linalg.norm(g_rl), rel=1e-5)
    assert figures["loss"] == {"rlflow": -0.08, "trl": -0.081}
    assert figures["grad_norm"] == {"rlflow": 3.4, "trl": 3.5}
    # updates of 1e-4 and 2e-4 per weight: they differ by 1e-4 at most, against a step of 2e-4
    assert figures["update_max_abs_diff"] == pytest.approx(1e-4, rel=1e-3)
    assert figures["update_max_abs"] == pytest.approx(2e-4, rel=1e-3)
    assert figures["update_rel_diff"] == pytest.approx(0.5, rel=1e-3)  # every weight moved half as far
    assert figures["weights_max_abs_diff_before"] == 0.0
    assert figures["weights_max_abs_diff_after"] == pytest.approx(1e-4, rel=1e-3)


@pytest.mark.parametrize(
    "change, flag",
    [
        (lambda trl: trl["prompt_ids"][1].insert(0, 1), "prompt_ids_identical"),  # TRL added a BOS to one row
        (lambda trl: trl["completion_mask"][0].__setitem__(2, 0), "loss_tokens_identical"),  # EOS out of the loss
        (lambda trl: trl["completion_ids"][1].__setitem__(0, 4), "loss_tokens_identical"),
        (lambda trl: trl["rewards"].__setitem__(1, 1.0), "rewards_identical"),
    ],
)
def test_a_difference_in_the_batch_is_reported(change, flag):
    rl, trl = _records()
    change(trl)
    figures = compare_step(rl, trl, n_samples=2)
    assert not figures[flag]
    others = {"prompt_ids_identical", "loss_tokens_identical", "rewards_identical"} - {flag}
    assert all(figures[other] for other in others)


def test_cosine_and_relative_difference_of_opposite_and_orthogonal_gradients():
    g = _tensors(3)
    assert cosine(g, {k: -v for k, v in g.items()}) == pytest.approx(-1.0)
    assert relative_difference(g, {k: -v for k, v in g.items()}) == pytest.approx(2.0)
    a, b = {"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([0.0, 2.0])}
    assert cosine(a, b) == pytest.approx(0.0)
    assert relative_difference(a, b) == pytest.approx(5**0.5 / 2)


def test_gradients_of_different_parameters_are_refused():
    rl, trl = _records()
    trl["grads"]["lm_head.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"only TRL has \['lm_head.weight'\]"):
        compare_step(rl, trl, n_samples=2)
    with pytest.raises(ValueError, match=r"only rlflow has \['x'\]"):
        cosine({"x": torch.ones(1)}, {"y": torch.ones(1)})


def test_weights_are_compared_over_the_trained_parameters_only():
    """TRL's state dict also holds the tied lm_head; the figures read the gradients' tensors."""
    rl, trl = _records()
    for key in ("before", "after"):
        trl[key]["lm_head.weight"] = torch.full((2,), 100.0)
    assert compare_step(rl, trl, n_samples=2)["weights_max_abs_diff_after"] == pytest.approx(1e-4, rel=1e-3)
    update = update_difference(rl["before"], rl["after"], trl["before"], trl["after"], trl["grads"])
    assert (update["max_abs_diff"], update["max_abs"]) == (pytest.approx(1e-4, rel=1e-3), pytest.approx(2e-4, rel=1e-3))


def test_the_largest_update_difference_names_the_gradient_there():
    before = {"a": torch.zeros(3), "b": torch.zeros(2)}
    trl_after = {"a": torch.tensor([1.0, -1.0, 1.0]), "b": torch.tensor([1.0, 1.0])}
    rl_after = {"a": torch.tensor([1.0, -1.0, 0.9]), "b": torch.tensor([1.0, 0.2])}  # worst: b[1]
    grads = {"a": torch.tensor([3.0, -2.0, 1.0]), "b": torch.tensor([5.0, 2e-8])}
    update = update_difference(before, rl_after, before, trl_after, grads)
    assert update["max_abs_diff"] == pytest.approx(0.8) and update["max_abs"] == 1.0
    assert update["grad_at_max_abs_diff"] == pytest.approx(2e-8)
    assert update["rel_diff"] == pytest.approx((0.1**2 + 0.8**2) ** 0.5 / 5**0.5)


def test_replay_takes_each_groups_prompt_and_each_rows_completion():
    truth = {"answer": "15", "reverse_digits": True}
    step = {
        "batch": _batch(),
        "columns": [{"prompt": "7+8=", "ground_truth": truth}] * 2,
        "uids": ["u0", "u0"],
    }
    replay = replay_of(step, n_samples=2)
    assert replay == {"prompts": ["7+8="], "ground_truths": [truth], "completion_ids": [[5, 6, EOS], [9]]}
    assert trl_update.replay_dataset_rows([replay]) == [
        {"prompt": "7+8=", "ground_truth": '{"answer": "15", "reverse_digits": true}'}
    ]
    mixed = copy.deepcopy(step)
    mixed["uids"] = ["u0", "u1"]
    with pytest.raises(ValueError, match="not one prompt's group"):
        replay_of(mixed, n_samples=2)
    with pytest.raises(ValueError, match="not groups of n_samples=3"):
        replay_of(step, n_samples=3)


@pytest.mark.parametrize("module", [bench_update_parity, trl_update])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0


def test_zero_gradients_give_nan_not_an_error():
    """A batch whose every group scored alike has no gradient on either side."""
    zero = {"w": torch.zeros(3)}
    assert np.isnan(cosine(zero, zero)) and np.isnan(relative_difference(zero, zero))
