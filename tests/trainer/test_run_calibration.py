"""A run calibrated by its own calls (``placement.calibrate: run``): a new model shape starts from
the host's machine profile without timing its calls first, measures its calls on one thread and on
every core, caches the corrected profile for its shape, and keeps its plan on the faster thread
count or restarts on another plan, resuming where it was (a run in the driver, on Ray workers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from recipe_helpers import TINY
from safetensors.torch import load_file

from rlflow.planner.model_spec import ModelSpec
from rlflow.planner.profile import (
    BatchTiming,
    CallTimings,
    HardwareProfile,
    LayerTiming,
    MachineProfile,
    ProfiledLayer,
    RolloutTiming,
    cached_profile_path,
    load_profile,
    profile_cache_key,
    save_profile,
)
from rlflow.trainer import Trainer, calibration, load_config
from rlflow.trainer.placement import PROFILED_CALL, REFERENCE_MODEL, machine_profile_shapes, one_worker_on_every_core
from rlflow.workers import profiling

GRPO = Path(__file__).parents[2] / "recipes" / "grpo_arithmetic.yaml"
_T = (LayerTiming(1, 16, 1e-3), LayerTiming(4, 64, 5e-3))
_GEN = RolloutTiming(prompts=2, prompt_len=16, n=4, gen_len=16, seconds=0.05, processes=1, dp=1)
_BATCH = BatchTiming(rows=8, seq=32, seconds=0.05, processes=1, dp=1)


def _machine_profile(host_seconds: float, seconds: float = 0.05, collective_s: float = 2e-3) -> MachineProfile:
    """A synthetic machine profile whose reference calls run ``host_seconds`` on every core (``seconds``
    on one thread): above ``seconds`` a plan of one worker is priced on one thread. Its all-reduce
    takes ``collective_s``."""
    gen, batch, host = replace(_GEN, seconds=seconds), replace(_BATCH, seconds=seconds), {"seconds": host_seconds}
    calls = CallTimings(
        model=ModelSpec(**REFERENCE_MODEL),
        generate=gen, forward=batch, train=batch, generate_alone=gen, forward_alone=batch, train_alone=batch,
        generate_host=replace(gen, **host), forward_host=replace(batch, **host), train_host=replace(batch, **host),
    )  # fmt: skip
    return MachineProfile(
        "h", "cpu", "float32", HardwareProfile(2e10, 1e10, 5e8, 4e-5, 16e9, collective_latency_s=collective_s),
        ProfiledLayer(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4, vocab_size=32),
        forward=_T, backward=_T, decode=_T, calls=calls,
    )  # fmt: skip


@pytest.fixture
def machine(tmp_path, monkeypatch) -> list[dict]:
    """The cache in ``tmp_path/cache``; ``run_profile`` writes the synthetic machine profile (a plan
    of one worker priced on one thread); the list of what it was asked to measure."""
    monkeypatch.setenv("RLFLOW_CACHE_DIR", str(tmp_path / "cache"))
    asked: list[dict] = []

    def run_profile(path, device, progress, **shapes):
        asked.append(shapes)
        save_profile(_machine_profile(0.2), path)
        return _machine_profile(0.2)

    monkeypatch.setattr(profiling, "run_profile", run_profile)
    return asked


def _overrides(run_dir: Path, steps: int = 5) -> list[str]:
    return [
        *TINY, "warmup.steps=0", "data.eval_size=0", "trainer.eval_before_train=false", "trainer.eval_every=0",
        f"trainer.total_steps={steps}", "placement.devices_per_node=2",
        "placement.profile=true", "placement.calibrate=run", "placement.calibrate_steps=1", f"logging.dir={run_dir}",
    ]  # fmt: skip


def _fit(overrides: list[str]) -> tuple[Trainer, list[dict]]:
    trainer = Trainer(load_config(GRPO, overrides), progress_bars=False)
    try:
        trainer.fit()
    finally:
        trainer.close()
    run_dir = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("logging.dir=")))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return trainer, records


def _logged(records: list[dict], prefix: str) -> dict[str, float]:
    return {k: v for r in records for k, v in r.items() if k.startswith(prefix)}


def test_measured_speedups_replace_the_reference_models_in_pricing_a_plan_of_one_worker() -> None:
    cfg = load_config(GRPO, ["placement.devices_per_node=2", "placement.use_gpu=false"])
    from rlflow.trainer.build import build_dataflow
    from rlflow.trainer.placement import plan_placement

    spec = ModelSpec(num_layers=8, hidden_size=512, intermediate_size=1024, num_heads=8, num_kv_heads=8, vocab_size=64)
    placement = plan_placement(cfg, build_dataflow(cfg, rule_reward=True), {"actor": spec}, use_gpu=False)
    kinds = {"actor_gen": "generate", "actor_train": "train_step"}
    slow = _machine_profile(1.0).calls  # every core 20x slower than one thread
    args = (placement.problem, placement.plan, slow, kinds, 2)
    assert one_worker_on_every_core(*args) == (placement.plan, 1)
    fast, threads = one_worker_on_every_core(*args, {c: 50.0 for c in PROFILED_CALL.values()})
    assert threads == 2 and fast.iteration_time_s < placement.plan.iteration_time_s


def _two_worker_profile(**changes) -> MachineProfile:
    """``_machine_profile`` with its busy calls timed in two processes: calls on one device of the
    host are priced by its alone fits, calls on both by its busy fits."""
    prof = _machine_profile(0.2)
    two = {k: replace(getattr(prof.calls, k), processes=2) for k in ("generate", "forward", "train")}
    return replace(prof, calls=replace(prof.calls, **two), **changes)


def test_a_runs_correction_prices_the_calls_of_its_regime_times_it_and_no_others() -> None:
    """A correction measured on a plan of one worker scales the alone fits and one measured over
    the host's workers the busy fits; the fits themselves price the profiled calls as measured, so
    the factor is not divided out again (it was: a corrected profile priced every call as before)."""
    from rlflow.planner.cluster import cluster_preset
    from rlflow.planner.profile import ProfiledRates

    plain = _two_worker_profile()
    cluster = cluster_preset("cpu", 1, 2, profile=plain)
    rates = ProfiledRates.from_profile(plain, cluster)
    assert rates.alone_fits and rates.busy_fits
    alone = ProfiledRates.from_profile(_two_worker_profile(alone_corrections={"generate": 0.25}), cluster)
    busy = ProfiledRates.from_profile(_two_worker_profile(corrections={"generate": 4.0}), cluster)
    for kind in ("generate", "train_step"):
        factor = 0.25 if kind == "generate" else 1.0
        assert alone.call_scale(kind, 1) == pytest.approx(factor * rates.call_scale(kind, 1))
        assert alone.call_scale(kind, 2) == pytest.approx(rates.call_scale(kind, 2))
        assert busy.call_scale(kind, 1) == pytest.approx(rates.call_scale(kind, 1))
        assert busy.call_scale(kind, 2) == pytest.approx(4 ** (kind == "generate") * rates.call_scale(kind, 2))
    round_trip = MachineProfile.from_json(_two_worker_profile(alone_corrections={"generate": 0.25}).to_json())
    assert round_trip.alone_corrections == {"generate": 0.25} and round_trip.corrections is None


def test_a_one_worker_runs_calibration_corrects_the_alone_regime_and_prices_its_plan_at_what_it_measured(
    monkeypatch,
) -> None:
    """Calls measured on one worker of a two-core host correct the alone fits only: the plan made
    next prices the one-worker plan at its measured seconds, and a plan over both workers as before."""
    from rlflow.trainer.build import build_dataflow
    from rlflow.trainer.placement import plan_placement

    cfg = load_config(GRPO, ["placement.devices_per_node=2", "placement.use_gpu=false"])
    graph = build_dataflow(cfg, rule_reward=True)
    spec = ModelSpec(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4, vocab_size=32)
    profile = _two_worker_profile()
    placement = plan_placement(cfg, graph, {"actor": spec}, use_gpu=False, profile=profile, progress=False)
    assert placement.used_ranks == (0,) and all(c.mesh.num_devices == 1 for c in placement.plan.calls)
    estimated = placement.estimated_call_seconds()
    measured = {n: [9.0] + [s / 2] * 2 for n, s in estimated.items()}  # every call twice as fast as priced

    def decide(self, cfg, graph, placement, profile, phases, restart_s, step):
        return calibration.Decision(profile, None, False, "kept", {})

    monkeypatch.setattr(calibration.RunCalibration, "_decide", decide)
    run = calibration.RunCalibration(profile, (), {"actor": spec})
    run.begin(0, placement, steps=2, cores=1)
    decision = run.at(3, cfg, graph, placement, measured, restart_s=1.0)
    assert decision.profile.corrections is None
    assert decision.profile.alone_corrections == pytest.approx({"generate": 0.5, "train_step": 0.5})
    again = plan_placement(cfg, graph, {"actor": spec}, use_gpu=False, profile=decision.profile, progress=False)
    assert again.used_ranks == (0,)
    assert again.estimated_call_seconds() == pytest.approx({n: s / 2 for n, s in estimated.items()}, rel=0.05)


def test_a_measured_one_worker_plan_keeps_its_place_against_a_plan_priced_in_an_uncalibrated_regime(
    monkeypatch,
) -> None:
    """Once a run has measured the one-worker plan (its every-core speedups and its one-device
    corrections), the plan search's choice over several workers, priced by busy fits no run
    calibrated, must be estimated MEASURED_ONE_WORKER_MARGIN times faster to replace it; once the
    busy regime is calibrated too the two compare as estimated; a new shape explores one worker."""
    from rlflow.trainer import placement as placement_module
    from rlflow.trainer.build import build_dataflow

    cfg = load_config(GRPO, ["placement.devices_per_node=2", "placement.use_gpu=false"])
    graph = build_dataflow(cfg, rule_reward=True)
    spec = ModelSpec(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4, vocab_size=32)
    seen = []
    real = placement_module.one_worker_on_every_core

    def spy(*args, explore=1.0, why=""):
        seen.append(explore)
        return real(*args, explore=explore, why=why)

    monkeypatch.setattr(placement_module, "one_worker_on_every_core", spy)
    speedups = {"generate": 1.4, "forward": 1.5, "train": 1.5}
    measured = _two_worker_profile(host_speedups=speedups, alone_corrections={"generate": 1.3, "train_step": 0.9})
    for profile, calibrates, explore in (
        (_two_worker_profile(), True, placement_module.ONE_WORKER_EXPLORE),  # a shape new to the host
        (_two_worker_profile(), False, 1.0),
        (measured, False, placement_module.MEASURED_ONE_WORKER_MARGIN),
        (replace(measured, corrections={"generate": 1.1, "train_step": 1.0}), False, 1.0),  # both regimes measured
    ):
        seen.clear()
        placement_module.plan_placement(
            cfg, graph, {"actor": spec}, use_gpu=False, profile=profile, progress=False, calibrates=calibrates
        )
        assert seen == [explore]
    assert placement_module.MEASURED_ONE_WORKER_MARGIN > 1.0


def test_a_new_shape_starts_from_the_machine_profile_and_caches_what_its_calls_measured(tmp_path, machine) -> None:
    trainer, records = _fit(_overrides(tmp_path / "a"))
    assert len(machine) == 1 and machine[0]["calls"]["model"] == REFERENCE_MODEL  # no call of the run's model timed
    startup = _logged(records, "startup/")
    assert startup["startup/profile_cached"] == 0.0
    planner = _logged(records, "planner/")
    # phase 1 on one thread (the synthetic profile priced every core slower), phase 2 on both cores
    assert {"planner/correction_generate", "planner/correction_train_step"} <= planner.keys()
    assert {"planner/host_speedup_generate", "planner/host_speedup_train"} <= planner.keys()
    assert planner["planner/replanned"] == 0.0 and trainer.result.steps == 5
    speedups = {c: planner[f"planner/host_speedup_{c}"] for c in ("generate", "train")}
    assert trainer.placement.threads == int(planner["planner/threads"]) in (1, 2)
    cached = load_profile(tmp_path / "a" / "profile.json")
    assert cached.corrections.keys() >= {"generate", "train_step"}
    assert cached.host_speedups == pytest.approx(speedups)
    # the next run of the shape plans with the calibrated profile from step 1, and calibrates no more
    _, again = _fit(_overrides(tmp_path / "b"))
    assert len(machine) == 1 and _logged(again, "startup/")["startup/profile_cached"] == 1.0
    assert not _logged(again, "planner/") and load_profile(tmp_path / "b" / "profile.json") == cached


def test_a_later_run_calibrates_the_call_types_no_run_of_its_shape_measured(tmp_path, machine) -> None:
    """A run of a cached shape whose plan runs a call type in a regime without a run's correction
    (priced by the reference model's extrapolation) calibrates that regime by its own calls and caches
    it; the run after it calibrates no more."""
    _fit(_overrides(tmp_path / "a"))
    first = load_profile(tmp_path / "a" / "profile.json")
    (path,) = [p for p in (tmp_path / "cache").rglob("*.json") if load_profile(p) == first]
    save_profile(replace(first, corrections={"generate": first.corrections["generate"]}), path)
    _, records = _fit(_overrides(tmp_path / "b"))
    assert "planner/correction_train_step" in _logged(records, "planner/")
    assert load_profile(path).corrections.keys() >= {"generate", "train_step"}
    _, records = _fit(_overrides(tmp_path / "c"))
    assert not _logged(records, "planner/")


def test_the_call_types_a_plan_prices_without_a_runs_correction() -> None:
    from rlflow.trainer.build import build_dataflow
    from rlflow.trainer.placement import plan_placement

    cfg = load_config(GRPO, ["placement.devices_per_node=2", "placement.use_gpu=false"])
    graph = build_dataflow(cfg, rule_reward=True)
    spec = ModelSpec(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4, vocab_size=32)
    kinds = {"actor_gen": "generate", "actor_train": "train_step"}
    plain = _two_worker_profile()
    placement = plan_placement(cfg, graph, {"actor": spec}, use_gpu=False, profile=plain, progress=False)
    assert placement.used_ranks == (0,)  # every call on one device of the host: the alone regime
    assert calibration.uncalibrated_kinds(placement, kinds, plain) == ["generate", "train_step"]
    busy = replace(plain, corrections={"generate": 2.0, "train_step": 2.0})  # the other regime's
    assert calibration.uncalibrated_kinds(placement, kinds, busy) == ["generate", "train_step"]
    alone = replace(plain, alone_corrections={"train_step": 0.9})
    assert calibration.uncalibrated_kinds(placement, kinds, alone) == ["generate"]


def test_a_run_restarts_on_the_plan_its_calibration_takes_and_ends_as_one_that_kept_its_plan(
    tmp_path, machine, monkeypatch
) -> None:
    """A calibration that takes another layout (here, the same one-worker plan on the host's other
    device) checkpoints, restarts the workers on it and resumes: the run ends with the weights of a
    run that kept its plan, bit for bit."""
    decide = calibration.RunCalibration._decide

    def move_to_device_1(self, cfg, graph, placement, profile, phases, restart_s, step, restart=True):
        kept = decide(self, cfg, graph, placement, profile, phases, restart_s, step)
        if not restart:
            return replace(kept, placement=replace(placement, threads=1), restart=False)
        manual = [f"placement.manual.{c}.mesh.device_start=1" for c in placement.calls if c != "reward_inf"]
        moved = load_config(GRPO, [*_overrides(tmp_path / "x"), "placement.mode=manual", *manual])
        from rlflow.trainer.placement import plan_placement

        other = plan_placement(moved, graph, self.specs, use_gpu=False, profile=profile, progress=False)
        return replace(kept, placement=other, restart=True, message="moved to device 1")

    monkeypatch.setattr(calibration.RunCalibration, "_decide", move_to_device_1)
    moved, _ = _fit([*_overrides(tmp_path / "moved", steps=6), "checkpoint.keep_last=0"])
    assert (tmp_path / "moved" / "checkpoints" / "step_3").is_dir()  # saved at the calibration step
    assert all(c.ranks == (1,) for n, c in moved.placement.calls.items() if n != "reward_inf")
    monkeypatch.setattr(
        calibration.RunCalibration, "_decide", lambda self, *a: move_to_device_1(self, *a, restart=False)
    )
    (tmp_path / "cache").rename(tmp_path / "cache_moved")  # the kept run calibrates too
    kept, _ = _fit([*_overrides(tmp_path / "kept", steps=6), "checkpoint.keep_last=0"])
    weights = [load_file(tmp_path / run / "final" / "actor" / "model.safetensors") for run in ("moved", "kept")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


# ------------------------------------------------------------ a run in the driver, re-planned onto Ray workers
# A plan of one worker runs in the driver only while Ray is not running in its process (placement.worker_host:
# auto), so these runs get a process of their own: the session's shared Ray (ray_session) would host them.
# The driver-hosted worker's calls each take 1 s more on one thread and on two alike, or ("halve") 2 s more on one
# thread and 1 s on two: a host on which a second thread helps the run's model not at all, or twice (a margin over
# what a second thread costs a tiny model's own compute). A Ray worker imports its class afresh, unslowed.
SWITCH_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    import ray, torch
    from rlflow.trainer import Trainer
    from rlflow.workers.model_worker import ModelWorker

    recipe, overrides, halve = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "halve"
    threads = [torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")]
    run_call = ModelWorker._run_call

    def slow_call(self, mfc, inputs, run, step, rows):
        def slowed(*args):
            time.sleep(2.0 / torch.get_num_threads() if halve else 1.0)
            return run(*args)
        return run_call(self, mfc, inputs, slowed, step, rows)

    ModelWorker._run_call = slow_call
    hosts, trainer = {}, None

    def where(step, metrics):  # where each logged step ran
        hosts[step] = [trainer.workers.driver_hosted, ray.is_initialized(), list(trainer.placement.used_ranks)]

    with Trainer(recipe, overrides=overrides, progress_bars=False, callbacks=[where]) as trainer:
        result = trainer.fit()
        gen = trainer.placement.calls["actor_gen"]
    threads += [torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")]
    print(json.dumps({"hosts": sorted(hosts.items()), "steps": result.steps, "ray_after": ray.is_initialized(),
                      "gen": [list(gen.ranks), str(gen.strategy)], "threads": threads}))
    """
)  # fmt: skip
# Three heads and one layer: the planner's two-worker plans are data-parallel (no tp or pp divides them).
SWITCH_RUN = [
    *(f"models.actor.{o}" for o in ("hidden_size=48", "intermediate_size=96", "num_layers=1", "num_heads=3",
                                     "num_kv_heads=3", "lr=1e-2")),
    "algorithm.n_samples=2", "algorithm.entropy_coef=0.1",  # rewards are 0 this early: the bonus moves weights
    "data.batch_size=2", "data.eval_size=2", "warmup.steps=0", "trainer.eval_before_train=false",
    "trainer.eval_every=0", "placement.devices_per_node=2", "placement.search_seconds=0.5",
    "placement.calibrate_steps=1", "checkpoint.every_n_steps=0", "checkpoint.keep_last=0", "logging.console=false",
    "logging.tensorboard=false",
]  # fmt: skip


