"""Rows that share a prompt run it once (``rlflow.engine.shared_prefix``): the layout, when it is
taken, and an engine whose outputs and gradients equal the padded rows' (fp32, one process)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from train_engine_helpers import ADAM_EPS, VOCAB, actor_loss, build_model, critic_loss

from rlflow.engine.micro_batch import split_micro_batches
from rlflow.engine.optim import OptimConfig
from rlflow.engine.packing import position_ids_from_mask
from rlflow.engine.shared_prefix import shared_prefix_layout
from rlflow.engine.train_engine import EngineConfig, TrainEngine
from rlflow.planner.cost import layout_cost

torch.set_num_threads(1)

PROMPT, RESPONSE = 8, 4


def grouped_batch(prompts: int = 3, samples: int = 4, seed: int = 0, shuffle: bool = False) -> dict[str, torch.Tensor]:
    """``samples`` rows per prompt (left-padded prompts of 3..8 tokens, responses of 1..4), rows of
    a prompt consecutive or, with ``shuffle``, spread over the batch."""
    g = torch.Generator().manual_seed(seed)
    ids, mask, response = [], [], []
    for _ in range(prompts):
        length = int(torch.randint(3, PROMPT + 1, (1,), generator=g))
        prompt = torch.randint(1, VOCAB, (PROMPT,), generator=g) * (torch.arange(PROMPT) >= PROMPT - length)
        for _ in range(samples):
            own = int(torch.randint(1, RESPONSE + 1, (1,), generator=g))
            real = (torch.arange(RESPONSE) < own).long()
            ids.append(torch.cat([prompt, torch.randint(1, VOCAB, (RESPONSE,), generator=g) * real]))
            mask.append(torch.cat([(prompt > 0).long(), real]))
            response.append(torch.cat([torch.zeros(PROMPT, dtype=torch.long), real]))
    order = torch.randperm(len(ids), generator=g) if shuffle else torch.arange(len(ids))
    batch = {"input_ids": torch.stack(ids), "attention_mask": torch.stack(mask), "response_mask": torch.stack(response)}
    batch = {k: v[order] for k, v in batch.items()}
    rows = len(ids)
    batch["advantages"] = torch.randn(rows, PROMPT + RESPONSE, generator=g) * batch["response_mask"]
    batch["old_log_probs"] = -4.5 + 0.1 * torch.randn(rows, PROMPT + RESPONSE, generator=g)
    batch["returns"] = torch.randn(rows, PROMPT + RESPONSE, generator=g) * batch["response_mask"]
    return batch


def _layout(batch, layer_params=10**6, pair_cost=1):
    mask = batch["attention_mask"]
    return shared_prefix_layout(
        batch["input_ids"], mask, position_ids_from_mask(mask), batch["response_mask"], layer_params, pair_cost
    )


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_group_holds_its_prompt_once_and_every_row_reads_back_its_own_tokens(shuffle):
    batch = grouped_batch(shuffle=shuffle)
    layout = _layout(batch)
    assert layout is not None and layout.groups == 3
    ids, mask = batch["input_ids"], batch["attention_mask"]
    packed = layout.pack(ids)
    # Each group holds the prompt's real tokens once, then its rows' own tokens.
    rows_of_group = {}
    for r in range(len(ids)):
        rows_of_group.setdefault(tuple(ids[r, :PROMPT].tolist()), []).append(r)
    assert len(rows_of_group) == 3
    held = sum(int(mask[rs[0], :PROMPT].sum()) + int(mask[rs, PROMPT:].sum()) for rs in rows_of_group.values())
    read = layout.unpack_index[mask.flatten().bool()]
    assert len(set(read.tolist())) == held < int(mask.sum())  # every row reads the one copy of its prompt
    unpacked = layout.unpack(packed[..., None].float(), *ids.shape)[..., 0].long()
    assert torch.equal(unpacked, ids * mask)
    positions = layout.unpack(layout.position_ids[..., None].float(), *ids.shape)[..., 0].long()
    assert torch.equal(positions, position_ids_from_mask(mask) * mask)
    assert layout.length == max(
        int(mask[rs[0], :PROMPT].sum()) + int(mask[rs, PROMPT:].sum()) for rs in rows_of_group.values()
    )


def test_a_rows_tokens_see_the_prompt_and_their_own_row_only():
    batch = grouped_batch(prompts=1, samples=3)
    layout = _layout(batch)
    mask, ids = layout.mask[0, 0], batch["input_ids"]
    prompt = int(batch["attention_mask"][0, :PROMPT].sum())
    own = batch["attention_mask"][:, PROMPT:].sum(dim=1).tolist()
    starts = [prompt + sum(own[:r]) for r in range(3)]
    for r in range(3):
        for i in range(starts[r], starts[r] + own[r]):
            seen = mask[i].nonzero().flatten().tolist()
            assert seen == list(range(prompt)) + list(range(starts[r], i + 1))
    assert mask[:prompt, :prompt].equal(torch.ones(prompt, prompt, dtype=torch.bool).tril())
    assert ids.shape[0] == 3


def test_the_layout_is_taken_only_where_it_is_estimated_cheaper():
    distinct = grouped_batch(prompts=6, samples=1)
    assert _layout(distinct) is None  # no two rows share a prompt
    no_response = {**grouped_batch(), "response_mask": torch.zeros(12, PROMPT + RESPONSE, dtype=torch.long)}
    assert _layout(no_response) is None
    # Attention dominating (a tiny layer against costly pairs): one long sequence per prompt costs more.
    assert _layout(grouped_batch(samples=8), layer_params=1, pair_cost=10**6) is None
    assert layout_cost(4, 10, 100, 2, causal=True) == 4 * 10 * 100 + 4 * 100 * 0.5 * 2


def _engines(single_mesh, head="lm", precision="fp32", attention=None):
    base = build_model(head=head, tied=head == "lm")
    if attention is not None:
        base.set_attn_implementation(attention)
    config = dict(optim=OptimConfig(lr=1e-3, eps=ADAM_EPS), device="cpu", mixed_precision=precision)
    return {
        shared: TrainEngine(copy.deepcopy(base), single_mesh, EngineConfig(**config, shared_prefix=shared))
        for shared in (False, True)
    }


def _grads(engine, batch, loss_fn):
    engine.stage.zero_grad(set_to_none=True)
    outputs = engine.run_micro_batch(engine.to_device(batch))
    loss, _ = loss_fn(outputs, batch)
    loss.backward()
    return {name: p.grad.detach().clone() for name, p in engine.stage.named_parameters()}


@pytest.mark.parametrize(("head", "attention"), [("lm", None), ("lm", "eager"), ("value", None)])
def test_an_engine_sharing_prompts_computes_the_padded_rows_outputs_and_gradients(single_mesh, head, attention):
    batch = grouped_batch(shuffle=True)
    engines = _engines(single_mesh, head=head, attention=attention)
    assert engines[True]._shared_prefix(batch, position_ids_from_mask(batch["attention_mask"])) is not None
    assert engines[False]._shared_prefix(batch, position_ids_from_mask(batch["attention_mask"])) is None
    outputs = {shared: engine.forward(batch) for shared, engine in engines.items()}
    real = batch["attention_mask"].bool()
    for key, value in outputs[False].items():
        shared = outputs[True][key]
        torch.testing.assert_close(shared[real] if value.dim() > 1 else shared, value[real] if value.dim() > 1 else value,
                                   atol=2e-5, rtol=1e-5)  # fmt: skip
    loss_fn = actor_loss if head == "lm" else critic_loss
    grads = {shared: _grads(engine, batch, loss_fn) for shared, engine in engines.items()}
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_a_train_step_of_an_engine_sharing_prompts_moves_the_weights_as_the_padded_one_does(single_mesh):
    batch = grouped_batch(prompts=2, samples=6)
    engines = _engines(single_mesh)
    for engine in engines.values():
        engine.train_step(batch, actor_loss, num_mini_batches=2)
    params = {shared: dict(engine.stage.named_parameters()) for shared, engine in engines.items()}
    for name, p in params[False].items():
        torch.testing.assert_close(params[True][name].detach(), p.detach(), atol=1e-5, rtol=0, msg=name)


def test_bf16_sharing_prompts_stays_within_bf16s_rounding_of_the_padded_rows(single_mesh):
    batch = grouped_batch(prompts=2, samples=6)
    engines = _engines(single_mesh, precision="bf16")
    outputs = {shared: engine.forward(batch) for shared, engine in engines.items()}
    real = batch["response_mask"].bool()
    diff = (outputs[True]["log_probs"] - outputs[False]["log_probs"])[real].abs()
    assert float(diff.max()) < 0.05  # bf16 states: a few parts in 1e3 of log-probs of about -4.6


def test_micro_batches_keep_the_rows_of_a_prompt_together(single_mesh):
    batch = grouped_batch(prompts=4, samples=3, shuffle=True)
    engine = _engines(single_mesh)[True]
    engine.config = replace(engine.config, num_micro_batches=2)
    parts = engine._micro_batches(batch)
    prompts = [{tuple(batch["input_ids"][r, :PROMPT].tolist()) for r in mb.indices.tolist()} for mb in parts]
    assert len(parts) == 2 and not prompts[0] & prompts[1] and len(prompts[0] | prompts[1]) == 4
    assert sorted(r for mb in parts for r in mb.indices.tolist()) == list(range(12))
    engine.config = replace(
        engine.config, num_micro_batches=None, max_tokens_per_micro_batch=8
    )  # a prompt's rows exceed it
    assert len(engine._micro_batches(batch)) == len(split_micro_batches(batch, max_tokens=8))
