"""The distillation teacher in the planner: a frozen model whose call is placed and priced like the
reference's, its weights counted in the memory model; ``rlflow plan --algo distill --teacher``."""

from __future__ import annotations

from rlflow.cli import main
from rlflow.planner.model_spec import model_preset
from rlflow.trainer.build import build_dataflow
from rlflow.trainer.config import load_config
from rlflow.trainer.placement import plan_placement

DISTILL = ["algorithm.name=distill", "models.teacher.init=tiny", "placement.mode=heuristic"]


def plan(teacher: str, overrides: tuple[str, ...] = ()):
    cfg = load_config(None, [*DISTILL, *overrides])
    cfg.placement.devices_per_node = 8
    specs = {"actor": model_preset("llama2-7b"), "teacher": model_preset(teacher)}
    placement = plan_placement(cfg, build_dataflow(cfg, rule_reward=True), specs, use_gpu=True, progress=False)
    return {c.name: c for c in placement.plan.calls}, placement


def test_the_teacher_call_is_placed_and_its_weights_counted():
    small, _ = plan("llama2-7b")
    large, placement = plan("llama2-70b")
    assert set(large) == {"actor_gen", "teacher_inf", "actor_train"} and placement.plan.fits
    call = large["teacher_inf"]
    assert call.model == "teacher" and call.time_s > 0
    # 70B bf16 weights spread over the call's devices at most: the device holding them holds at least its share.
    assert call.memory_bytes >= 70e9 * 2 / call.mesh.size
    assert call.memory_bytes > small["teacher_inf"].memory_bytes and call.time_s > small["teacher_inf"].time_s
    assert not next(m for m in placement.problem.models if m.name == "teacher").trainable


def test_rlflow_plan_takes_a_teacher_preset(capsys):
    argv = "plan --algo distill --actor llama2-7b --teacher llama2-13b --devices-per-node 4 --batch 64 --gen-len 128"
    assert main([*argv.split(), "--no-progress", "--search-steps", "200", "--chains", "1"]) == 0
    table = capsys.readouterr().out.split("plan search")[0]
    row = next(line for line in table.splitlines() if line.startswith("teacher_inf "))
    assert row.split()[1] == "teacher"


def test_the_teachers_whole_distributions_are_priced_by_the_vocabulary():
    def edge_seconds(overrides: tuple[str, ...]) -> float:
        _, placement = plan("llama2-7b", overrides)
        problem = placement.problem
        edge = (problem.mfc_names.index("teacher_inf"), problem.mfc_names.index("actor_train"))
        return float(problem.data_time[problem.data_edges.index(edge)].seconds.max())

    sampled = edge_seconds(())
    full = edge_seconds(("algorithm.distill_loss=full_vocab",))
    # One fp32 per token becomes 32000 (llama2's vocabulary) plus the per-token log-prob: far slower.
    assert full > 1000 * sampled
