"""A mixture-of-experts model trains with HF's router auxiliary loss: the same value as HF's
``aux_loss`` on real tokens (padded or packed), the same step as HF's loss plus it, and FSDP over
two dp ranks equal to one process."""

from __future__ import annotations

import pytest
import torch

from rlflow.engine.optim import OptimConfig
from rlflow.engine.router_loss import resolve_router_aux_loss_coef
from rlflow.engine.train_engine import EngineConfig, TrainEngine
from rlflow.families import family_of

VOCAB = 48
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
MOE = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}
COEF = 0.5  # large: the loss's share of the step shows


def _model(model_type: str, seed: int = 0, **extra):
    family = family_of({"model_type": model_type})
    config = family.build_config(**{**SHAPE, **MOE.get(model_type, {}), **extra})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return family.causal_lm_class(config).eval()


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Four left-padded rows of 3..9 real tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = [9, 3, 6, 5]
    ids, mask = torch.zeros(4, 9, dtype=torch.long), torch.zeros(4, 9, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, 9 - n :] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[row, 9 - n :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _loss(outputs, batch):
    mask = batch["attention_mask"]
    return -(outputs["log_probs"] * mask).sum() / mask.sum(), {}


def _engine(mesh, model, coef: float | None = COEF, **kwargs) -> TrainEngine:
    config = EngineConfig(device="cpu", optim=OptimConfig(lr=1e-2, eps=1e-6), router_aux_loss_coef=coef, **kwargs)
    return TrainEngine(model, mesh, config)


def _hf(model, batch: dict[str, torch.Tensor]):
    mask = batch["attention_mask"]
    positions = ((mask.cumsum(1) - 1) * mask).clamp(min=0)
    return model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions, output_router_logits=True)


@pytest.mark.parametrize("model_type", sorted(MOE))
@pytest.mark.parametrize("packing", ["off", "on"])
def test_the_router_loss_is_hfs_over_the_real_tokens(single_mesh, model_type, packing) -> None:
    batch = _batch()
    with torch.no_grad():
        expected = _hf(_model(model_type), batch).aux_loss
    engine = _engine(single_mesh, _model(model_type), packing=packing)
    with torch.no_grad():
        got = engine.run_micro_batch(batch, router_aux=True)["router_aux_loss"]
    torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=1e-6)
    # Padding counted as tokens would give another value: the mask matters on this batch.
    with torch.no_grad():
        unmasked = _hf(_model(model_type), {**batch, "attention_mask": torch.ones_like(batch["attention_mask"])})
    assert abs(float(unmasked.aux_loss) - float(expected)) > 1e-4


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_train_step_takes_hfs_loss_plus_the_weighted_router_loss(single_mesh, checkpointing) -> None:
    batch = _batch()
    reference = _model("qwen3_moe")
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.0)
    out = _hf(reference, batch)
    logp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["attention_mask"]
    valid = mask[:, 1:] * mask[:, :-1]  # a token with a real token before it
    loss = -(logp * valid).sum() / mask.sum() + COEF * out.aux_loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    opt.step()

    # One forward, as the reference; a checkpointed layer's router logits reach backward by recomputation.
    engine = _engine(single_mesh, _model("qwen3_moe"), gradient_checkpointing=checkpointing)
    metrics = engine.train_step(batch, _loss)
    expected = dict(reference.named_parameters())
    for name, param in engine.stage.named_parameters():
        torch.testing.assert_close(param.detach(), expected[name].detach(), rtol=1e-4, atol=1e-5, msg=name)
    assert metrics["router_aux_loss"] > 0
    # Without the router loss the routers take another step.
    plain = _engine(single_mesh, _model("qwen3_moe"), coef=0.0)
    assert "router_aux_loss" not in plain.train_step(batch, _loss)
    gate = "model.layers.0.mlp.gate.weight"
    assert not torch.allclose(plain.stage.get_parameter(gate), engine.stage.get_parameter(gate), atol=1e-5)


def test_the_coefficient_defaults_to_the_models_and_a_dense_model_has_none() -> None:
    moe = _model("qwen3_moe", router_aux_loss_coef=0.02).config
    assert resolve_router_aux_loss_coef(moe, None) == 0.02
    assert resolve_router_aux_loss_coef(moe, 0.0) == 0.0
    dense = _model("phi3").config
    assert resolve_router_aux_loss_coef(dense, None) == 0.0
    with pytest.raises(ValueError, match=r"models.actor.router_aux_loss_coef=0.1: model_type='phi3' has no router"):
        resolve_router_aux_loss_coef(dense, 0.1, where="models.actor.router_aux_loss_coef")


def _dp_worker(rank: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        engine = _engine(init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("pp", "dp", "tp")), _model("mixtral"))
        rows = torch.arange(4).tensor_split(2)[rank]
        metrics = [engine.train_step({k: v[rows] for k, v in _batch(s).items()}, _loss) for s in range(2)]
        torch.save({"full": engine.state_dict_full(), "metrics": metrics}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_two_dp_ranks_equal_one_process_of_their_micro_batches(single_mesh, tmp_path) -> None:
    from rlflow.rendezvous import free_port

    torch.multiprocessing.spawn(_dp_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    # One process whose two micro-batches are the dp ranks' rows: HF's loss over each forward.
    engine = _engine(single_mesh, _model("mixtral"), num_micro_batches=2)
    metrics = [engine.train_step(_batch(s), _loss) for s in range(2)]
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for name, value in engine.state_dict_full().items():
        torch.testing.assert_close(got[0]["full"][name], value, rtol=0, atol=2e-6, msg=name)
    for rank in range(2):
        for step in range(2):
            assert got[rank]["metrics"][step]["router_aux_loss"] == pytest.approx(metrics[step]["router_aux_loss"])
