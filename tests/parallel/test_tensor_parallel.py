"""apply_tp on plain HF models: the split is the documented one and outputs equal one process."""

from __future__ import annotations

import os
import socket

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForTokenClassification,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from rlflow.parallel.tensor_parallel import check_tp_degree, local_heads, tp_plan_for

TP = 2
SMALL = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {
        "llama_gqa": LlamaForCausalLM(LlamaConfig(**SMALL)),
        "qwen2_tied": Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **SMALL)),
        "qwen3_bias": Qwen3ForCausalLM(Qwen3Config(head_dim=16, attention_bias=True, **SMALL)),  # q/k norms
        "mistral_window": MistralForCausalLM(MistralConfig(sliding_window=4, **SMALL)),  # window < 9 tokens
        "critic": LlamaForTokenClassification(LlamaConfig(num_labels=1, **SMALL)),
    }


def test_plan_names_every_split_module() -> None:
    plan = tp_plan_for(_models()["llama_gqa"])
    assert plan["model.embed_tokens"] == "vocab"
    assert plan["lm_head"] == "colwise"
    assert plan["model.norm"] == "replicate"
    for i in range(2):
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert plan[p + name] == "colwise"
        assert plan[p + "self_attn.o_proj"] == plan[p + "mlp.down_proj"] == "rowwise"
        assert plan[p + "input_layernorm"] == plan[p + "post_attention_layernorm"] == "replicate"
    critic = tp_plan_for(_models()["critic"])
    assert critic["score"] == "replicate" and "lm_head" not in critic
    qwen3 = tp_plan_for(_models()["qwen3_bias"])
    assert qwen3["model.layers.1.self_attn.q_norm"] == qwen3["model.layers.1.self_attn.k_norm"] == "replicate"
    for name, model in _models().items():  # every parameter is split or replicated on purpose
        plan = tp_plan_for(model)
        assert {n.rpartition(".")[0] for n, _ in model.named_parameters()} <= set(plan), name


def test_plan_refuses_a_module_its_family_does_not_know() -> None:
    model = _models()["llama_gqa"]
    model.model.layers[0].mlp.extra = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="no tensor-parallel split for module 'model.layers.0.mlp.extra'"):
        tp_plan_for(model)


def test_tp_degree_must_divide_head_counts() -> None:
    cfg = LlamaConfig(**SMALL)
    check_tp_degree(cfg, 2)
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        check_tp_degree(cfg, 3)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        check_tp_degree(cfg, 4)
    assert local_heads(cfg, 2) == (2, 1)


def _check_shards(name: str, model: torch.nn.Module, reference: torch.nn.Module, tp_rank: int) -> None:
    """Every parameter's local shard is torch.chunk of the full weight along the documented dim."""
    from torch.distributed.tensor import DTensor

    full = dict(reference.named_parameters())
    dims = {"vocab": 0, "colwise": 0, "rowwise": 1}
    plan = tp_plan_for(reference)
    for pname, param in model.named_parameters():
        module, _, leaf = pname.rpartition(".")
        kind = plan.get(module, "replicate")
        local = param.to_local() if isinstance(param, DTensor) else param
        if kind == "replicate" or (kind == "rowwise" and leaf == "bias"):
            expected = full[pname]
        else:
            expected = full[pname].chunk(TP, dim=dims[kind] if leaf == "weight" else 0)[tp_rank]
        assert torch.equal(local.detach(), expected.detach()), f"{name}: shard of {pname}"


def _worker(rank: int, port: int, outdir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rlflow.parallel.tensor_parallel import apply_tp

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=TP)
    try:
        mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
        ids = torch.randint(1, 96, (3, 9), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        results = {}
        references = _models()
        for name, model in _models().items():
            model.eval()
            apply_tp(model, mesh)
            _check_shards(name, model, references[name], rank)
            with torch.no_grad():
                results[name] = model(input_ids=ids, attention_mask=mask).logits
                if name == "qwen2_tied":
                    assert model.lm_head.weight is model.model.embed_tokens.weight
                if name == "llama_gqa":  # the rollout engine generates with a TP model and a KV cache
                    results["generate"] = model.generate(
                        input_ids=ids[1:], attention_mask=mask[1:], max_new_tokens=5, do_sample=False, pad_token_id=0
                    )
        torch.save(results, os.path.join(outdir, f"tp_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_tp_outputs_equal_single_process(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_worker, args=(port, str(tmp_path)), nprocs=TP, join=True)
    ids = torch.randint(1, 96, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    for rank in range(TP):
        got = torch.load(tmp_path / f"tp_rank{rank}.pt")
        for name, model in _models().items():
            model.eval()
            with torch.no_grad():
                want = model(input_ids=ids, attention_mask=mask).logits
                if name == "llama_gqa":
                    generated = model.generate(
                        input_ids=ids[1:], attention_mask=mask[1:], max_new_tokens=5, do_sample=False, pad_token_id=0
                    )
                    assert torch.equal(got["generate"], generated)
            torch.testing.assert_close(got[name], want, atol=1e-5, rtol=1e-5, msg=f"{name} logits, tp rank {rank}")
