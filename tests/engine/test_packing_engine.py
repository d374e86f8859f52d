"""The training engine's packed path equals its padded path: one process, dp=2, tp=2 (CPU, gloo).

Packed engines (``packing="on"``: one row per micro-batch through the varlen SDPA attention)
and padded engines (``packing="off"``: HF's SDPA with a padding mask) start from the same
weights; their log-probs, entropies, values, losses and updated weights must agree on
left- and right-padded batches whose sequence lengths differ by an order of magnitude.
The distributed cases run packed engines in 2 spawned ranks and compare them with the
single-process padded engine.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from train_engine_helpers import VOCAB, actor_loss, build_model, critic_loss

from rlflow.engine.attention import VARLEN_SDPA
from rlflow.engine.optim import OptimConfig
from rlflow.engine.train_engine import EngineConfig, TrainEngine
from rlflow.rendezvous import free_port

torch.set_num_threads(1)

LENGTHS = [2, 31, 5, 17, 9, 26, 3, 12]
SEQ = 32
CASES = [("llama", "lm", "left"), ("llama", "lm", "right"), ("qwen2", "lm", "left"), ("qwen2", "lm", "right")]
CASES += [("llama", "value", "left"), ("llama", "value", "right")]
# (name, dp, tp, case): the packed engines of the spawned ranks, each against the padded single process.
DISTRIBUTED = [("dp2", 2, 1, ("qwen2", "lm", "left")), ("tp2", 1, 2, ("llama", "value", "right"))]


def make_spread_batch(padding: str, seed: int = 3) -> dict[str, torch.Tensor]:
    """Rows of :data:`LENGTHS` valid tokens, padded on one side; the last two thirds are the response."""
    g = torch.Generator().manual_seed(seed)
    rows = len(LENGTHS)
    mask = torch.zeros(rows, SEQ, dtype=torch.long)
    response = torch.zeros(rows, SEQ, dtype=torch.long)
    for r, n in enumerate(LENGTHS):
        start = SEQ - n if padding == "left" else 0
        mask[r, start : start + n] = 1
        response[r, start + n // 3 : start + n] = 1
    return {
        "input_ids": torch.randint(1, VOCAB, (rows, SEQ), generator=g) * mask,
        "attention_mask": mask,
        "response_mask": response,
        "advantages": torch.randn(rows, SEQ, generator=g) * response,
        "old_log_probs": -4.5 + 0.1 * torch.randn(rows, SEQ, generator=g),
        "returns": torch.randn(rows, SEQ, generator=g) * response,
    }


def run_engine(mesh: DeviceMesh, case: tuple[str, str, str], packing: str, rows: slice = slice(None)) -> dict:
    """Forward, then one train step (2 micro-batches, gradient checkpointing), on ``rows`` of the batch."""
    family, head, padding = case
    # AdamW's first step is lr * g / (|g| + eps): with the default eps=1e-8 a near-zero gradient
    # entry moves its weight by anything in [-lr, lr] depending on fp32 rounding alone. eps=1e-4
    # keeps the step a smooth function of the gradient (slope <= lr / eps = 10), so comparing
    # weights at 1e-5 compares the packed and padded gradients.
    config = EngineConfig(
        optim=OptimConfig(lr=1e-3, eps=1e-4, max_grad_norm=1.0),
        device="cpu",
        packing=packing,
        num_micro_batches=2,
        gradient_checkpointing=True,
    )
    engine = TrainEngine(build_model(family, head=head, seed=5), mesh, config)
    assert engine.packing == (packing == "on")
    # rlflow's attention function: for packed rows, and for the fused causal kernel (fused_cpu_ops, on by default)
    assert engine.hf_config._attn_implementation == (VARLEN_SDPA if packing == "on" or config.fused_cpu_ops else "sdpa")
    batch = {k: v[rows] for k, v in make_spread_batch(padding).items()}
    forward = engine.forward(batch)
    loss_fn = critic_loss if head == "value" else actor_loss
    metrics = engine.train_step(batch, loss_fn, loss_mask_key="response_mask")
    return {"forward": forward, "metrics": metrics, "state": engine.state_dict_full()}


@pytest.fixture(scope="module")
def padded_results(single_mesh) -> dict:
    """The padded single-process engine's results, computed once per case."""
    cache: dict = {}

    def get(case):
        if case not in cache:
            cache[case] = run_engine(single_mesh, case, "off")
        return cache[case]

    return get


