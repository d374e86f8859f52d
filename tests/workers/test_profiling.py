"""``rlflow profile``: a quick measurement on this machine, its typed record and file, and the rates
priced from it (the pricing alone is tested in tests/planner/test_profile.py)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from rlflow.dataflow import MFCDef, algorithm_mfcs
from rlflow.planner.cluster import cluster_preset
from rlflow.planner.cost import Workload, call_cost
from rlflow.planner.mesh import DeviceMesh
from rlflow.planner.model_spec import ModelSpec
from rlflow.planner.profile import HardwareProfile, MachineProfile, ProfiledRates, load_profile
from rlflow.strategy import ParallelStrategy
from rlflow.workers import profiling
from rlflow.workers.profiling import profile_or_measure, run_profile


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    return tmp_path_factory.mktemp("profile") / "p.json"


@pytest.fixture(scope="module")
def profile(profile_path):
    layer = dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=4, vocab_size=64)
    return run_profile(
        profile_path,
        device="cpu",
        progress=False,
        passes=((1, 16), (2, 64)),
        decodes=((1, 32), (4, 32)),
        layer=layer,
        rounds=1,
    )


def test_profile_measures_this_machine_and_round_trips(profile, profile_path):
    hw = profile.hardware
    for key in ("matmul_flops", "memcpy_bandwidth", "loopback_bandwidth", "host_memory_bytes"):
        assert getattr(hw, key) > 0, key
    assert 0 < hw.loopback_latency_s < 0.1
    assert [s.seq for s in profile.forward] == [16, 64] and all(s.seconds > 0 for s in profile.backward)
    # the layer shape asked for, a whole one-layer model's decode step and the sampler at every decode size
    assert profile.layer.hidden_size == 128 and profile.layer.vocab_size == 64
    assert [s.batch for s in profile.model_decode] == [s.batch for s in profile.sample] == [1, 4]
    assert all(s.seconds > 0 for s in profile.model_decode + profile.sample)
    assert profile.device == "cpu" and profile.dtype == "float32" and profile.calls is None
    assert load_profile(profile_path) == profile  # the file written holds the whole record


def test_a_cpu_profile_prices_collectives_at_a_measured_gloo_all_reduce(profile):
    """A gloo all-reduce between two worker processes costs far more than a raw TCP ping (about
    1.9 ms against 15 us on the 2-core sandbox): priced at the ping, tensor-parallel generation
    looked cheaper than data-parallel and the search picked a plan that ran 1.65x slower."""
    hw = profile.hardware
    assert hw.collective_latency_s > hw.loopback_latency_s
    cpu = cluster_preset("cpu", devices_per_node=2, profile=profile)
    assert cpu.collective_latency_s == hw.collective_latency_s
    assert cpu.intra_host_latency_s == hw.loopback_latency_s  # per ring step: the socket hop


def test_profiled_rates_price_calls(profile, profile_path):
    cluster = cluster_preset("cpu", 1, 2, profile=profile)
    rates = ProfiledRates.from_profile(profile_path, cluster)  # read from its file
    # interpolation stays inside the measured range
    fwd = rates.flops_rate(np.array([0.5, 1.0, 128.0, 1e6]))  # profiled passes span 1 to 128 tokens
    assert fwd[0] == fwd[1] and fwd[2] == fwd[3] and np.all(fwd > 0)
    m = ModelSpec(
        num_layers=2,
        hidden_size=128,
        intermediate_size=256,
        num_heads=4,
        num_kv_heads=4,
        vocab_size=256,
    )
    # Enough rows that halving them outweighs the gloo collectives data parallelism adds: FSDP's
    # per-layer gathers and reduce-scatters share the workers' cores, so at 16 rows per rank and
    # mini-batch (64 prompts, 4 mini-batches) training on two workers is priced slower than on one.
    w = Workload(batch_size=256, prompt_len=16, gen_len=8)
    for mfc in algorithm_mfcs("ppo")[::2]:
        one = call_cost(mfc, m, ParallelStrategy(), DeviceMesh(1, 1, devices_per_node=2), cluster, w, rates).time_s
        two = call_cost(mfc, m, ParallelStrategy(dp=2), DeviceMesh(1, 2, devices_per_node=2), cluster, w, rates).time_s
        assert 0 < two < one < 60


def test_the_sampler_step_is_priced_at_the_rows_it_draws_for(profile):
    """The sampler's per-token work grows with the rows (2.0 ms for 256 rows against 0.08 ms for
    one on the sandbox); a median over the profiled sizes priced every generation at ~0.25 ms."""
    rates = ProfiledRates.from_profile(profile, cluster_preset("cpu", 1, 2, profile=profile))
    (b1, t1), (b4, t4) = [(s.batch, s.seconds) for s in profile.sample]
    assert (b1, b4) == (1, 4)
    got = rates.sample_step_s(np.array([1, 2.5, 4, 8]))
    np.testing.assert_allclose(got, [t1, (t1 + t4) / 2, t4, 2 * t4])  # beyond the largest: in proportion


CALLS = {
    "model": dict(
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=40,
        tie_embeddings=True,
    ),
    "generate": dict(prompts=4, prompt_len=6, n=2, gen_len=3),
    "train": dict(rows=8, seq=9),
    "generate_alt": dict(prompts=2, prompt_len=6, n=2, gen_len=3),
    "train_alt": dict(rows=4, seq=9),
}


@pytest.mark.parametrize("processes, precision", [(1, "bf16"), (2, "fp32")])
def test_whole_calls_of_the_planned_model_calibrate_its_estimates(tmp_path, monkeypatch, processes, precision):
    """The layer timings miss what a whole call adds (the sampler's bookkeeping, the HF model
    around its layers, the loss, the optimizer) and, on a CPU host, what workers running at once
    cost each other. Profiled whole calls at two batch sizes calibrate the estimates of their call
    types (a fixed part and a scale of the compute), so that a call at either profiled shape is
    estimated at its measurement; ``processes`` times them in that many worker processes at once,
    the forward and training step through a TrainEngine on FSDP over them, in the ``precision``
    the workers compute in (bf16: fp32 master weights, a bf16 sampler copy)."""
    layer = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, vocab_size=40)
    calls = {**CALLS, "precision": precision}
    if processes > 1:  # the call-timing processes time gloo's latency themselves: no second pair spawned

        def spawned(*args, **kwargs):
            raise AssertionError("a second pair of processes spawned for the gloo latency")

        monkeypatch.setattr(profiling, "gloo_collective_latency", spawned)
    prof = run_profile(tmp_path / "p.json", device="cpu", progress=False, passes=((1, 16), (8, 9)),
                       decodes=((1, 16), (8, 8)), layer=layer, rounds=1, calls=calls, call_processes=processes)  # fmt: skip
    assert load_profile(tmp_path / "p.json") == prof
    assert 0 < prof.hardware.collective_latency_s < 0.1
    assert prof.calls.model == ModelSpec(**CALLS["model"])
    for name in ("generate", "forward", "train", "generate_alt", "forward_alt", "train_alt"):
        timing = getattr(prof.calls, name)
        assert timing.seconds > 0 and timing.processes == processes
    cluster = cluster_preset("cpu", 1, 2, profile=prof)
    rates = ProfiledRates.from_profile(prof, cluster)
    plain = ProfiledRates.from_profile(prof, cluster, calibrate=False)
    assert set(rates.call_scales) == {"generate", "inference", "train_step"} and plain.call_scales == {}
    model = ModelSpec(**CALLS["model"])
    mesh = DeviceMesh(1, 1, devices_per_node=2)
    gen_mfc, train_mfc = MFCDef("g", "m", "generate"), MFCDef("t", "m", "train_step", objective="rl")
    gen = Workload(batch_size=4, prompt_len=6, gen_len=3, n_samples_per_prompt=2)
    train = Workload(batch_size=8, prompt_len=9, gen_len=0, n_ppo_minibatches=1, gradient_checkpointing=False,
                     max_tokens_per_mb=None)  # fmt: skip
    for mfc, workload, name in ((gen_mfc, gen, "generate"), (train_mfc, train, "train")):
        scale, fixed = rates.call_scale(mfc.interface_type), rates.call_fixed_s(mfc.interface_type)
        measured, priced = [], []
        for timing in prof.calls.timings(name):
            # Timed with more processes, the training step ran on FSDP over them: priced so.
            dp = timing.dp
            assert dp == (1 if name == "generate" else processes)
            rows = timing.prompts if name == "generate" else timing.rows
            shaped = dataclasses.replace(workload, batch_size=rows * dp)
            on = mesh if dp == 1 else DeviceMesh(1, dp, devices_per_node=2)
            calibrated = call_cost(mfc, model, ParallelStrategy(dp=dp), on, cluster, shaped, rates)
            if fixed > 0:  # a line through both shapes: each calibrated estimate is its measurement
                assert calibrated.time_s == pytest.approx(timing.seconds, rel=1e-6)
            # the compute is scaled and the fixed part added; the collectives are not scaled
            plain_cost = call_cost(mfc, model, ParallelStrategy(dp=dp), on, cluster, shaped, plain)
            comm = plain_cost.breakdown.get("fsdp_exposed_s", 0.0) + plain_cost.breakdown.get("sync_s", 0.0)
            assert (comm > 0) == (dp > 1)
            expected = comm + fixed + scale * (plain_cost.time_s - comm)
            assert calibrated.time_s == pytest.approx(expected, rel=1e-6)
            measured.append(timing.seconds - comm)
            priced.append(plain_cost.time_s - comm)
        if fixed == 0:  # noise left no line with positive parts: the ratio through the origin
            assert scale == pytest.approx(np.clip(sum(measured) / sum(priced), 1 / 16, 16), rel=1e-9)
        assert 1 / 16 <= scale <= 16


def test_a_call_on_one_worker_of_a_busy_host_is_priced_at_its_alone_timings(tmp_path):
    """A host's workers share its cores, caches and memory bandwidth, and FSDP adds its work: a
    call spread over every worker costs more per row than one on a worker whose peers idle. The
    profile times both regimes — the per-worker shape with both processes busy (training on FSDP
    over them), and the whole batch and one worker's share in one process alone — and each is
    priced from its own fit: a call on one device of the host at the alone timings, on both at
    the busy ones, so the planner can see when one worker is the faster plan."""
    calls = {
        **CALLS,
        "generate_alone": dict(prompts=8, prompt_len=6, n=2, gen_len=3),
        "train_alone": dict(rows=16, seq=9),
        "generate_alone_alt": dict(prompts=4, prompt_len=6, n=2, gen_len=3),
        "train_alone_alt": dict(rows=8, seq=9),
        "host_threads": 2,
    }
    layer = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, vocab_size=40)
    prof = run_profile(tmp_path / "p.json", device="cpu", progress=False, passes=((1, 16), (8, 9)),
                       decodes=((1, 16), (8, 8)), layer=layer, rounds=1, calls=calls, call_processes=2)  # fmt: skip
    assert load_profile(tmp_path / "p.json") == prof
    # the whole batch once more in one process on both cores: what a one-worker plan may take
    for name, shape in (("generate", "generate_alone"), ("forward", "train_alone"), ("train", "train_alone")):
        host = getattr(prof.calls, f"{name}_host")
        assert host.seconds > 0 and (host.processes, host.dp) == (1, 1)
        assert {k: v for k, v in dataclasses.asdict(host).items() if k in calls[shape]} == calls[shape]
        assert prof.calls.host_speedup(name) == getattr(prof.calls, f"{name}_alone").seconds / host.seconds
    for name in ("generate", "forward", "train"):
        busy, alone = prof.calls.timings(name), prof.calls.timings(name, alone=True)
        assert [t.processes for t in busy] == [2, 2] and [t.processes for t in alone] == [1, 1]
        assert [t.dp for t in alone] == [1, 1] and all(t.seconds > 0 for t in busy + alone)
    cluster = cluster_preset("cpu", 1, 2, profile=prof)
    rates = ProfiledRates.from_profile(prof, cluster)
    assert set(rates.alone_fits) == set(rates.busy_fits) == {"generate", "inference", "train_step"}
    for interface in ("generate", "inference", "train_step"):
        alone, busy = rates.alone_fits[interface], rates.busy_fits[interface]
        assert (rates.call_fixed_s(interface, 1), rates.call_scale(interface, 1)) == alone
        assert (rates.call_fixed_s(interface, 2), rates.call_scale(interface, 2)) == busy
        assert (rates.call_fixed_s(interface), rates.call_scale(interface)) == busy  # no mesh: the host busy
    # The whole training batch alone on one worker is priced at its measurement (a line through
    # both alone shapes), or at the ratio of both when noise left the line a negative part.
    model, one = ModelSpec(**CALLS["model"]), DeviceMesh(1, 1, devices_per_node=2)
    train = Workload(batch_size=16, prompt_len=9, gen_len=0, n_ppo_minibatches=1, gradient_checkpointing=False,
                     max_tokens_per_mb=None)  # fmt: skip
    cost = call_cost(
        MFCDef("t", "m", "train_step", objective="rl"), model, ParallelStrategy(), one, cluster, train, rates
    )
    if rates.alone_fits["train_step"][0] > 0:
        assert cost.time_s == pytest.approx(prof.calls.train_alone.seconds, rel=1e-6)
    # A profile without alone timings (a one-worker host, or an older file) prices every mesh busy.
    older = dataclasses.replace(prof, calls=dataclasses.replace(
        prof.calls, **{f"{k}{s}": None for k in ("generate", "forward", "train") for s in ("_alone", "_alone_alt")}))  # fmt: skip
    plain = ProfiledRates.from_profile(older, cluster)
    assert plain.alone_fits == {} and plain.call_scale("generate", 1) == rates.busy_fits["generate"][1]


def test_whole_calls_are_timed_on_cpu_workers_only(tmp_path):
    with pytest.raises(ValueError, match="CPU worker processes"):
        run_profile(tmp_path / "p.json", device="cuda", progress=False, calls=CALLS)


def test_a_cpu_cluster_is_priced_from_the_hosts_profile_or_its_hardware_measured_now(tmp_path, monkeypatch, profile):
    monkeypatch.setenv("RLFLOW_CACHE_DIR", str(tmp_path))
    measured = profile_or_measure()  # no profile of this host: its hardware, measured now
    assert isinstance(measured, HardwareProfile) and measured.matmul_flops > 0
    assert profile_or_measure(profile) is profile
    with pytest.raises(ValueError, match="cpu preset is priced from a measured profile"):
        cluster_preset("cpu")  # the planner itself does not measure
    profile_file = tmp_path / f"profile-{profile.host}.json"
    profile_file.write_text(profile.to_json())
    assert isinstance(profile_or_measure(), MachineProfile) and profile_or_measure() == profile
    assert profile_or_measure(profile_file) == profile


def test_a_profile_timed_without_the_cpp_decode_step_is_not_reused(monkeypatch):
    """Generation timings depend on rlflow._C_decode; a cache key must tell the two builds apart."""
    import pkgutil

    import rlflow.workers.profiling as profiling
    from rlflow.planner.profile import profile_cache_key

    with_kernel = profiling.host_identity()
    assert "_C_decode" in with_kernel["kernels"]
    iter_modules = pkgutil.iter_modules  # a package built without the kernel: its module is absent
    monkeypatch.setattr(pkgutil, "iter_modules", lambda path: [m for m in iter_modules(path) if m.name != "_C_decode"])
    without = profiling.host_identity()
    assert without["kernels"] == [k for k in with_kernel["kernels"] if k != "_C_decode"]
    assert profile_cache_key(with_kernel, {}) != profile_cache_key(without, {})


def test_a_profile_measured_under_capped_instruction_sets_is_not_reused_without_them(monkeypatch):
    """ATEN_CPU_CAPABILITY=avx2 and friends make this host an AVX2 machine's speeds: a key of their own."""
    import rlflow.workers.profiling as profiling
    from rlflow.engine.parallelize import ISA_CAP_VARIABLES
    from rlflow.planner.profile import profile_cache_key

    for name in ISA_CAP_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    uncapped = profiling.host_identity()
    assert "isa_caps" not in uncapped  # the key every uncapped host had before the caps counted
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    capped = profiling.host_identity()
    assert capped["isa_caps"] == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert profile_cache_key(capped, {}) != profile_cache_key(uncapped, {})


