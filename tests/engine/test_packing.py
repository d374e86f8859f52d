"""Sequence packing: round trips, boundaries, and a packed HF forward equal to the padded one."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import left_padded_prompts, tiny_model

from rlflow.engine.packing import (
    cu_seqlens_from_mask,
    max_seqlen,
    pack,
    pack_tensor,
    position_ids_from_mask,
    unpack,
)

torch.set_num_threads(1)

MASKS = {
    "left": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]]),
    "right": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]),
    "both": torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [1, 1, 1, 0]]),  # left-padded prompt + right-padded response
    "empty_row": torch.tensor([[0, 0, 0, 0], [1, 1, 1, 0]]),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_round_trip(name):
    mask = MASKS[name]
    ids = torch.randint(1, 50, mask.shape) * mask
    packed, cu_seqlens, position_ids = pack(ids, mask)
    total = int(mask.sum())
    assert packed.shape == (1, total) and position_ids.shape == (1, total)
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, *mask.sum(1).cumsum(0).tolist()]
    assert torch.equal(unpack(packed, mask), ids)
    for b in range(mask.shape[0]):  # positions restart at 0 for every sequence
        start, end = cu_seqlens[b].item(), cu_seqlens[b + 1].item()
        assert position_ids[0, start:end].tolist() == list(range(end - start))
    hidden = torch.randn(*mask.shape, 3, 2)
    back = unpack(pack_tensor(hidden, mask), mask, pad_value=-7.0)
    assert torch.equal(back[mask.bool()], hidden[mask.bool()]) and (back[~mask.bool()] == -7.0).all()


def test_helpers():
    mask = MASKS["left"]
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3], [0, 0, 0, 0]]
    assert cu_seqlens_from_mask(mask).tolist() == [0, 2, 6, 7]
    assert max_seqlen(cu_seqlens_from_mask(mask)) == 4
    assert max_seqlen(torch.tensor([0], dtype=torch.int32)) == 0


def test_errors():
    mask = MASKS["left"]
    with pytest.raises(ValueError, match="7 valid tokens"):
        unpack(torch.zeros(1, 6), mask)
    with pytest.raises(ValueError, match=r"\(1, total, ...\)"):
        unpack(torch.zeros(7), mask)
    with pytest.raises(ValueError, match="2-D"):
        pack(torch.zeros(4, dtype=torch.long), torch.ones(4))
    with pytest.raises(ValueError, match="does not start with mask shape"):
        pack_tensor(torch.zeros(2, 4), mask)


def test_packed_forward_equals_padded_forward():
    model = tiny_model("llama", seed=4)
    ids, mask = left_padded_prompts([5, 9, 3, 7], seed=4)
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
        packed_ids, _, position_ids = pack(ids, mask)
        packed = model(input_ids=packed_ids, position_ids=position_ids, use_cache=False).logits
    torch.testing.assert_close(unpack(packed, mask)[mask.bool()], padded[mask.bool()], atol=1e-5, rtol=1e-5)