def assert_same_results(got: dict, want: dict, what: str) -> None:
    for key, value in want["forward"].items():
        torch.testing.assert_close(got["forward"][key], value, atol=1e-5, rtol=1e-5, msg=f"{what}: {key}")
    assert got["metrics"]["loss"] == pytest.approx(want["metrics"]["loss"], abs=1e-5), what
    assert got["metrics"]["grad_norm"] == pytest.approx(want["metrics"]["grad_norm"], rel=1e-5), what
    assert set(got["state"]) == set(want["state"])
    for key, value in want["state"].items():
        torch.testing.assert_close(got["state"][key], value, atol=1e-5, rtol=0, msg=f"{what}: weight {key}")


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_packed_engine_equals_padded_engine(single_mesh, padded_results, case) -> None:
    packed = run_engine(single_mesh, case, "on")
    padded = padded_results(case)
    assert_same_results(packed, padded, "-".join(case))
    assert padded["metrics"]["grad_norm"] > 1.0, "the step must exercise clipping"
    mask = make_spread_batch(case[2])["attention_mask"].bool()
    for value in packed["forward"].values():
        if value.shape == mask.shape:
            assert value[~mask].eq(0).all(), "padding positions hold 0"


# ---------------------------------------------------------------- spawned ranks
def _worker(rank: int, port: int, outdir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for name, dp, tp, case in DISTRIBUTED:
            mesh = DeviceMesh("cpu", torch.arange(2).reshape(1, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
            dp_rank = mesh.get_coordinate()[1]
            rows = torch.arange(len(LENGTHS)).chunk(dp)[dp_rank]
            result = run_engine(mesh, case, "on", rows)
            if mesh.get_coordinate()[2] == 0:
                torch.save(result, os.path.join(outdir, f"{name}_{dp_rank}.pt"))
        _pipeline_checks(rank, outdir)
    finally:
        dist.destroy_process_group()


def _pipeline_checks(rank: int, outdir: str) -> None:
    """pp=2: packing='on' is refused; a value model's train step raises no FSDP view warning."""
    mesh = DeviceMesh("cpu", torch.arange(2).reshape(2, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    try:
        TrainEngine(build_model(head="value"), mesh, EngineConfig(device="cpu", packing="on"))
        refused = ""
    except ValueError as err:
        refused = str(err)
    engine = TrainEngine(build_model(head="value"), mesh, EngineConfig(device="cpu", num_micro_batches=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.train_step(make_spread_batch("left"), critic_loss, loss_mask_key="response_mask")
    messages = [str(w.message) for w in caught]
    torch.save({"refused": refused, "warnings": messages}, os.path.join(outdir, f"pp2_{rank}.pt"))


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> str:
    outdir = str(tmp_path_factory.mktemp("packing"))
    port = free_port()
    torch.multiprocessing.spawn(_worker, args=(port, outdir), nprocs=2, join=True)
    return outdir


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "dp", "tp", "case"), DISTRIBUTED, ids=[d[0] for d in DISTRIBUTED])
def test_packed_engine_under_dp_and_tp_equals_padded_single_process(spawned, padded_results, name, dp, tp, case):
    parts = [torch.load(os.path.join(spawned, f"{name}_{d}.pt")) for d in range(dp)]
    forward = {k: torch.cat([p["forward"][k] for p in parts]) for k in parts[0]["forward"]}
    for p in parts[1:]:  # every dp rank reports the same metrics
        assert p["metrics"] == pytest.approx(parts[0]["metrics"])
    packed = {"forward": forward, "metrics": parts[0]["metrics"], "state": parts[0]["state"]}
    assert_same_results(packed, padded_results(case), name)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_pipeline_refuses_packing_and_value_heads_return_no_views(spawned) -> None:
    for rank in range(2):
        result = torch.load(os.path.join(spawned, f"pp2_{rank}.pt"))
        assert "packing='on' is not supported with pp=2" in result["refused"]
        assert not [m for m in result["warnings"] if "view tensor" in m], result["warnings"]
