"""A CPU host's workers share its cores: the planner prices a call on one worker by the profile's
alone timings and a call over every worker by its busy timings, so it picks one worker where
workers slow each other down and spreads a call where they do not. Measured on real workers in
tests/planner/test_plan_choice_measured.py (slow); here on synthetic profiles."""

from __future__ import annotations

import dataclasses

import pytest

from rlflow.dataflow import algorithm_graph
from rlflow.planner.build import build_problem
from rlflow.planner.cluster import cluster_preset
from rlflow.planner.cost import Workload
from rlflow.planner.model_spec import ModelSpec
from rlflow.planner.profile import (
    BatchTiming,
    CallTimings,
    HardwareProfile,
    LayerTiming,
    MachineProfile,
    ProfiledLayer,
    RolloutTiming,
)
from rlflow.planner.search import plan_search

SPEC = ModelSpec(num_layers=2, hidden_size=64, intermediate_size=256, num_heads=4, num_kv_heads=4, vocab_size=100)
# Issue 12's task on a 2-worker host: 4 prompts x 4 samples, 8-token prompts, 16 new tokens.
WORKLOAD = Workload(batch_size=4, prompt_len=8, gen_len=16, n_samples_per_prompt=4)
SEQ = 24


def _profile(gen: dict[str, float], train: dict[str, float]) -> MachineProfile:
    """A profile whose whole calls took ``gen``/``train`` seconds per regime and batch size: keys
    ``busy`` (one worker's share, both workers at once), ``busy_alt`` (half of it), ``alone``
    (the whole batch on one worker, the other idle) and ``alone_alt`` (one worker's share, alone)."""
    prompts = {"busy": 2, "busy_alt": 1, "alone": 4, "alone_alt": 2}

    def rollout(key: str) -> RolloutTiming:
        busy = key.startswith("busy")
        return RolloutTiming(prompts[key], 8, 4, 16, gen[key], processes=1 if not busy else 2, dp=1)

    def batch(key: str, seconds: float) -> BatchTiming:
        busy = key.startswith("busy")
        return BatchTiming(prompts[key] * 4, SEQ, seconds, processes=2 if busy else 1, dp=2 if busy else 1)

    calls = CallTimings(
        model=SPEC,
        generate=rollout("busy"),
        generate_alt=rollout("busy_alt"),
        generate_alone=rollout("alone"),
        generate_alone_alt=rollout("alone_alt"),
        **{
            f"{kind}{suffix}": batch(key, train[key] / (3 if kind == "forward" else 1))
            for kind in ("forward", "train")
            for key, suffix in (("busy", ""), ("busy_alt", "_alt"), ("alone", "_alone"), ("alone_alt", "_alone_alt"))
        },
    )
    timings = (LayerTiming(1, 16, 2e-4), LayerTiming(16, 24, 6e-4), LayerTiming(16, 128, 2e-3))
    return MachineProfile(
        host="h", device="cpu", dtype="float32",
        hardware=HardwareProfile(2e10, 1e10, 5e8, 4e-5, 16e9, collective_latency_s=1e-4),
        layer=ProfiledLayer(hidden_size=64, intermediate_size=256, num_heads=4, num_kv_heads=4, vocab_size=100),
        forward=timings, backward=tuple(dataclasses.replace(t, seconds=2 * t.seconds) for t in timings),
        decode=(LayerTiming(1, 16, 1e-4), LayerTiming(16, 24, 2e-4)), calls=calls,
    )  # fmt: skip


def _devices_per_call(profile: MachineProfile) -> dict[str, int]:
    cluster = cluster_preset("cpu", 1, 2, profile=profile)
    problem = build_problem(algorithm_graph("grpo", use_ref=False), {"actor": SPEC}, cluster, WORKLOAD, profile=profile)
    choice = plan_search(problem, max_seconds=5, progress=False).choice
    return {name: problem.options[i][c].mesh.size for i, (name, c) in enumerate(zip(problem.mfc_names, choice))}


def test_one_worker_where_busy_workers_slow_each_other_down():
    """The 2-core machine on a tiny model: both workers busy, each runs its half of the batch
    slower than one worker runs the whole batch alone (measured: 0.195 s/step on dp=2 against
    0.096 on one worker). The alone timings price the one-worker plan; it wins."""
    gen = {"alone": 0.030, "alone_alt": 0.026, "busy": 0.060, "busy_alt": 0.055}
    train = {"alone": 0.025, "alone_alt": 0.018, "busy": 0.080, "busy_alt": 0.075}
    assert _devices_per_call(_profile(gen, train)) == {"actor_gen": 1, "actor_train": 1}


def test_every_worker_where_a_call_splits_without_contention():
    """A model whose calls are compute: half the batch on each worker takes half the time, busy
    or not. The same search spreads both calls over both workers."""
    gen = {"alone": 0.60, "alone_alt": 0.30, "busy": 0.30, "busy_alt": 0.15}
    train = {"alone": 1.20, "alone_alt": 0.60, "busy": 0.60, "busy_alt": 0.30}
    assert _devices_per_call(_profile(gen, train)) == {"actor_gen": 2, "actor_train": 2}


@pytest.mark.parametrize("busy_devices", [None, 2, 3])
def test_a_call_on_every_device_of_a_host_or_no_mesh_is_priced_by_the_busy_fit(busy_devices):
    from rlflow.planner.profile import ProfiledRates

    gen = {"alone": 0.030, "alone_alt": 0.026, "busy": 0.060, "busy_alt": 0.055}
    train = {"alone": 0.025, "alone_alt": 0.018, "busy": 0.080, "busy_alt": 0.075}
    profile = _profile(gen, train)
    rates = ProfiledRates.from_profile(profile, cluster_preset("cpu", 1, 2, profile=profile))
    for interface in ("generate", "inference", "train_step"):
        busy = rates.busy_fits[interface]
        assert (rates.call_fixed_s(interface, busy_devices), rates.call_scale(interface, busy_devices)) == busy
        assert rates.call_scale(interface, 1) == rates.alone_fits[interface][1]
