"""Start-up: the machine profile cached per host and shape, a search budget that fits the problem,
and the ``startup/*`` breakdown a run logs with its first step."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from recipe_helpers import TINY

from rlflow.planner.model_spec import ModelSpec
from rlflow.planner.profile import (
    BatchTiming,
    CallTimings,
    HardwareProfile,
    LayerTiming,
    MachineProfile,
    ProfiledLayer,
    RolloutTiming,
    load_profile,
    save_profile,
)
from rlflow.planner.search import num_plans, plan_search, search
from rlflow.trainer import Trainer, load_config
from rlflow.trainer.build import build_dataflow
from rlflow.trainer.placement import load_profile_for, plan_placement, planning_cluster
from rlflow.workers import profiling

GRPO = Path(__file__).parents[2] / "recipes" / "grpo_arithmetic.yaml"
STAGES = ("construct_s", "worker_imports_s", "ray_s", "profile_s", "plan_s", "workers_s", "first_step_s")

# A synthetic CPU profile: planning with it needs no measurement.
_TIMINGS = (LayerTiming(1, 16, 1e-3), LayerTiming(4, 64, 5e-3))
PROFILE = MachineProfile(
    "h",
    "cpu",
    "float32",
    HardwareProfile(2e10, 1e10, 5e8, 4e-5, 16e9, collective_latency_s=2e-3),
    ProfiledLayer(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4, vocab_size=32),
    forward=_TIMINGS,
    backward=_TIMINGS,
    decode=_TIMINGS,
)
SHAPES = {"layer": {"hidden_size": 64}, "passes": ((1, 64), (4, 128)), "decodes": ((1, 128),)}


@pytest.fixture
def measurements(tmp_path, monkeypatch) -> list[dict]:
    """The cache in ``tmp_path/cache``, and ``run_profile`` replaced by one that writes
    :data:`PROFILE` where it is asked to; the list of the shapes it was asked to measure."""
    monkeypatch.setenv("RLFLOW_CACHE_DIR", str(tmp_path / "cache"))
    asked: list[dict] = []

    def run_profile(path, device, progress, **shapes):
        assert device == "cpu"
        asked.append(shapes)
        save_profile(PROFILE, path)
        return PROFILE

    monkeypatch.setattr(profiling, "run_profile", run_profile)
    return asked


def test_a_profile_is_measured_once_per_host_and_shape(tmp_path, measurements):
    first = profiling.cached_profile(SHAPES, progress=False)
    assert not first.cached and first.path.parent == tmp_path / "cache" / "profiles"
    again = profiling.cached_profile(SHAPES, progress=False)
    assert again.cached and again.path == first.path and again.profile == PROFILE and len(measurements) == 1
    other = profiling.cached_profile({**SHAPES, "passes": ((2, 64),)}, progress=False)
    assert not other.cached and other.path != first.path and len(measurements) == 2
    refreshed = profiling.cached_profile(SHAPES, refresh=True, progress=False)
    assert not refreshed.cached and len(measurements) == 3


def _with_calls(host_seconds: float) -> MachineProfile:
    """:data:`PROFILE` with whole calls: each kind 1 s on one thread, ``host_seconds`` on every core."""

    def timings(seconds: float, processes: int) -> dict:
        rollout = RolloutTiming(prompts=2, prompt_len=8, n=4, gen_len=8, seconds=seconds, processes=processes, dp=1)
        batch = BatchTiming(rows=8, seq=16, seconds=seconds, processes=processes, dp=1)
        return {"generate": rollout, "forward": batch, "train": batch}

    model = ModelSpec(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4, vocab_size=32)
    busy, alone, host = timings(1.0, 2), timings(1.0, 1), timings(host_seconds, 1)
    calls = CallTimings(
        model=model, **busy, **{f"{k}_alone": v for k, v in alone.items()}, **{f"{k}_host": v for k, v in host.items()}
    )
    return replace(PROFILE, calls=calls)


def test_a_profile_measured_while_other_work_held_the_cores_is_used_but_not_cached(tmp_path, monkeypatch):
    """A second thread that waits for a busy core makes every-core calls slower than one thread: such a
    profile prices this run but is not kept, so the next run measures again (on a quiet host, once)."""
    monkeypatch.setenv("RLFLOW_CACHE_DIR", str(tmp_path / "cache"))
    measured = iter([_with_calls(host_seconds=5.0), _with_calls(host_seconds=0.6)])

    def run_profile(path, device, progress, **shapes):
        profile = next(measured)
        save_profile(profile, path)
        return profile

    monkeypatch.setattr(profiling, "run_profile", run_profile)
    with pytest.warns(UserWarning, match=r"other work held its cores \(generate on every core ran 5.0x slower"):
        busy = profiling.cached_profile(SHAPES, progress=False)
    assert not busy.cached and not busy.path.exists() and busy.profile.calls.host_speedup("train") == 0.2
    quiet = profiling.cached_profile(SHAPES, progress=False)  # measured again, and kept
    assert not quiet.cached and quiet.path.exists() and profiling.busy_host(quiet.profile) is None
    assert profiling.cached_profile(SHAPES, progress=False).cached


@pytest.mark.parametrize(
    ("content", "reason"),
    [("{", "not JSON"), (json.dumps({**json.loads(PROFILE.to_json()), "version": 0}), "version 0")],
)
def test_an_unreadable_cached_profile_is_measured_again_with_a_warning(measurements, content, reason):
    path = profiling.cached_profile(SHAPES, progress=False).path
    path.write_text(content)  # a file cut short, or one of another format
    with pytest.warns(UserWarning, match=f"cached profile {path} is unusable \\({reason}.*measuring again"):
        found = profiling.cached_profile(SHAPES, progress=False)
    assert not found.cached and len(measurements) == 2 and load_profile(path) == PROFILE


def test_a_run_records_the_profile_it_planned_with_and_says_where_it_came_from(tmp_path, measurements, caplog):
    caplog.set_level(logging.INFO, logger="rlflow")
    cfg = load_config(GRPO, [*TINY, "placement.profile=true"])
    runs = [tmp_path / "a", tmp_path / "b"]
    found = [load_profile_for(cfg, False, run, None) for run in runs]
    assert [f.cached for f in found] == [False, True] and len(measurements) == 1
    assert all(load_profile(run / "profile.json") == PROFILE for run in runs)
    out = caplog.text
    assert f"cached at {found[0].path}" in out and f"reusing {found[0].path}" in out
    assert "placement.profile_cache=false" in out
    remeasure = load_config(GRPO, [*TINY, "placement.profile=true", "placement.profile_cache=false"])
    assert not load_profile_for(remeasure, False, tmp_path / "c", None).cached and len(measurements) == 2
    assert load_profile_for(cfg, True, tmp_path / "d", None) is None  # GPUs: priced from the presets


def test_two_cpu_workers_plan_by_evaluating_their_few_plans_and_find_the_full_searchs_plan(caplog):
    caplog.set_level(logging.INFO, logger="rlflow")
    cfg = load_config(GRPO, [*TINY, "placement.mode=auto", "placement.devices_per_node=2"])
    actor = ModelSpec(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4, vocab_size=32)
    graph = build_dataflow(cfg, rule_reward=True)
    placement = plan_placement(cfg, graph, {"actor": actor}, use_gpu=False, profile=PROFILE, progress=False)
    problem = placement.problem
    quick = plan_search(problem, max_seconds=cfg.placement.search_seconds, seed=cfg.seed, progress=False)
    assert quick.method == "exhaustive" and quick.steps == num_plans(problem) <= 100
    assert f"every one of {quick.steps} plans" in caplog.text  # the planner reports it
    full = search(problem, max_steps=20_000, seed=cfg.seed, progress=False)  # no early stop
    assert full.steps >= 20_000 and quick.cost == pytest.approx(full.cost, rel=1e-12)
    assert placement.plan.iteration_time_s == pytest.approx(quick.result.iteration_time_s, rel=1e-12)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_start_up_is_logged_once_and_a_second_run_reuses_the_cached_profile(ray_session, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RLFLOW_CACHE_DIR", str(tmp_path / "cache"))
    # other jobs on the host would make the profile look measured on a busy host, which is not cached
    # (test_a_profile_measured_while_other_work_held_the_cores_*): here the cache itself is under test
    monkeypatch.setattr(profiling, "busy_host", lambda profile: None)
    overrides = [*TINY, "warmup.steps=0", "placement.profile=true"]
    first = Trainer(load_config(GRPO, [*overrides, f"logging.dir={tmp_path / 'a'}"]), progress_bars=False)
    try:
        first.fit()
    finally:
        first.close()
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    startup = [r for r in records if any(k.startswith("startup/") for k in r)]
    assert len(startup) == 1 and startup[0]["step"] == 1  # once, with the first step
    logged = {k.removeprefix("startup/"): v for k, v in startup[0].items() if k.startswith("startup/")}
    assert logged.keys() == {*STAGES, "profile_cached", "worker_in_driver"} and all(v >= 0 for v in logged.values())
    assert logged["profile_cached"] == 0.0 and logged["first_step_s"] >= logged["profile_s"]
    assert logged["worker_in_driver"] == 0.0  # this session's Ray is running: auto keeps to Ray workers
    caplog.clear()
    second = Trainer(load_config(GRPO, [*overrides, f"logging.dir={tmp_path / 'b'}"]), progress_bars=False)
    try:
        second.launch()
        assert second.startup["startup/profile_cached"] == 1.0
    finally:
        second.close()
    assert "profile: reusing" in caplog.text
    assert (tmp_path / "b" / "profile.json").read_text() == (tmp_path / "a" / "profile.json").read_text()


def test_without_a_profile_the_hardware_rates_are_measured_once_per_host(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFLOW_CACHE_DIR", str(tmp_path))
    measured: list[HardwareProfile] = []

    def measure_hardware():
        measured.append(PROFILE.hardware)
        return PROFILE.hardware

    monkeypatch.setattr(profiling, "measure_hardware", measure_hardware)
    cfg = load_config(GRPO, [*TINY, "placement.devices_per_node=2"])
    clusters = [planning_cluster(cfg, use_gpu=False, profile=None) for _ in range(2)]
    assert len(measured) == 1 and clusters[0] == clusters[1]
    assert clusters[0].collective_latency_s == PROFILE.hardware.collective_latency_s
    [path] = (tmp_path / "profiles").iterdir()
    path.write_text('{"version": 1, "hardware": {"matmul_flops": 1.0}}')  # a field missing
    with pytest.warns(UserWarning, match=f"cached hardware rates {path} are unusable .*missing fields"):
        assert profiling.profile_or_measure() == PROFILE.hardware
    assert len(measured) == 2 and profiling.profile_or_measure() == PROFILE.hardware and len(measured) == 2
    remeasure = load_config(GRPO, [*TINY, "placement.profile_cache=false"])
    planning_cluster(remeasure, use_gpu=False, profile=None)
    assert len(measured) == 3


def test_workers_start_only_for_the_ranks_a_one_node_plan_uses():
    from rlflow.trainer.build import worker_ranks

    two = load_config(None, ["placement.devices_per_node=2"])
    assert worker_ranks(two, (0,)) == (0,)
    assert worker_ranks(two, (0, 1)) == (0, 1)
    assert worker_ranks(two, (1,)) == (0, 1)  # rank 1 alone: ranks keep their ids, so the pool stays whole
    multi = load_config(None, ["placement.devices_per_node=1", "placement.num_nodes=2"])
    assert worker_ranks(multi, (0,)) == (0, 1)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_plan_on_one_of_two_devices_starts_one_worker(ray_session, tmp_path):
    one = ["placement.mode=manual", "placement.devices_per_node=2", "placement.manual.actor_train.mesh.num_devices=1"]
    one += ["placement.manual.actor_gen.mesh.num_devices=1"]
    trainer = Trainer(
        load_config(GRPO, [*TINY, *one, "warmup.steps=0", f"logging.dir={tmp_path}"]), progress_bars=False
    )
    try:
        result = trainer.fit()
        assert len(trainer.workers.ranks) == 1 and trainer.placement.used_ranks == (0,)
        assert result.steps == 1 and len(result.eval_history) == 2
    finally:
        trainer.close()


def test_the_driver_imports_no_worker_engine_or_hf_modeling_code_before_a_launch():
    # A fresh process with the modules a construction loads: the families name their HF classes by
    # import path and the worker class is imported by the launch, so what only builds and plans a run
    # leaves HF's modeling_utils and the engines to the processes that build models.
    script = (
        "import json, sys; from rlflow.trainer import build, config, data, inputs, metrics, placement, runner; "
        "print(json.dumps(sorted(m for m in ('transformers.modeling_utils', 'rlflow.workers.model_worker', "
        "'rlflow.engine.train_engine') if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
