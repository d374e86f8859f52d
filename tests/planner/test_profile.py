"""Profiles as the planner reads them: the typed record, its JSON file, and the rates priced from
it. Measuring a profile is tested in tests/workers/test_profiling.py."""

from __future__ import annotations

import json

import pytest

from rlflow.planner.cluster import cluster_preset
from rlflow.planner.model_spec import ModelSpec
from rlflow.planner.passes import layer_work
from rlflow.planner.profile import (
    BatchTiming,
    CallTimings,
    HardwareProfile,
    LayerTiming,
    MachineProfile,
    ProfiledLayer,
    ProfiledRates,
    RolloutTiming,
    cached_profile_path,
    default_profile_path,
    load_profile,
    profile_cache_key,
    save_profile,
)

HW = HardwareProfile(2e10, 1e10, 5e8, 4e-5, 16e9, collective_latency_s=2e-3)
LAYER = ProfiledLayer(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4, vocab_size=32)
CALLS = CallTimings(
    model=ModelSpec(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, vocab_size=40),
    generate=RolloutTiming(prompts=4, prompt_len=6, n=2, gen_len=3, seconds=0.5, processes=2, dp=1),
    forward=BatchTiming(rows=8, seq=9, seconds=0.1, processes=2, dp=2),
    train=BatchTiming(rows=8, seq=9, seconds=0.3, processes=2, dp=2),
)


def _profile(**changes) -> MachineProfile:
    timings = (LayerTiming(1, 16, 1e-3), LayerTiming(4, 64, 5e-3))
    fields = dict(host="h", device="cpu", dtype="float32", hardware=HW, layer=LAYER, forward=timings,
                  backward=timings, decode=timings, model_decode=timings[:1], sample=(LayerTiming(1, 0, 1e-4),),
                  calls=CALLS, elapsed_s=3.0)  # fmt: skip
    return MachineProfile(**{**fields, **changes})


@pytest.mark.parametrize("calls", [CALLS, None])
def test_a_profile_round_trips_through_its_file(tmp_path, calls):
    profile = _profile(calls=calls)
    path = save_profile(profile, tmp_path / "sub" / "p.json")
    assert load_profile(path) == profile
    data = json.loads(path.read_text())  # the file keeps the keys every profile file had
    assert data["version"] == 1 and data["hardware"]["collective_latency_s"] == 2e-3
    assert data["forward"][1] == {"batch": 4, "seq": 64, "seconds": 5e-3} and ("calls" in data) == (calls is not None)
    no_gloo = _profile(hardware=HardwareProfile(2e10, 1e10, 5e8, 4e-5, 16e9))  # a GPU profile: not measured
    assert "collective_latency_s" not in json.loads(no_gloo.to_json())["hardware"]
    assert cluster_preset("cpu", profile=no_gloo).collective_latency_s == 4e-5  # priced at the socket hop


def test_a_profile_file_written_before_the_record_still_loads(tmp_path):
    """The JSON a dict-based ``run_profile`` wrote: no ``model_decode``/``sample`` timings, a
    ``calls.model`` of some ModelSpec fields only."""
    old = {"version": 1, "host": "h", "device": "cpu", "dtype": "float32",
           "hardware": {"matmul_flops": 2e10, "memcpy_bandwidth": 1e10, "loopback_bandwidth": 5e8,
                        "loopback_latency_s": 4e-5, "host_memory_bytes": 16e9},
           "layer": {"hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 4,
                     "vocab_size": 32, "bytes_per_param": 4},
           "forward": [{"batch": 1, "seq": 16, "seconds": 1e-3}], "backward": [{"batch": 1, "seq": 16, "seconds": 2e-3}],
           "decode": [{"batch": 1, "seq": 16, "seconds": 5e-4}], "elapsed_s": 2.0,
           "calls": {"model": {"num_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
                               "num_kv_heads": 2, "vocab_size": 40, "head_dim": None, "tie_embeddings": True},
                     **{k: v for k, v in CALLS.to_dict().items() if k != "model"}}}  # fmt: skip
    (tmp_path / "old.json").write_text(json.dumps(old))
    profile = load_profile(tmp_path / "old.json")
    assert profile.model_decode == () and profile.sample == () and profile.hardware.collective_latency_s is None
    assert profile.calls.model.tie_embeddings and profile.calls.train.seconds == 0.3
    assert ProfiledRates(profile, cluster_preset("cpu", profile=profile)).call_scales.keys() == {
        "generate", "inference", "train_step"}  # fmt: skip


