"""Pipelined generation (pp > 1) in the HF sampler under dp × tp × pp, four CPU processes on gloo,
against one process at pp = 1."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rollout_helpers import left_padded_prompts, tiny_config, tiny_model
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaForCausalLM

from rlflow.engine.pipeline import DecoderStage
from rlflow.engine.rollout import HFRolloutEngine, RolloutBuild, SamplingParams
from rlflow.engine.rollout.hf_sampler import sample_responses
from rlflow.families import get_family
from rlflow.parallel.executor import check_tensors, module_param_tensors
from rlflow.parallel.layout import build_layout
from rlflow.rendezvous import free_port
from rlflow.strategy import ParallelStrategy

pytestmark = pytest.mark.distributed

WORLD = 4
LENGTHS = [5, 9, 3, 7, 4, 6, 8, 2]
GREEDY = SamplingParams(greedy=True, max_new_tokens=10)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=30, n=2, max_new_tokens=8, seed=3)
# (pp, dp, tp) meshes over the four processes: a middle stage only exists at pp = 4
MESHES = {"pp2_dp2": (2, 2, 1), "pp2_tp2": (2, 1, 2), "pp4": (4, 1, 1)}


def _tied_model() -> torch.nn.Module:
    """A tiny LM whose head is its embedding, with the decisive weights of ``tiny_model``."""
    config = tiny_config()
    config.tie_word_embeddings = True
    torch.manual_seed(7)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    return model


def _generic_model() -> torch.nn.Module:
    """A tiny OLMo 2 (a model type of the generic family: q/k norms over the whole projections)."""
    family = get_family("olmo2")
    shape = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "max_position_embeddings", "pad_token_id")  # fmt: skip
    config = family.build_config(**{k: getattr(tiny_config(), k) for k in shape}, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(5)
    return family.causal_lm_class(config).eval()


def _cases(stops: tuple[int, ...]) -> dict[str, SamplingParams]:
    return {
        "greedy": GREEDY,
        "stop": replace(GREEDY, stop_token_ids=stops),
        "sampled": SAMPLED,
        "sampled_stop": replace(SAMPLED, stop_token_ids=stops),
        "sampled_stop_min": replace(SAMPLED, stop_token_ids=stops, min_new_tokens=3),
    }


def _worker(rank: int, port: int, outdir: str, stops: tuple[int, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        ids, mask = left_padded_prompts(LENGTHS, seed=0)
        results = {}
        for mesh_name, shape in MESHES.items():
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp", "tp"))
            dp, dp_rank = shape[1], mesh["dp"].get_local_rank()
            rows = slice(dp_rank * len(LENGTHS) // dp, (dp_rank + 1) * len(LENGTHS) // dp)
            engine = HFRolloutEngine(tiny_model(seed=0), mesh)
            assert isinstance(engine.module, DecoderStage)
            for case, params in _cases(stops).items():
                results[(mesh_name, case)] = engine.generate((ids[rows], mask[rows]), params)
            if mesh_name == "pp2_dp2":  # a generic family's model, through HF's layers in each stage
                generic = HFRolloutEngine(_generic_model(), mesh)
                results[(mesh_name, "generic_stop")] = generic.generate((ids[rows], mask[rows]), _cases(stops)["stop"])
            if mesh_name == "pp2_dp2":  # three micro-batches of uneven size (2, 1, 1 prompts)
                uneven = HFRolloutEngine(tiny_model(seed=0), mesh, num_micro_batches=3)
                results[(mesh_name, "stop_3mb")] = uneven.generate((ids[rows], mask[rows]), _cases(stops)["stop"])
            if mesh_name == "pp4":  # HF's layers in every stage (the lean decoder ran above)
                hf_layers = HFRolloutEngine(tiny_model(seed=0), mesh, fast_decode=False)
                results[(mesh_name, "stop_hf_layers")] = hf_layers.generate((ids, mask), _cases(stops)["sampled_stop"])
            if mesh_name == "pp4":  # a worker's path: built empty, written from full weights, tied embeddings
                source = _tied_model()
                spec = RolloutBuild(
                    config=source.config, device_mesh=mesh, device=torch.device("cpu"), dtype=torch.float32
                )
                built = HFRolloutEngine.build(spec)
                layout = build_layout(source.config, ParallelStrategy(pp=4), ranks=range(WORLD))
                check_tensors(layout, rank, module_param_tensors(built.weight_target()))
                built.update_weights(source.state_dict())
                results[(mesh_name, "built_tied")] = built.generate((ids, mask), GREEDY)
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _reference(model, ids, mask, params: SamplingParams, dp: int, dp_rank: int) -> dict[str, torch.Tensor]:
    """One process at pp = 1 on dp rank ``dp_rank``'s rows, with that rank's generator."""
    rows = slice(dp_rank * len(LENGTHS) // dp, (dp_rank + 1) * len(LENGTHS) // dp)
    generator = torch.Generator().manual_seed((params.seed or 0) + 0x9E3779B1 * dp_rank)
    # native_decode=False: the one-process loop with the stages' torch decode steps (the C++ step
    # sums in another order, so its log-probs would differ from the stages' by float rounding)
    responses, response_mask, old_logp = sample_responses(
        model, ids[rows], mask[rows], params, pad_token_id=0, generator=generator, native_decode=False
    )
    return {"responses": responses, "response_mask": response_mask, "old_logp": old_logp}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("pipelined")
    ids, mask = left_padded_prompts(LENGTHS, seed=0)
    model = tiny_model(seed=0)
    free = HFRolloutEngine(model).generate((ids, mask), GREEDY)["responses"]
    stops = tuple(free[:, :3].flatten().unique()[:4].tolist())
    mp.spawn(_worker, args=(free_port(), str(outdir), stops), nprocs=WORLD, join=True)
    ranks = [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    references = {}
    for case, params in _cases(stops).items():
        for dp in (1, 2):
            references[(case, dp)] = [_reference(model, ids, mask, params, dp, d) for d in range(dp)]
    references[("built_tied", 1)] = [_reference(_tied_model(), ids, mask, GREEDY, 1, 0)]
    generic = _generic_model()
    references[("generic_stop", 2)] = [_reference(generic, ids, mask, _cases(stops)["stop"], 2, d) for d in range(2)]
    return ranks, references, stops


def _check(out, ref) -> None:
    assert torch.equal(out["responses"], ref["responses"])
    assert torch.equal(out["response_mask"], ref["response_mask"])
    # the stages multiply other row counts than one process does: float rounding, relative to the log-probs' size
    torch.testing.assert_close(out["old_logp"], ref["old_logp"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("case", ["greedy", "stop", "sampled", "sampled_stop"])
def test_pipelined_equals_one_process(runs, mesh_name, case):
    """Every rank of every stage returns its dp rank's rollout of pp = 1 (seeded sampling too)."""
    ranks, references, _ = runs
    pp, dp, tp = MESHES[mesh_name]
    for rank, result in enumerate(ranks):
        dp_rank = (rank // tp) % dp  # rank = (pp_rank * dp + dp_rank) * tp + tp_rank
        _check(result[(mesh_name, case)], references[(case, dp)][dp_rank])


def test_stop_tokens_finish_rows_early(runs):
    """The stop cases stop rows at different steps, and pruning ran (a quarter of the rows finished)."""
    ranks, references, stops = runs
    lengths = references[("stop", 1)][0]["response_mask"].sum(1)
    assert len(set(lengths.tolist())) > 1 and int((lengths < GREEDY.max_new_tokens).sum()) >= len(LENGTHS) // 4
    responses = ranks[0][("pp4", "stop")]["responses"]
    assert torch.isin(responses, torch.tensor(stops)).any()


def test_uneven_micro_batches(runs):
    ranks, references, _ = runs
    for rank, result in enumerate(ranks):
        _check(result[("pp2_dp2", "stop_3mb")], references[("stop", 2)][rank % 2])


def test_stages_through_hf_layers(runs):
    """Under tp the stages run HF's layers; here every stage of pp=4 does, sampling with stop tokens."""
    ranks, references, _ = runs
    for result in ranks:
        _check(result[("pp4", "stop_hf_layers")], references[("sampled_stop", 1)][0])


def test_built_stage_takes_full_weights_with_tied_embeddings(runs):
    """The worker's path: ``build`` materialises only the stage (the layout's slices of it), and
    ``update_weights`` with the full state dict fills it, the last stage's copy of the tied embedding too."""
    ranks, references, _ = runs
    for result in ranks:
        _check(result[("pp4", "built_tied")], references[("built_tied", 1)][0])


def test_a_generic_familys_model_generates_in_stages(runs):
    """pp=2 × dp=2 of a model type without a hand-written record equals one process at pp=1."""
    ranks, references, _ = runs
    for rank, result in enumerate(ranks):
        _check(result[("pp2_dp2", "generic_stop")], references[("generic_stop", 2)][rank % 2])
