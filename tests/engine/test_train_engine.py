"""The training engine under (dp, tp, pp) strategies equals a single process (CPU, gloo).

One ``torch.multiprocessing.spawn`` of 4 ranks runs every strategy: each round builds the
sub-meshes of its jobs on all ranks (mesh construction is collective), two 2-rank jobs run
side by side or one 4-rank job runs, and each job writes what it computed to a file. The
tests compare those files with a single-process reference: plain HF forward, token-mean
loss over the global mini-batch, ``clip_grad_norm_`` and ``torch.optim.AdamW``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch
from train_engine_helpers import (
    ADAM_EPS,
    LR,
    actor_loss,
    build_model,
    critic_loss,
    local_batch,
    make_batch,
    reference_outputs,
    reference_train,
)

from rlflow.rendezvous import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

WORLD = 4
NUM_MINI_BATCHES = 2


@dataclass(frozen=True)
class Job:
    name: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    family: str = "llama"
    tied: bool = False
    head: str = "lm"
    engine: dict = field(default_factory=dict)
    max_grad_norm: float = 1.0
    save_pretrained: bool = False
    checkpoint: bool = False

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp


ROUNDS: list[list[Job]] = [
    [
        Job("dp2", dp=2, engine={"num_micro_batches": 2}, checkpoint=True),
        Job("tp2_packed", tp=2, engine={"packing": "on"}),
    ],
    [
        Job("pp2_1f1b", pp=2, engine={"num_micro_batches": 2, "pp_schedule": "1f1b"}),
        Job("tp2_qwen2_tied", tp=2, family="qwen2", tied=True),
    ],
    [
        Job(
            "pp2_tied_gpipe",
            pp=2,
            tied=True,
            engine={"num_micro_batches": 3, "pp_schedule": "gpipe"},
            save_pretrained=True,
        ),
        Job("dp2_critic_packed", dp=2, head="value", engine={"packing": "on", "num_micro_batches": 2}),
    ],
    [
        Job(
            "dp2_tp2_ac",
            dp=2,
            tp=2,
            max_grad_norm=0.5,
            engine={"gradient_checkpointing": True, "max_tokens_per_micro_batch": 12},
        )
    ],
    [Job("tp2_pp2", tp=2, pp=2, engine={"num_micro_batches": 2}, save_pretrained=True)],
    # Middle stages, and the tied-embedding gradient group between stages 0 and 3.
    [Job("pp4_tied", pp=4, tied=True, engine={"num_micro_batches": 4})],
    # Model types of the generic family (read from the HF model): under dp and pp, q/k norms over
    # the projections (OLMo 2), fused qkv and gate/up projections (Phi-3).
    [Job("dp2_olmo2", dp=2, family="olmo2"), Job("dp2_phi3_packed", dp=2, family="phi3", engine={"packing": "on"})],
    [
        Job("pp2_olmo2_1f1b", pp=2, family="olmo2", engine={"num_micro_batches": 2, "pp_schedule": "1f1b"}),
        Job("pp2_phi3_tied", pp=2, family="phi3", tied=True, engine={"num_micro_batches": 2}),
    ],
    # ... and tp where the config's base_model_tp_plan is Megatron's: Gemma (its scaled embedding,
    # four norms a layer), Starcoder2 (biased c_fc/c_proj MLP, LayerNorms with biases).
    [Job("tp2_gemma_tied", tp=2, family="gemma", tied=True), Job("tp2_starcoder2", tp=2, family="starcoder2")],
]
JOBS = {job.name: job for round_ in ROUNDS for job in round_}


def _make_engine(job: Job, mesh, seed: int = 0):
    from rlflow.engine.optim import OptimConfig
    from rlflow.engine.train_engine import EngineConfig, TrainEngine

    optim = OptimConfig(lr=LR, eps=ADAM_EPS, max_grad_norm=job.max_grad_norm)
    config = EngineConfig(optim=optim, device="cpu", **job.engine)
    return TrainEngine(build_model(job.family, tied=job.tied, head=job.head, seed=seed), mesh, config)


def _run_job(job: Job, mesh, outdir: str) -> None:
    pp_rank, dp_rank, tp_rank = mesh.get_coordinate()
    batch = local_batch(make_batch(), dp_rank, job.dp)
    loss_fn = critic_loss if job.head == "value" else actor_loss
    engine = _make_engine(job, mesh)
    out = engine.forward(batch)
    if out is not None and tp_rank == 0:
        torch.save(out, os.path.join(outdir, f"{job.name}_forward_dp{dp_rank}.pt"))
    if job.checkpoint:
        # Resume check: a step taken after load_checkpoint equals the step taken without the round trip.
        ckpt = os.path.join(outdir, f"{job.name}_ckpt")
        engine.train_step(batch, loss_fn, num_mini_batches=1, loss_mask_key="response_mask")
        engine.save_checkpoint(ckpt)
        engine.train_step(batch, loss_fn, num_mini_batches=1, loss_mask_key="response_mask")
        expected = engine.state_dict_full()
        resumed = _make_engine(job, mesh, seed=7)
        resumed.load_checkpoint(ckpt)
        resumed.train_step(batch, loss_fn, num_mini_batches=1, loss_mask_key="response_mask")
        got = resumed.state_dict_full()
        if got is not None:
            diff = max(float((got[k] - expected[k]).abs().max()) for k in expected)
            torch.save({"max_diff": diff, "step": resumed.global_step}, os.path.join(outdir, f"{job.name}_resume.pt"))
        engine = _make_engine(job, mesh)
    metrics = engine.train_step(batch, loss_fn, num_mini_batches=NUM_MINI_BATCHES, loss_mask_key="response_mask")
    state = engine.state_dict_full()
    if state is not None:
        torch.save({"metrics": metrics, "state": state}, os.path.join(outdir, f"{job.name}_train.pt"))
    if job.save_pretrained:
        path = os.path.join(outdir, f"{job.name}_hf")
        engine.save_pretrained(path)
        # Every rank loads the saved full weights into a differently initialised engine.
        from safetensors.torch import load_file

        fresh = _make_engine(job, mesh, seed=7)
        fresh.load_state_dict_full(load_file(os.path.join(path, "model.safetensors")))
        want, got = engine.forward(batch), fresh.forward(batch)
        if got is not None and tp_rank == 0 and dp_rank == 0:
            diff = max(float((got[k] - want[k]).abs().max()) for k in want)
            torch.save({"max_diff": diff}, os.path.join(outdir, f"{job.name}_reload.pt"))


def _worker(rank: int, port: int, outdir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        for round_ in ROUNDS:
            start, meshes = 0, []
            for job in round_:  # every rank builds every mesh of the round: the construction is collective
                ranks = torch.arange(start, start + job.size).reshape(job.pp, job.dp, job.tp)
                meshes.append(DeviceMesh("cpu", ranks, mesh_dim_names=("pp", "dp", "tp")))
                start += job.size
            for job, mesh in zip(round_, meshes):
                if mesh.get_coordinate() is not None:
                    _run_job(job, mesh, outdir)
            dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> str:
    outdir = str(tmp_path_factory.mktemp("engine"))
    torch.multiprocessing.spawn(_worker, args=(free_port(), outdir), nprocs=WORLD, join=True)
    return outdir


def _reference(job: Job) -> tuple[torch.nn.Module, dict, dict, float, float]:
    batch = make_batch()
    model = build_model(job.family, tied=job.tied, head=job.head)
    model.eval()
    with torch.no_grad():
        before = reference_outputs(model, batch)
    loss, norm = reference_train(
        model, batch, dp=job.dp, num_mini_batches=NUM_MINI_BATCHES, max_grad_norm=job.max_grad_norm
    )
    return model, batch, before, loss, norm


def _forward(outdir: str, job: Job) -> dict[str, torch.Tensor]:
    parts = [torch.load(os.path.join(outdir, f"{job.name}_forward_dp{d}.pt")) for d in range(job.dp)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


@pytest.mark.parametrize("name", list(JOBS))
def test_strategy_matches_single_process(results: str, name: str) -> None:
    job = JOBS[name]
    model, batch, before, ref_loss, ref_norm = _reference(job)
    forward = _forward(results, job)
    for key, ref in before.items():
        ref = ref * batch["attention_mask"]  # the engine reports 0 at padding
        torch.testing.assert_close(forward[key], ref, atol=1e-5, rtol=1e-5, msg=f"{name}: forward {key}")
    if job.head == "value":
        last = (batch["attention_mask"] * torch.arange(batch["attention_mask"].shape[1])).argmax(1)
        torch.testing.assert_close(
            forward["rewards"], before["values"][torch.arange(len(last)), last], atol=1e-5, rtol=0
        )
    trained = torch.load(os.path.join(results, f"{name}_train.pt"))
    assert trained["metrics"]["loss"] == pytest.approx(ref_loss, abs=1e-5)
    assert trained["metrics"]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    assert ref_norm > job.max_grad_norm, "the test must exercise clipping"
    reference = dict(model.state_dict())
    if job.tied:
        reference.pop("lm_head.weight")
    assert set(trained["state"]) == set(reference)
    for key, ref in reference.items():
        torch.testing.assert_close(trained["state"][key], ref, atol=1e-5, rtol=0, msg=f"{name}: weight {key}")


def test_checkpoint_resume_is_exact(results: str) -> None:
    resume = torch.load(os.path.join(results, "dp2_resume.pt"))
    assert resume["step"] == 2
    assert resume["max_diff"] == 0.0


@pytest.mark.parametrize("name", [n for n, j in JOBS.items() if j.save_pretrained])
def test_save_pretrained_loads_in_plain_transformers(results: str, name: str) -> None:
    from transformers import AutoModelForCausalLM

    job = JOBS[name]
    reload = torch.load(os.path.join(results, f"{name}_reload.pt"))
    assert reload["max_diff"] == 0.0, "load_state_dict_full of the saved weights must restore the engine exactly"
    model, batch, _, _, _ = _reference(job)
    loaded = AutoModelForCausalLM.from_pretrained(os.path.join(results, f"{name}_hf"))
    assert os.path.exists(os.path.join(results, f"{name}_hf", "model.safetensors"))
    if job.tied:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    loaded.eval()
    with torch.no_grad():
        got = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        want = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