def _driver_hosted_run(tmp_path: Path, monkeypatch, steps: int, slowed: str) -> tuple[dict, list[dict]]:
    """A run of ``SWITCH_RUN`` in a process of its own (``SWITCH_SCRIPT``), planned from this host's
    cached machine profile: two workers priced a little faster than one on one thread, and one worker
    on both cores (a 1.25× speedup on every core) within ``ONE_WORKER_EXPLORE`` of them. Returns what
    the script printed and the run's metrics records."""
    monkeypatch.setenv("RLFLOW_CACHE_DIR", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    overrides = [*SWITCH_RUN, f"trainer.total_steps={steps}", f"logging.dir={run_dir}"]
    shapes = machine_profile_shapes(load_config(GRPO, overrides))
    path = cached_profile_path(profile_cache_key(profiling.host_identity("cpu"), shapes))
    save_profile(_machine_profile(0.4, seconds=0.5, collective_s=1e-4), path)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAY_ADDRESS")}
    out = subprocess.run(
        [sys.executable, "-c", SWITCH_SCRIPT, str(GRPO), json.dumps(overrides), slowed],
        cwd=GRPO.parents[1], env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return json.loads(out.stdout.strip().splitlines()[-1]), records


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_driver_hosted_run_whose_calibration_prices_two_workers_faster_resumes_on_them_under_ray(
    tmp_path, monkeypatch
) -> None:
    """Its calls no faster on two threads than on one, the calibration at step 3 prices the dp=2 plan
    cheaper: the run checkpoints there, starts Ray and resumes on two workers, and trains every
    remaining step once, its optimizer steps and weights going on from the checkpoint."""
    steps = 20  # the 17 after the switch save more than a restart costs
    found, records = _driver_hosted_run(tmp_path, monkeypatch, steps, "alike")
    in_driver, on_ray = [True, False, [0]], [False, True, [0, 1]]
    assert found["hosts"] == [[s, in_driver if s <= 3 else on_ray] for s in range(1, steps + 1)]
    assert found["gen"] == [[0, 1], "(dp=2,tp=1,pp=1)"] and found["steps"] == steps
    assert found["ray_after"] is False and found["threads"][:2] == found["threads"][2:]
    assert [(r["step"], r["planner/replanned"]) for r in records if "planner/replanned" in r] == [(3, 1.0)]
    assert [r["step"] for r in records if "time/actor_train" in r] == list(range(1, steps + 1))
    checkpoints = tmp_path / "run" / "checkpoints"
    assert {p.name for p in checkpoints.iterdir()} == {"step_3", f"step_{steps}"}
    optimizer_steps = [
        json.loads((checkpoints / name / "actor" / "engine" / "engine.json").read_text())["global_step"]
        for name in ("step_3", f"step_{steps}")
    ]
    assert optimizer_steps == [3, steps]  # counted on from the switch, not from 0
    at_switch = load_file(checkpoints / "step_3" / "actor" / "hf" / "model.safetensors")
    final = load_file(tmp_path / "run" / "final" / "actor" / "model.safetensors")
    assert at_switch.keys() == final.keys() and any(not torch.equal(at_switch[k], final[k]) for k in final)


def test_a_driver_hosted_run_whose_calibration_confirms_its_one_worker_keeps_it_without_ray(
    tmp_path, monkeypatch
) -> None:
    """Its calls twice as fast on two threads, the calibration at step 3 plans one worker on both
    cores again: the run goes on in the driver, with no checkpoint taken there and no Ray started."""
    found, records = _driver_hosted_run(tmp_path, monkeypatch, 4, "halve")
    assert found["hosts"] == [[s, [True, False, [0]]] for s in range(1, 5)]
    assert found["steps"] == 4 and found["ray_after"] is False and found["threads"][:2] == found["threads"][2:]
    planner = _logged(records, "planner/")
    assert planner["planner/host_speedup_generate"] > 1.5 and planner["planner/replanned"] == 0.0
    # The planner's own plan (only a plan of one worker takes more threads than one), not the
    # running one kept for what a restart would cost.
    assert planner["planner/threads"] == 2.0
    assert not (tmp_path / "run" / "checkpoints" / "step_3").exists()


def test_a_multi_turn_runs_tool_seconds_are_planned_with_and_left_out_of_its_corrections(tmp_path) -> None:
    """The seconds an episode's step measured replace ``tool_seconds`` in the plan made next; the
    generate call's correction compares its decoding alone with the estimate's (the waits for tools,
    at the measured seconds, taken out of the measured call)."""
    from rlflow.trainer.build import build_dataflow
    from rlflow.trainer.placement import plan_placement, planning_workload

    turns = ["data.max_response_len=8", "rollout.max_new_tokens=8", "rollout.multi_turn.max_prompt_tokens=16",
             "rollout.multi_turn.max_total_tokens=32", "rollout.multi_turn.max_turns=2",
             "rollout.multi_turn.num_threads=4"]  # fmt: skip
    cfg = load_config(GRPO, ["placement.devices_per_node=1", "placement.use_gpu=false", *turns])
    graph = build_dataflow(cfg, rule_reward=True)
    spec = ModelSpec(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4, vocab_size=32)
    profile = _machine_profile(0.2)
    placement = plan_placement(
        cfg, graph, {"actor": spec}, use_gpu=False, profile=profile, progress=False, multi_turn=True
    )
    estimated = placement.estimated_call_seconds()
    tool_s = 0.05
    timed = replace(cfg, rollout=replace(cfg.rollout, multi_turn=replace(cfg.rollout.multi_turn, tool_seconds=tool_s)))
    rows = cfg.data.batch_size * cfg.algorithm.n_samples
    wait = planning_workload(timed, True).tool_wait_s(rows)
    assert wait == pytest.approx(tool_s * 1 * rows / 4)  # one wait (two turns), 4 episodes at a time

    def decide(tool_seconds):
        run = calibration.RunCalibration(profile, (tmp_path / "p.json",), {"actor": spec}, multi_turn=True)
        run.begin(0, placement, steps=2, cores=1)
        measured = {  # decoding twice as slow as priced, plus the waits; training as priced
            "actor_gen": [9.0] + [2 * estimated["actor_gen"] + wait] * 2,
            "actor_train": [9.0] + [estimated["actor_train"]] * 2,
        }
        assert run.due(3)
        return run.at(3, cfg, graph, placement, measured, restart_s=1.0, tool_seconds=tool_seconds)

    decision = decide({"actor_gen": [1.0, tool_s, tool_s]})  # the warm-up step's is left out
    assert decision.metrics["planner/tool_seconds"] == pytest.approx(tool_s)
    assert decision.metrics["planner/correction_generate"] == pytest.approx(2.0)
    assert decision.metrics["planner/correction_train_step"] == pytest.approx(1.0)
    assert decision.placement.estimated_call_seconds()["actor_gen"] > wait  # the plan prices the tools
    untimed = decide(None)  # no tool time measured: the waits read as slow decoding
    assert "planner/tool_seconds" not in untimed.metrics
    assert untimed.metrics["planner/correction_generate"] > 2.0


class _SlowTool:
    """Two turns; each step sleeps 20 ms, as a tool would."""

    def reset(self, row):
        self.turns = 0
        return row["prompt"]

    def step(self, text):
        import time

        from rlflow.workers.environments import Step

        self.turns += 1
        time.sleep(0.02)
        return Step("=1", 0.0, self.turns >= 2)

    def metrics(self):
        return {}


def test_a_multi_turn_run_calibrates_with_the_seconds_its_tools_took(tmp_path, machine) -> None:
    run_dir = tmp_path / "tools"
    turns = ["data.max_response_len=4", "rollout.max_new_tokens=4", "rollout.multi_turn.max_prompt_tokens=16",
             "rollout.multi_turn.max_total_tokens=12", "rollout.multi_turn.max_turns=2",
             "data.batch_size=2", "algorithm.n_samples=2", "placement.worker_host=driver"]  # fmt: skip
    trainer = Trainer(load_config(GRPO, [*_overrides(run_dir, steps=4), *turns]), environment=_SlowTool)
    try:
        trainer.fit()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    planner = _logged(records, "planner/")
    # At least the step's sleep; the bound above leaves room for a loaded machine's scheduling delays.
    assert 0.02 <= planner["planner/tool_seconds"] < 1.0
    assert "planner/correction_generate" in planner


def test_a_dynamic_sampling_run_plans_again_with_the_generation_rounds_it_measured(monkeypatch) -> None:
    """Each call is corrected by its own seconds (one round's); the rounds the steps took (their mean
    after the warm-up step) price a step's calls of a round, and the next plan."""
    from rlflow.planner.model_spec import model_preset
    from rlflow.trainer.build import build_dataflow
    from rlflow.trainer.placement import plan_placement

    overrides = ["algorithm.dynamic_sampling=true", "models.reward.init=tiny", "models.ref.init=tiny",
                 "algorithm.kl_coef=0.1", "placement.mode=heuristic"]  # fmt: skip
    cfg = load_config(None, overrides)
    cfg.placement.devices_per_node = 8
    graph = build_dataflow(cfg, rule_reward=False)
    specs = {role: model_preset("llama2-7b") for role in ("actor", "reward", "ref")}
    placement = plan_placement(cfg, graph, specs, use_gpu=True, progress=False)
    estimated = placement.estimated_call_seconds()
    measured = {n: [9.0] + [2 * s] * 2 for n, s in estimated.items()}  # every call twice as slow as priced
    seen = {}

    def decide(self, cfg, graph, placement, profile, phases, restart_s, step):
        seen.update(step_s=sum(phases[0].values()), rounds=cfg.algorithm.dynamic_sampling_rounds)
        return calibration.Decision(profile, None, False, "kept", {})

    monkeypatch.setattr(calibration.RunCalibration, "_decide", decide)
    run = calibration.RunCalibration(_machine_profile(0.2), (), specs)
    run.begin(0, placement, steps=2, cores=1)
    decision = run.at(3, cfg, graph, placement, measured, restart_s=1.0, rounds=[4.0, 2.0, 3.0])
    assert seen["rounds"] == decision.metrics["planner/dynamic_sampling_rounds"] == pytest.approx(2.5)
    assert decision.profile.corrections == pytest.approx({"generate": 2.0, "inference": 2.0, "train_step": 2.0})
    assert seen["step_s"] == pytest.approx(
        sum(2 * s * (1.0 if n == "actor_train" else 2.5) for n, s in estimated.items())
    )
