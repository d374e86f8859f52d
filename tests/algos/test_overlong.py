"""DAPO's overlong handling: the soft penalty against its formula, truncated rows from the stop tokens."""

from __future__ import annotations

import doctest

import pytest
import torch

from rlflow.algos import overlong
from rlflow.algos.overlong import overlong_penalty, response_lengths, truncated_rows


def dapo_penalty(length: int, max_len: int, buffer: int, factor: float) -> float:
    """DAPO eq. 13, scaled by ``factor``: 0 below the buffer, linear inside it, -factor past the limit."""
    if length <= max_len - buffer:
        return 0.0
    if length <= max_len:
        return factor * ((max_len - buffer) - length) / buffer
    return -factor


@pytest.mark.parametrize("max_len, buffer, factor", [(8, 4, 1.0), (10, 3, 0.5), (5, 5, 2.0), (6, 1, 1.0)])
def test_soft_penalty_matches_the_dapo_formula(max_len, buffer, factor):
    lengths = torch.arange(0, max_len + 3)
    expected = torch.tensor([dapo_penalty(int(n), max_len, buffer, factor) for n in lengths])
    torch.testing.assert_close(overlong_penalty(lengths, max_len, buffer, factor), expected)


def test_a_buffer_outside_the_limit_is_refused():
    for buffer in (0, 9):
        with pytest.raises(ValueError, match=f"overlong buffer={buffer} must be in \\[1, max_len=8\\]"):
            overlong_penalty(torch.tensor([3]), 8, buffer)


def test_truncated_rows_reach_the_limit_without_a_stop_token():
    # Two prompt tokens then responses of 3, 3, 2, 0 and 3 tokens (limit 3, stop tokens 2 and 9).
    input_ids = torch.tensor([[1, 1, 5, 6, 7], [1, 1, 5, 6, 2], [1, 1, 5, 2, 0], [1, 1, 0, 0, 0], [1, 1, 5, 6, 9]])
    response_mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 1, 1, 0], [0, 0, 0, 0, 0], [0, 0, 1, 1, 1]])
    assert response_lengths(response_mask).tolist() == [3, 3, 2, 0, 3]
    truncated = truncated_rows(input_ids, response_mask, max_len=3, stop_token_ids=(2, 9))
    assert truncated.tolist() == [True, False, False, False, False]
    # Without stop tokens every response at the limit was cut off.
    assert truncated_rows(input_ids, response_mask, max_len=3, stop_token_ids=()).tolist() == [
        True, True, False, False, True,
    ]  # fmt: skip


def test_docstring_examples_run():
    result = doctest.testmod(overlong, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
