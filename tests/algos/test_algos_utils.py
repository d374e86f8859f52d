"""Masked reductions and log-prob helpers against independent references, plus every
``>>>`` example in rlflow.algos."""

from __future__ import annotations

import doctest
import importlib

import pytest
import torch

from rlflow.algos import entropy_from_logits, logprobs_from_logits, masked_mean, masked_var, masked_whiten


def test_masked_statistics_equal_selected_elements():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    mask = torch.rand(4, 7, generator=gen) < 0.6
    selected = values[mask]
    torch.testing.assert_close(masked_mean(values, mask), selected.mean())
    torch.testing.assert_close(masked_var(values, mask), selected.var())
    torch.testing.assert_close(masked_var(values, mask, unbiased=False), selected.var(unbiased=False))
    torch.testing.assert_close(masked_whiten(values, mask)[mask], (selected - selected.mean()) / selected.std())
    kept_mean = masked_whiten(values, mask, shift_mean=False)[mask]
    torch.testing.assert_close(kept_mean, (selected - selected.mean()) / selected.std() + selected.mean())
    rows = masked_mean(values, mask, dim=-1)
    torch.testing.assert_close(rows, torch.stack([values[i][mask[i]].mean() for i in range(4)]))


def test_masked_edge_cases():
    assert masked_mean(torch.ones(3), torch.zeros(3)).item() == 0.0  # empty mask: 0, not NaN
    with pytest.raises(ValueError, match="selects no element"):
        masked_var(torch.ones(3), torch.zeros(3))
    with pytest.raises(ValueError, match="single element"):
        masked_whiten(torch.ones(3), torch.tensor([0, 1, 0]))
    with pytest.raises(ValueError, match="same shape"):
        masked_mean(torch.ones(3), torch.ones(4))


def test_logprobs_and_entropy_match_full_log_softmax():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 50, generator=gen) * 4
    labels = torch.randint(0, 50, (2, 5), generator=gen)
    log_probs = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(logprobs_from_logits(logits, labels), log_probs.gather(-1, labels[..., None])[..., 0])
    torch.testing.assert_close(entropy_from_logits(logits), -(log_probs.exp() * log_probs).sum(-1))
    # bf16 input is upcast: result is fp32 and close to the fp32 computation on the bf16 values.
    low = logits.bfloat16()
    reference = torch.log_softmax(low.float(), dim=-1).gather(-1, labels[..., None])[..., 0]
    assert logprobs_from_logits(low, labels).dtype == torch.float32
    torch.testing.assert_close(logprobs_from_logits(low, labels), reference)
    torch.testing.assert_close(entropy_from_logits(low), entropy_from_logits(low.float()))
    with pytest.raises(ValueError, match="disagree before the vocab dim"):
        logprobs_from_logits(logits, labels[:, :4])


def test_entropy_stays_finite_when_probabilities_underflow():
    logits = torch.tensor([[0.0, -1e4, -1e4]])
    assert torch.isfinite(entropy_from_logits(logits)).all() and entropy_from_logits(logits).item() < 1e-6


@pytest.mark.parametrize("module", ["utils", "advantages", "packed_gae", "kl", "losses", "mismatch"])
def test_docstring_examples_run(module):
    mod = importlib.import_module(f"rlflow.algos.{module}")
    result = doctest.testmod(mod, extraglobs={"torch": torch}, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
