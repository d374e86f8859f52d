"""Single-process pieces of the training engine: micro-batching, schedules, configs, stage split."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from train_engine_helpers import build_model, make_batch, reference_outputs

from rlflow.engine.micro_batch import balanced_partition, num_micro_batches_for, split_micro_batches
from rlflow.engine.optim import OptimConfig, build_lr_scheduler, build_optimizer, lr_factor
from rlflow.engine.parallelize import ParallelDims
from rlflow.engine.pipeline import build_stage, token_log_probs
from rlflow.engine.train_engine import ENGINE_CAPABILITIES, EngineConfig, strategy_error


def test_partition_balances_tokens_and_covers_every_row_once() -> None:
    lengths = [30, 2, 17, 9, 25, 4, 11, 6]
    parts = balanced_partition(lengths, 3)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    sums = [sum(lengths[i] for i in p) for p in parts]
    assert max(sums) - min(sums) <= max(lengths)
    # Row-count chunking of the same rows is far less balanced.
    chunk_sums = [sum(c) for c in torch.tensor(lengths).chunk(3)]
    assert max(sums) - min(sums) < max(chunk_sums) - min(chunk_sums)


def test_equal_rows_partition_for_pipelining() -> None:
    parts = balanced_partition([50, 1, 1, 1, 1], 2, equal_rows=True)
    assert sorted(len(p) for p in parts) == [2, 3]
    parts = balanced_partition([5, 1, 1, 1, 1], 4, equal_rows=True)
    assert all(parts) and sum(map(len, parts)) == 5


def test_partition_rejects_bad_counts() -> None:
    with pytest.raises(ValueError, match="num_parts=3"):
        balanced_partition([1, 2], 3)


def test_token_budget_picks_the_micro_batch_count() -> None:
    assert num_micro_batches_for([6, 5, 4, 3], max_tokens=9) == 2
    assert num_micro_batches_for([6, 5, 4, 3], max_tokens=100) == 1
    assert num_micro_batches_for([20, 1], max_tokens=5) == 2  # a long row alone, not split


def test_split_trims_padding_columns_and_keeps_per_row_tensors() -> None:
    batch = make_batch()
    batch["row_scalar"] = torch.arange(8.0)
    mbs = split_micro_batches(batch, num_micro_batches=3)
    assert sorted(torch.cat([mb.indices for mb in mbs]).tolist()) == list(range(8))
    for mb in mbs:
        mask = batch["attention_mask"][mb.indices]
        assert mask[:, : mb.col_start].sum() == 0 and mask[:, mb.col_stop :].sum() == 0
        assert torch.equal(mb.data["attention_mask"], mask[:, mb.col_start : mb.col_stop])
        assert torch.equal(mb.data["row_scalar"], batch["row_scalar"][mb.indices])
    with pytest.raises(ValueError, match="exactly one"):
        split_micro_batches(batch)


def test_warmup_then_cosine_schedule() -> None:
    cfg = OptimConfig(lr=2.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    factors = [lr_factor(s, cfg) for s in range(16)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0
    assert factors[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factors[14] == factors[15] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))
    param = torch.nn.Parameter(torch.zeros(1))
    opt = build_optimizer([param], cfg)
    sched = build_lr_scheduler(opt, cfg)
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2.0 * f for f in factors[:5]])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_micro_batches": 2, "max_tokens_per_micro_batch": 8}, "not both"),
        ({"num_micro_batches": 0}, "num_micro_batches=0"),
        ({"packing": "yes"}, "packing='yes'"),
        ({"pp_schedule": "zb"}, "pp_schedule='zb'"),
        ({"mixed_precision": "fp16"}, "mixed_precision='fp16'"),
    ],
)
def test_engine_config_rejects_bad_values(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_optim_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="total_steps=2"):
        OptimConfig(warmup_steps=5, total_steps=2)


def test_strategy_checks_name_the_bad_degree() -> None:
    config = build_model().config
    assert strategy_error("train_step", config, 2, 2, 2) is None
    assert "num_key_value_heads=2" in strategy_error("train_step", config, 1, 4, 1)
    assert "pp=8" in strategy_error("inference", config, 1, 1, 8)
    assert "generate" in strategy_error("generate", config, 1, 1, 1)
    assert set(ENGINE_CAPABILITIES) == {"train_step", "inference"}
    with pytest.raises(ValueError, match="dp=0"):
        ParallelDims(dp=0)


@pytest.mark.parametrize(("tied", "head"), [(False, "lm"), (True, "lm"), (False, "value")])
def test_pipeline_stages_chained_equal_the_whole_model(tied: bool, head: str) -> None:
    model = build_model(tied=tied, head=head).eval()
    batch = make_batch()
    with torch.no_grad():
        want = reference_outputs(model, batch)
        stages = [build_stage(copy.deepcopy(model), 3, r).eval() for r in range(3)]
        mask = batch["attention_mask"]
        pos = ((mask.cumsum(1) - 1) * mask).clamp(min=0)
        x = batch["input_ids"]
        for stage in stages:
            x = stage(x, attention_mask=mask, position_ids=pos, labels=batch["input_ids"])
    assert [s.is_first for s in stages] == [True, False, False]
    assert [s.is_last for s in stages] == [False, False, True]
    names = [set(dict(s.named_parameters())) for s in stages]
    assert not names[0] & names[1] and not names[1] & names[2]
    if head == "value":
        torch.testing.assert_close(x, want["values"], atol=1e-5, rtol=1e-5)
        return
    log_probs, entropy, _ = x
    torch.testing.assert_close(log_probs, want["log_probs"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, want["entropy"], atol=1e-5, rtol=1e-5)
    if tied:  # the last stage holds its own copy of the tied embedding, equal at start
        assert stages[2].lm_head.weight is not stages[0].model.embed_tokens.weight
        assert torch.equal(stages[2].lm_head.weight, stages[0].model.embed_tokens.weight)


def test_token_log_probs_zero_at_sequence_starts() -> None:
    logits = torch.randn(1, 4, 5)
    ids = torch.tensor([[0, 3, 1, 2]])
    pos = torch.tensor([[0, 0, 1, 2]])  # one left-pad token, then a 3-token sequence
    log_probs, entropy = token_log_probs(logits, ids, pos)
    assert log_probs[0, :2].eq(0).all() and entropy[0, :2].eq(0).all()
    expected = torch.log_softmax(logits[0, 1], -1)[1]
    torch.testing.assert_close(log_probs[0, 2], expected)