def test_profile_files_are_checked(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="rlflow profile"):
        load_profile(tmp_path / "missing.json")
    cases = {
        "old.json": ({"version": 0}, "version 0, expected 1"),
        "nojson.json": ("{", "not JSON"),
        "lacks.json": ({"version": 1, "host": "h"}, r"missing fields \['device', 'dtype', 'hardware'"),
        "hw.json": (
            {**json.loads(_profile().to_json()), "hardware": {"matmul_flops": 1.0}},
            r"hardware: missing fields",
        ),
        "row.json": (
            {**json.loads(_profile().to_json()), "decode": [{"batch": 1}]},
            r"decode\[0\]: missing fields \['seq'",
        ),
        "extra.json": ({**json.loads(_profile().to_json()), "gpu_name": "x"}, r"unknown fields \['gpu_name'\]"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(ValueError, match=f"profile {tmp_path / name}: {message}"):
            load_profile(tmp_path / name)
    monkeypatch.setenv("RLFLOW_CACHE_DIR", str(tmp_path))
    assert default_profile_path().parent == tmp_path
    with pytest.raises(ValueError, match="cpu preset is priced from a measured profile"):
        cluster_preset("cpu")  # no profile given and none of this host: the planner does not measure


def test_cached_profiles_are_named_by_everything_they_depend_on(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFLOW_CACHE_DIR", str(tmp_path))
    host = {"hostname": "h", "cpu": "x", "cores": 2, "torch": "2.5", "device": "cpu"}
    shapes = {"layer": {"hidden_size": 64}, "passes": ((1, 64), (4, 128)), "call_processes": 2}
    key = profile_cache_key(host, shapes)
    assert key == profile_cache_key(dict(reversed(host.items())), shapes)  # not the order of the keys
    others = [{**host, "cores": 4}, {**host, "torch": "2.6"}, {**host, "device": "H100"}]
    assert all(profile_cache_key(h, shapes) != key for h in others)
    assert profile_cache_key(host, {**shapes, "call_processes": 1}) != key
    assert profile_cache_key(host, {**shapes, "passes": ((1, 64),)}) != key
    path = cached_profile_path(key)
    assert path == tmp_path / "profiles" / f"{key}.json"
    save_profile(_profile(), path)  # written whole, then renamed: no temporary file is left
    assert load_profile(path) == _profile() and [p.name for p in path.parent.iterdir()] == [path.name]


def test_profiled_rates_split_a_fixed_overhead_from_the_rate():
    """Synthetic timings: every pass takes its roofline on the measured hardware plus 2 ms, except
    the smallest decode step, plus 1 ms: the overhead is 1 ms and rates are fitted to the rest."""
    layer = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4)
    hw = HardwareProfile(
        matmul_flops=1e10, memcpy_bandwidth=5e9, loopback_bandwidth=1e9, loopback_latency_s=1e-5, host_memory_bytes=8e9
    )
    spec = ModelSpec(num_layers=1, vocab_size=1, **layer)

    def roofline(batch, seq, decode):
        new, pairs = (1, seq + 1) if decode else (seq, seq * (seq + 1) / 2)
        f, m, b = layer_work(spec, 1, batch, new, pairs, 4, seq if decode else 0)
        return f, max(f / hw.matmul_flops, (m + b) / hw.memcpy_bandwidth)

    decode = (LayerTiming(1, 16, roofline(1, 16, True)[1] + 1e-3), LayerTiming(8, 16, roofline(8, 16, True)[1] + 2e-3))
    forward = tuple(LayerTiming(b, s, roofline(b, s, False)[1] + 2e-3) for b, s in ((1, 32), (4, 64)))
    profile = MachineProfile(
        "host",
        "cpu",
        "float32",
        hw,
        ProfiledLayer(**layer, vocab_size=1),
        forward=forward,
        backward=forward,
        decode=decode,
    )
    rates = ProfiledRates(profile, cluster_preset("cpu", profile=profile))
    assert rates.overhead_s == pytest.approx(1e-3)
    flops, seconds = roofline(4, 64, False)
    assert rates.flops_rate(4 * 64) == pytest.approx(flops / (seconds + 1e-3))
    # a profiled pass is priced back at its measured time
    f, m, b = layer_work(spec, 1, 4, 64, 64 * 65 / 2, 4)
    assert rates.compute_s(f, m, b, 4 * 64) == pytest.approx(forward[1].seconds)
    assert rates.pass_overhead_s == 0.0 and rates.sample_step_s(4) == 0.0  # not profiled: priced at 0
