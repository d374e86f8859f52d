"""LoRA on the training engine: only the adapters train, the merged weights leave it, PEFT reads its adapter."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlflow.data.tiny_models import build_tiny_model
from rlflow.engine.lora import LoraSpec, MergedViews, adapters_disabled, lora_strategy_error
from rlflow.engine.train_engine import EngineConfig, TrainEngine

peft = pytest.importorskip("peft")

SPEC = LoraSpec(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"), seed=5)
VOCAB = 40


def _model(tied: bool = True):
    return build_tiny_model(family="llama", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                            num_kv_heads=2, intermediate_size=64, tie_word_embeddings=tied, seed=3)  # fmt: skip


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(1, VOCAB, (4, 9), generator=g),
        "attention_mask": torch.ones(4, 9, dtype=torch.long),
    }


def _loss(outputs, batch):
    # Raise the log-probs of the given tokens: any loss with a gradient on every adapter will do.
    return -(outputs["log_probs"] * batch["attention_mask"]).sum() / batch["attention_mask"].sum(), {}


def _engine(mesh, model=None, lr: float = 1e-2) -> TrainEngine:
    from rlflow.engine.optim import OptimConfig

    config = EngineConfig(device="cpu", lora=SPEC, optim=OptimConfig(lr=lr))
    return TrainEngine(model if model is not None else _model(), mesh, config)


def test_only_the_adapters_train_and_hold_optimizer_state(single_mesh) -> None:
    engine = _engine(single_mesh)
    base = {n: p.detach().clone() for n, p in engine.stage.named_parameters() if "lora_" not in n}
    adapters = {n for n, p in engine.stage.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    assert len(adapters) == 2 * 2 * len(SPEC.target_modules)  # A and B, per layer, per target
    for _ in range(2):
        engine.train_step(_batch(), _loss)
    held = {id(p) for p in engine.optimizer.state}
    assert held == {id(p) for n, p in engine.stage.named_parameters() if n in adapters}
    for name, param in engine.stage.named_parameters():
        if name in base:
            assert torch.equal(param, base[name]), name
    b = engine.stage.get_submodule("model.layers.0.self_attn.q_proj").lora_B["default"].weight
    assert b.abs().sum() > 0  # started at zero, moved


def test_a_target_matching_no_linear_module_is_refused(single_mesh) -> None:
    spec = LoraSpec(r=2, alpha=2.0, target_modules=("q_proj", "query_key_value"))
    with pytest.raises(ValueError, match=r"\['query_key_value'\] match no linear module.*'gate_proj'"):
        TrainEngine(_model(), single_mesh, EngineConfig(device="cpu", lora=spec))


def test_lora_refuses_tensor_and_pipeline_parallelism() -> None:
    assert lora_strategy_error(tp=1, pp=1) is None
    assert "tp=2, pp=1" in lora_strategy_error(tp=2, pp=1)
    assert "tp=1, pp=2" in lora_strategy_error(tp=1, pp=2)


def test_merged_weights_and_exports_are_the_adapted_policy(single_mesh, tmp_path) -> None:
    base_dir = tmp_path / "base"
    _model().save_pretrained(base_dir)
    engine = _engine(single_mesh)
    engine.train_step(_batch(), _loss)
    ids = _batch(1)["input_ids"]
    expected = engine.forward(_batch(1))["log_probs"]

    # The reshard source: HF names, the adapted weights merged, no adapter tensors.
    views = MergedViews(engine.stage).param_tensors()
    assert not any("lora" in n or "base_layer" in n for n in views)
    q = engine.stage.get_submodule("model.layers.1.self_attn.q_proj")
    a, b = q.lora_A["default"].weight, q.lora_B["default"].weight
    merged = q.base_layer.weight + SPEC.scaling * (b @ a)
    torch.testing.assert_close(views["model.layers.1.self_attn.q_proj.weight"][0], merged, rtol=0, atol=0)

    # The HF export is the merged model; its adapter/ loads in plain peft onto the base.
    engine.save_pretrained(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True, dtype=torch.float32),
        str(tmp_path / "hf" / "adapter"),
    )
    for model in (exported, with_adapter):
        logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        torch.testing.assert_close(logp, expected[:, 1:], rtol=0, atol=1e-5)


def test_checkpoint_resume_is_exact_and_holds_the_peft_adapter(single_mesh, tmp_path) -> None:
    engine = _engine(single_mesh)
    engine.train_step(_batch(0), _loss)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "adapter" / "adapter_model.safetensors").is_file()
    held = torch.load(tmp_path / "ckpt" / "rank00000.pt", weights_only=True)["params"]
    assert held and all(".lora_" in name for name in held)  # the frozen base is the model's files
    engine.train_step(_batch(1), _loss)
    resumed = _engine(single_mesh)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    resumed.train_step(_batch(1), _loss)
    for (name, p), (_, q) in zip(engine.stage.named_parameters(), resumed.stage.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_with_adapters_disabled_the_engine_is_its_base_model(single_mesh) -> None:
    base = _model()
    expected = TrainEngine(_model(), single_mesh, EngineConfig(device="cpu", optim=None)).forward(_batch(1))
    engine = _engine(single_mesh, base)
    engine.train_step(_batch(), _loss)
    with adapters_disabled(engine.stage):
        off = engine.forward(_batch(1))["log_probs"]
    torch.testing.assert_close(off, expected["log_probs"], rtol=0, atol=1e-6)
    assert not torch.allclose(engine.forward(_batch(1))["log_probs"], off, atol=1e-4)  # back on
    assert all(p.requires_grad for n, p in engine.stage.named_parameters() if ".lora_" in n)


def test_lora_under_fsdp_shards_the_adapters_and_merges_them_whole(single_mesh, tmp_path) -> None:
    from torch.distributed.tensor import DTensor

    from rlflow.engine.optim import OptimConfig

    # bf16 compute over fp32 masters: the engine applies FSDP2 even on one rank.
    config = EngineConfig(device="cpu", lora=SPEC, optim=OptimConfig(lr=1e-2), mixed_precision="bf16")
    engine = TrainEngine(_model(), single_mesh, config)
    q = engine.stage.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(q.lora_A["default"].weight, DTensor)
    plain = _engine(single_mesh)  # the same adapters drawn without FSDP
    torch.testing.assert_close(
        q.lora_A["default"].weight.full_tensor(),
        plain.stage.get_submodule("model.layers.0.self_attn.q_proj").lora_A["default"].weight,
        rtol=0,
        atol=0,
    )
    engine.train_step(_batch(), _loss)
    assert {id(p) for p in engine.optimizer.state} == {
        id(p) for n, p in engine.stage.named_parameters() if ".lora_" in n
    }
    a, b, w = (t.full_tensor() for t in (q.lora_A["default"].weight, q.lora_B["default"].weight, q.base_layer.weight))
    views = MergedViews(engine.stage).param_tensors()
    torch.testing.assert_close(views["model.layers.0.self_attn.q_proj.weight"][0], w + SPEC.scaling * (b @ a))
    engine.save_pretrained(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True, dtype=torch.float32)
    torch.testing.assert_close(
        exported.state_dict()["model.layers.0.self_attn.q_proj.weight"], w + SPEC.scaling * (b @ a)
    )


def _dp_worker(rank: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        engine = _engine(init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("pp", "dp", "tp")))
        rows = torch.arange(4).tensor_split(2)[rank]
        for _ in range(2):
            engine.train_step({k: v[rows] for k, v in _batch().items()}, _loss)
        full = engine.state_dict_full()
        local = MergedViews(engine.stage).param_tensors()["model.layers.0.self_attn.q_proj.weight"][0]
        torch.save({"full": full, "local": local}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_lora_over_two_dp_ranks_equals_one_process(single_mesh, tmp_path) -> None:
    from rlflow.rendezvous import free_port

    torch.multiprocessing.spawn(_dp_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    engine = _engine(single_mesh)
    for _ in range(2):
        engine.train_step(_batch(), _loss)
    expected = engine.state_dict_full()
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert set(got[0]["full"]) == set(expected) and got[1]["full"] is None
    for name, value in expected.items():
        torch.testing.assert_close(got[0]["full"][name], value, rtol=0, atol=1e-6)
    # Each dp rank merges its own rows of the FSDP-sharded weight (the reshard source's view).
    q = expected["model.layers.0.self_attn.q_proj.weight"]
    torch.testing.assert_close(torch.cat([g["local"] for g in got]), q, rtol=0, atol=1e-6)