_FORKED_TIMINGS = """
import threading, time
import torch
import torch.distributed as dist
from rlflow.workers import profiling

calls = json.loads(sys.argv[1])
torch.set_num_threads(2)
a = torch.randn(256, 256)
for _ in range(20):
    a @ a  # this process's OpenMP pool has run a parallel region of two threads
torch.set_num_threads(1)
print("methods", profiling._start_method(1), profiling._start_method(2))
state = torch.random.get_rng_state()
seconds = profiling.concurrent_call_seconds(calls, 2)
print("keys", " ".join(sorted(k for k, v in seconds.items() if v > 0)))
print("rng_kept", torch.equal(state, torch.random.get_rng_state()))
print("group_left", dist.is_initialized())
sleeper = threading.Thread(target=time.sleep, args=(2,))
sleeper.start()
print("with_thread", profiling._start_method(1))
sleeper.join()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
print("with_group", profiling._start_method(1))
"""


def test_the_call_timing_processes_are_forked_where_that_is_sound_and_the_alone_calls_run_here(tmp_path):
    """A forked worker process starts with the profiling process's imports (a spawned one imports
    torch and transformers again: most of a machine profile's seconds). Forked after this process
    used GNU OpenMP's pool of two threads, a child computing on more than one thread would hang:
    the children compute on one, and the whole batch on every core (``*_host``) is timed in this
    process, with the alone calls, after the children exit — leaving its random state and no
    process group behind. Another thread or a process group in this process means a spawn."""
    calls = {
        **CALLS,
        "generate_alone": dict(prompts=8, prompt_len=6, n=2, gen_len=3),
        "train_alone": dict(rows=16, seq=9),
        "host_threads": 2,
    }
    script = tmp_path / "forked.py"
    script.write_text("import json, sys\n" + _FORKED_TIMINGS)
    done = subprocess.run([sys.executable, str(script), json.dumps(calls)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert lines["methods"] == "fork spawn"
    kinds = ("generate", "forward", "train")
    timed = {k + s for k in kinds for s in ("", "_alt", "_alone", "_host")} | {"collective_latency_s"}
    assert set(lines["keys"].split()) == timed
    assert (lines["rng_kept"], lines["group_left"]) == ("True", "False")
    assert (lines["with_thread"], lines["with_group"]) == ("spawn", "spawn")


def test_a_profiling_process_that_is_a_rank_of_a_larger_group_times_the_alone_calls_in_a_spawned_one(monkeypatch):
    """Its own default group is taken: the alone and every-core calls go to one new process that
    computes on the host's threads (so it is spawned: a forked child of more threads would hang)."""
    import torch.distributed as dist

    calls = {**CALLS, "generate_alone": CALLS["generate"], "train_alone": CALLS["train"], "host_threads": 2}
    started = []

    def processes(job, world, *args, threads=1):
        started.append((job.__name__, world, threads, profiling._start_method(threads)))
        return [{"generate": 1.0}] * world if job is profiling._busy_call_seconds else [{"generate_alone": 2.0}]

    monkeypatch.setattr(profiling, "_in_gloo_processes", processes)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    seconds = profiling.concurrent_call_seconds(calls, 2)
    assert seconds == {"generate": 1.0, "generate_alone": 2.0}
    assert started == [("_busy_call_seconds", 2, 1, "spawn"), ("_alone_call_seconds", 1, 2, "spawn")]


def test_spawned_profile_processes_work_from_a_script_without_a_main_guard(tmp_path):
    # TRL's quickstart style: top-level code, no `if __name__ == "__main__":`. Spawned children
    # used to run the script again and fail in multiprocessing's bootstrapping check.
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from rlflow.workers import profiling\n"
        "from rlflow.workers.profiling import gloo_collective_latency\n"
        "profiling._start_method = lambda threads: 'spawn'  # as where a fork is not sound\n"
        "print('script body ran')\n"
        "print('latency', gloo_collective_latency(iters=3))\n"
    )
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("script body ran") == 1
    assert "latency" in done.stdout


def test_the_main_module_is_hidden_only_while_children_start():
    from rlflow.rendezvous import main_module_hidden

    main = sys.modules["__main__"]
    with main_module_hidden():
        stand_in = sys.modules["__main__"]
        assert stand_in is not main and getattr(stand_in, "__file__", None) is None
        assert getattr(stand_in, "__spec__", None) is None  # nothing for spawn to re-import
    assert sys.modules["__main__"] is main
