"""The ``rlflow`` command line: plan end to end, draw, profile wiring, and errors naming allowed values."""

from __future__ import annotations

import pytest

from rlflow.cli import main
from rlflow.planner.plan import ExecutionPlan
from rlflow.planner.profile import HardwareProfile, MachineProfile, ProfiledLayer

PLAN = (
    "plan --algo ppo --actor llama2-7b --nodes 1 --devices-per-node 4 --batch 64 --prompt-len 128 --gen-len 128".split()
)


def test_plan_prints_the_table_and_baselines_and_writes_json_and_timeline(tmp_path, capsys):
    out, timeline = tmp_path / "plan.json", tmp_path / "plan.svg"
    argv = PLAN + [
        "--search-steps",
        "300",
        "--chains",
        "2",
        "--no-progress",
        "--out",
        str(out),
        "--timeline",
        str(timeline),
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    plan = ExecutionPlan.load(out)
    assert [c.name for c in plan.calls] == [
        "actor_gen",
        "critic_inf",
        "ref_inf",
        "reward_inf",
        "actor_train",
        "critic_train",
    ]
    assert plan.fits and plan.iteration_time_s > 0
    for name in ("actor_gen", "critic_train", "estimated time per iteration", "heuristic", "colocated", "split"):
        assert name in text
    searched = next(line for line in text.splitlines() if line.startswith("search "))
    assert searched.split()[-1] == "1.00x"
    for line in text.splitlines():  # every feasible baseline is at least as slow as the searched plan
        if line.split()[:1] in (["heuristic"], ["colocated"], ["split"]) and "infeasible" not in line:
            assert float(line.split()[-1].rstrip("x")) >= 1.0
    assert timeline.read_text().lstrip().startswith("<?xml")
    # A fixed seed and step count give the same plan again.
    assert main(argv) == 0 and ExecutionPlan.load(out) == plan


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--algo", "ppo2"], "unknown algorithm 'ppo2'; expected one of ['distill', 'dpo', 'grpo'"),
        (["--critic", "llama2-8b"], "--critic: unknown model preset 'llama2-8b'; expected one of ['llama2-13b'"),
        (["--device", "tpu"], "--device: unknown cluster preset 'tpu'; expected one of ('a100-80g'"),
    ],
)
def test_plan_errors_name_the_allowed_values(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(PLAN + args + ["--search-steps", "10"])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_draw_writes_the_dataflow_graph(tmp_path, capsys):
    assert main(["draw", "--algo", "grpo", "--out", str(tmp_path / "g.png")]) == 0
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit):
        main(["draw", "--algo", "nope", "--out", str(tmp_path / "g.png")])
    assert "expected one of" in capsys.readouterr().err


def test_profile_passes_its_arguments_and_reports(tmp_path, monkeypatch, capsys):
    seen = {}

    def fake_run_profile(path, device):  # the measurement itself is tested with the profiler
        seen.update(path=path, device=device)
        hardware = HardwareProfile(1.0e11, 5e9, 1e9, 1e-5, 8e9)
        layer = ProfiledLayer(64, 128, 4, 4, vocab_size=32)
        return MachineProfile("host", "cpu", "float32", hardware, layer, (), (), (), elapsed_s=1.5)

    monkeypatch.setattr("rlflow.workers.profiling.run_profile", fake_run_profile)
    assert main(["profile", "--out", str(tmp_path / "p.json"), "--device", "cpu"]) == 0
    assert seen == {"path": tmp_path / "p.json", "device": "cpu"}
    assert "matmul_flops: 1e+11" in capsys.readouterr().out
