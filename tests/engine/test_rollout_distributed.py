"""The HF sampler under dp=2 and tp=2 (two CPU processes, gloo) against one process."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rollout_helpers import left_padded_prompts, tiny_config, tiny_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from rlflow.engine.rollout import HFRolloutEngine, SamplingParams
from rlflow.families import get_family
from rlflow.rendezvous import free_port

pytestmark = pytest.mark.distributed

LENGTHS = [5, 9, 3, 7, 4, 6, 8, 2]
GREEDY = SamplingParams(greedy=True, max_new_tokens=10)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=30, n=2, max_new_tokens=8, seed=3)


def _stop_params(stops: tuple[int, ...]) -> SamplingParams:
    return SamplingParams(greedy=True, max_new_tokens=10, stop_token_ids=stops)


def _generic_model(seed: int = 0) -> torch.nn.Module:
    """A tiny Starcoder2: a generic family's model type whose config declares Megatron's tp plan."""
    family = get_family("starcoder2")
    shape = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "max_position_embeddings", "pad_token_id")  # fmt: skip
    config = family.build_config(**{k: getattr(tiny_config(), k) for k in shape}, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return family.causal_lm_class(config).eval()


def _mesh(dp: int, tp: int):
    return init_device_mesh("cpu", (1, dp, tp), mesh_dim_names=("pp", "dp", "tp"))


def _worker(rank: int, world: int, port: int, outdir: str, stops: tuple[int, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ids, mask = left_padded_prompts(LENGTHS, seed=0)
        results = {}

        dp_mesh = _mesh(dp=2, tp=1)
        rows = slice(dp_mesh["dp"].get_local_rank() * 4, dp_mesh["dp"].get_local_rank() * 4 + 4)
        engine = HFRolloutEngine(tiny_model(seed=0), dp_mesh)
        results["dp_greedy"] = engine.generate((ids[rows], mask[rows]), GREEDY)

        tp_mesh = _mesh(dp=1, tp=2)
        engine = HFRolloutEngine(tiny_model(seed=0), tp_mesh)
        assert isinstance(engine.module.model.layers[0].self_attn.q_proj.weight, DTensor)
        results["tp_greedy"] = engine.generate((ids, mask), GREEDY)
        results["tp_stop"] = engine.generate((ids, mask), _stop_params(stops))
        results["tp_sampled"] = engine.generate((ids, mask), SAMPLED)
        engine.update_weights(tiny_model(seed=5).state_dict())  # full tensors: each rank cuts its shard
        results["tp_updated_full"] = engine.generate((ids, mask), GREEDY)
        shards = HFRolloutEngine(tiny_model(seed=6), tp_mesh).module.state_dict()
        engine.update_weights({k: v.to_local() if isinstance(v, DTensor) else v for k, v in shards.items()})
        results["tp_updated_local"] = engine.generate((ids, mask), GREEDY)
        generic = HFRolloutEngine(_generic_model(), tp_mesh)
        assert isinstance(generic.module.model.layers[0].mlp.c_fc.weight, DTensor)
        results["tp_generic"] = generic.generate((ids, mask), GREEDY)
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("rollout_dist")
    ids, mask = left_padded_prompts(LENGTHS, seed=0)
    reference = HFRolloutEngine(tiny_model(seed=0))
    free = reference.generate((ids, mask), GREEDY)["responses"]
    stops = tuple(free[:, :3].flatten().unique()[:4].tolist())
    mp.spawn(_worker, args=(2, free_port(), str(outdir), stops), nprocs=2, join=True)
    ranks = [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(2)]
    single = {
        "greedy": reference.generate((ids, mask), GREEDY),
        "stop": reference.generate((ids, mask), _stop_params(stops)),
        "updated_full": HFRolloutEngine(tiny_model(seed=5)).generate((ids, mask), GREEDY),
        "updated_local": HFRolloutEngine(tiny_model(seed=6)).generate((ids, mask), GREEDY),
        "generic": HFRolloutEngine(_generic_model()).generate((ids, mask), GREEDY),
    }
    return ranks, single


def test_greedy_identical_under_dp2(runs):
    ranks, single = runs
    for key in ("responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
        joined = torch.cat([ranks[0]["dp_greedy"][key], ranks[1]["dp_greedy"][key]])
        assert torch.equal(joined, single["greedy"][key]), key
    logp = torch.cat([ranks[0]["dp_greedy"]["old_logp"], ranks[1]["dp_greedy"]["old_logp"]])
    torch.testing.assert_close(logp, single["greedy"]["old_logp"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["greedy", "stop", "generic"])
def test_greedy_identical_under_tp2(runs, case):
    ranks, single = runs
    for rank in ranks:
        out = rank[f"tp_{case}"]
        assert torch.equal(out["responses"], single[case]["responses"])
        assert torch.equal(out["response_mask"], single[case]["response_mask"])
        torch.testing.assert_close(out["old_logp"], single[case]["old_logp"], atol=1e-5, rtol=0)
    assert len(set(single["stop"]["response_mask"].sum(1).tolist())) > 1


def test_tp_ranks_sample_the_same_tokens(runs):
    ranks, _ = runs
    assert torch.equal(ranks[0]["tp_sampled"]["responses"], ranks[1]["tp_sampled"]["responses"])
    assert ranks[0]["tp_sampled"]["responses"].shape == (2 * len(LENGTHS), 8)


@pytest.mark.parametrize("kind", ["full", "local"])
def test_update_weights_under_tp(runs, kind):
    ranks, single = runs
    for rank in ranks:
        assert torch.equal(rank[f"tp_updated_{kind}"]["responses"], single[f"updated_{kind}"]["responses"])
