"""Hardware profiles: the typed record of a measured machine, its JSON file, and the rates the
cost model reads off it.

A profile (:class:`MachineProfile`) holds (1) hardware rates — matmul FLOP/s, device memory-copy
bandwidth, loopback TCP bandwidth and latency (what gloo uses between CPU workers), host
memory — (2) timings of one real HF Llama decoder layer for a few (batch, sequence) sizes:
forward, backward, and one decode step against a KV cache, and (3) optionally whole calls of the
planned model. The measuring itself runs the training engine and the sampler, so it sits above
them, in :mod:`rlflow.workers.profiling` (``rlflow profile``); this module only prices.

The cost model turns the layer timings into a fixed overhead per layer pass (what the
smallest decode step takes above its roofline: framework dispatch) and *effective* FLOP/s as a
function of the tokens in a pass (analytic FLOPs of the profiled layer / the rest of the measured
seconds), and prices another model's layers by their own analytic FLOPs at the interpolated
rate plus the overhead (:class:`ProfiledRates`): measured efficiency, scaled by model dimensions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlflow.files import cache_dir, write_atomic
from rlflow.planner.cluster import ClusterSpec
from rlflow.planner.model_spec import ModelSpec
from rlflow.planner.passes import BACKWARD_FLOPS_FACTOR, Rates, layer_work

PROFILE_VERSION = 1


def default_profile_path() -> Path:
    """``<cache_dir>/profile-<host>.json``: the profile ``rlflow profile`` writes and the planner
    prices a CPU cluster from when given none (:func:`cache_dir`)."""
    return cache_dir() / f"profile-{socket.gethostname()}.json"


def profile_cache_key(identity: Mapping[str, Any], shapes: Mapping[str, Any]) -> str:
    """The name of a cached profile: a hash of everything its timings depend on — the measuring
    host's ``identity`` (hostname, CPU model, cores, torch version, device) and the
    ``shapes`` it measured — and of :data:`PROFILE_VERSION`, so a profile of another format is
    never looked up.

    >>> a = profile_cache_key({"host": "h"}, {"passes": [[1, 64]]})
    >>> a == profile_cache_key({"host": "h"}, {"passes": [[1, 64]]}), a == profile_cache_key({"host": "g"}, {})
    (True, False)
    """
    text = json.dumps({"version": PROFILE_VERSION, "identity": identity, "shapes": shapes}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cached_profile_path(key: str) -> Path:
    """``<cache_dir>/profiles/<key>.json``: where the profile of :func:`profile_cache_key` ``key`` is kept."""
    return cache_dir() / "profiles" / f"{key}.json"


# ----------------------------------------------------------------------------- the record


def _from_dict(cls, data: Any, where: str):
    """``cls(**data)`` for a record read from JSON, with errors that name the field: ``where``
    is its place in the file (``"hardware"``, ``"forward[2]"``)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    required = [n for n, f in fields.items() if f.default is dataclasses.MISSING]
    missing = [n for n in required if n not in data]
    unknown = sorted(set(data) - set(fields))
    if missing or unknown:
        raise ValueError(f"{where}: missing fields {missing}, unknown fields {unknown}; expected {list(fields)}")
    return cls(**data)


@dataclass(frozen=True)
class HardwareProfile:
    """Rates of one machine, as ``measure_hardware`` measures them.

    Attributes:
        matmul_flops: FLOP/s of a square matmul on one device (one thread on CPU).
        memcpy_bandwidth: bytes/s of a device memory copy (read + write).
        loopback_bandwidth, loopback_latency_s: bytes/s and one-way seconds of a local TCP
            connection (what gloo uses between CPU workers).
        host_memory_bytes: physical memory of the host.
        collective_latency_s: seconds of one small gloo all-reduce between two worker
            processes (CPU profiles); ``None``: not measured, collectives are priced at
            ``loopback_latency_s``.
    """

    matmul_flops: float
    memcpy_bandwidth: float
    loopback_bandwidth: float
    loopback_latency_s: float
    host_memory_bytes: float
    collective_latency_s: float | None = None

    def to_dict(self) -> dict[str, float]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: Any, where: str = "hardware") -> HardwareProfile:
        """The record of :meth:`to_dict`'s object; ``ValueError`` naming ``where`` and the field
        when one is missing or unknown."""
        return _from_dict(cls, data, where)


@dataclass(frozen=True)
class ProfiledLayer:
    """The shape of the profiled decoder layer and the bytes per parameter it ran in."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    bytes_per_param: int = 4

    def spec(self) -> ModelSpec:
        """A one-layer :class:`ModelSpec` of this shape."""
        return ModelSpec(
            num_layers=1,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            vocab_size=self.vocab_size,
        )


@dataclass(frozen=True)
class LayerTiming:
    """Median seconds of one profiled pass at ``batch`` rows of ``seq`` tokens (decode steps:
    ``seq`` cached tokens; sampler steps: ``seq`` is 0)."""

    batch: int
    seq: int
    seconds: float


@dataclass(frozen=True)
class RolloutTiming:
    """A whole rollout of the planned model at one worker's shape: ``prompts`` prompts of
    ``prompt_len`` tokens, ``n`` samples each, ``gen_len`` new tokens; the slowest of
    ``processes`` worker processes running it at once, each on its own (``dp`` = 1)."""

    prompts: int
    prompt_len: int
    n: int
    gen_len: int
    seconds: float
    processes: int
    dp: int


@dataclass(frozen=True)
class BatchTiming:
    """A whole forward or training step of the planned model over ``rows`` rows of ``seq``
    tokens per process, on FSDP over ``dp`` of the ``processes`` worker processes."""

    rows: int
    seq: int
    seconds: float
    processes: int
    dp: int


_CALL_KINDS = {"generate": RolloutTiming, "forward": BatchTiming, "train": BatchTiming}


_OPTIONAL_SUFFIXES = ("_alt", "_alone", "_alone_alt", "_host")


@dataclass(frozen=True)
class CallTimings:
    """Whole calls of the planned ``model`` that calibrate the estimates of its call types.

    Two regimes, each at one or two batch sizes (two split a call's time into what does not
    depend on its rows and what does, :meth:`ProfiledRates._calibrate`):

    * **busy**: each kind at the run's per-worker shape with every worker process of the host
      running it at once (training on FSDP over all of them), and in ``*_alt`` at a second batch
      size — what a call spread over the host's workers costs;
    * **alone** (``*_alone``, ``*_alone_alt``; absent from one-worker hosts and older profiles):
      the whole batch, and one worker's share, in one process while the others idle — what a call
      on one worker costs, without the contention and FSDP of the busy regime;
    * **host** (``*_host``; absent from one-worker hosts and older profiles): the alone regime's
      whole batch in one process with as many threads as the host has worker processes — what a
      plan of one worker costs when that worker takes every core (:meth:`host_speedup`).
    """

    model: ModelSpec
    generate: RolloutTiming
    forward: BatchTiming
    train: BatchTiming
    generate_alt: RolloutTiming | None = None
    forward_alt: BatchTiming | None = None
    train_alt: BatchTiming | None = None
    generate_alone: RolloutTiming | None = None
    forward_alone: BatchTiming | None = None
    train_alone: BatchTiming | None = None
    generate_alone_alt: RolloutTiming | None = None
    forward_alone_alt: BatchTiming | None = None
    train_alone_alt: BatchTiming | None = None
    generate_host: RolloutTiming | None = None
    forward_host: BatchTiming | None = None
    train_host: BatchTiming | None = None

    def host_speedup(self, kind: str) -> float | None:
        """How much faster one process with every core of the host runs ``kind`` (``generate``,
        ``forward``, ``train``) than with one thread, at the same shape (the whole batch):
        ``alone seconds / host seconds``; None without both timings."""
        alone, host = getattr(self, f"{kind}_alone"), getattr(self, f"{kind}_host")
        if alone is None or host is None or host.seconds <= 0:
            return None
        return alone.seconds / host.seconds

    def timings(self, kind: str, alone: bool = False) -> list[RolloutTiming | BatchTiming]:
        """The timings of ``kind`` (``generate``, ``forward``, ``train``) in one regime: zero
        (no alone timings), one or two shapes."""
        keys = (f"{kind}_alone", f"{kind}_alone_alt") if alone else (kind, f"{kind}_alt")
        return [t for t in (getattr(self, k) for k in keys) if t is not None]

    @property
    def processes(self) -> int:
        """The worker processes that were busy while the busy regime was timed."""
        return self.generate.processes

    @property
    def timed_alone(self) -> bool:
        """Whether calls were also timed in one process of a host of several (the alone regime)."""
        return self.generate_alone is not None and self.processes > 1

    def to_dict(self) -> dict[str, dict]:
        out = {"model": dataclasses.asdict(self.model)}
        for kind in _CALL_KINDS:
            for key in (kind, *(kind + suffix for suffix in _OPTIONAL_SUFFIXES)):
                if getattr(self, key) is not None:
                    out[key] = dataclasses.asdict(getattr(self, key))
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = "calls") -> CallTimings:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
        missing = [k for k in ("model", *_CALL_KINDS) if k not in data]
        if missing:
            raise ValueError(f"{where}: missing fields {missing}")
        timings = {
            key: _from_dict(kind_cls, data[key], f"{where}.{key}")
            for kind, kind_cls in _CALL_KINDS.items()
            for key in (kind, *(kind + suffix for suffix in _OPTIONAL_SUFFIXES))
            if data.get(key) is not None
        }
        return cls(model=_from_dict(ModelSpec, data["model"], f"{where}.model"), **timings)


_TIMINGS = ("forward", "backward", "decode", "model_decode", "sample")
_KIND = {"generate": "generate", "inference": "forward", "train_step": "train"}  # interface -> profiled call
_INTERFACES = tuple(_KIND)


@dataclass(frozen=True)
class MachineProfile:
    """A measured machine, as ``rlflow profile`` writes it (see the module docstring).

    Attributes:
        host, device, dtype: where the profile ran (``device``: ``"cpu"`` or the GPU's name)
            and the dtype of the layer timings.
        hardware: the machine's rates.
        layer: the profiled layer's shape.
        forward, backward: the layer's forward and backward alone, per ``(batch, seq)``.
        decode: one decode step of the layer at ``seq`` cached tokens.
        model_decode: the same step of a whole one-layer model (embedding, norm, head around
            the layer); empty in profiles without it (its overhead is then priced at 0).
        sample: the sampler's per-token work on ``(batch, vocab)`` logits; empty: priced at 0.
        calls: whole calls of the planned model (CPU profiles taken for a run), or of a
            reference model (the machine profile a run starts from when it calibrates the cost
            model by its own calls, ``placement.calibrate: run``), or ``None``.
        elapsed_s: seconds the measurement took.
        corrections: per interface type (``generate``, ``inference``, ``train_step``), the factor
            a run's own calls measured its estimates off by (measured / estimated seconds of the
            calls of that type on the plan that ran), where those calls kept several devices of a
            host busy: the busy fit of the type is priced times it. ``None``: not measured.
        host_speedups: per profiled call (``generate``, ``forward``, ``train``), how much faster a
            run's one worker ran its calls with a thread per core than with one, measured by the
            run at its own shapes; they replace :meth:`CallTimings.host_speedup` (a reference
            model's) in pricing a plan of one worker. ``None``: not measured.
        alone_corrections: the same factors where the calls ran on one device of a host (a plan
            of one worker): the alone fit of the type is priced times it. A factor measured in
            one regime says little of the other: one worker on every core and the same call
            spread over the host's workers can run at very different shares of their estimates.

    >>> hw = HardwareProfile(1e10, 5e9, 1e9, 1e-5, 8e9)
    >>> layer = ProfiledLayer(64, 128, 4, 4, vocab_size=32)
    >>> p = MachineProfile("host", "cpu", "float32", hw, layer, (LayerTiming(1, 8, 1e-3),), (), ())
    >>> MachineProfile.from_json(p.to_json()) == p
    True
    """

    host: str
    device: str
    dtype: str
    hardware: HardwareProfile
    layer: ProfiledLayer
    forward: tuple[LayerTiming, ...]
    backward: tuple[LayerTiming, ...]
    decode: tuple[LayerTiming, ...]
    model_decode: tuple[LayerTiming, ...] = ()
    sample: tuple[LayerTiming, ...] = ()
    calls: CallTimings | None = None
    elapsed_s: float = 0.0
    corrections: dict[str, float] | None = None
    host_speedups: dict[str, float] | None = None
    alone_corrections: dict[str, float] | None = None

    def to_json(self) -> str:
        """The profile file's text: one JSON object with a ``version`` key."""
        data: dict[str, Any] = {
            "version": PROFILE_VERSION,
            "host": self.host,
            "device": self.device,
            "dtype": self.dtype,
            "hardware": self.hardware.to_dict(),
            "layer": dataclasses.asdict(self.layer),
            **{k: [dataclasses.asdict(t) for t in getattr(self, k)] for k in _TIMINGS},
            "elapsed_s": self.elapsed_s,
        }
        if self.calls is not None:
            data["calls"] = self.calls.to_dict()
        if self.corrections is not None:
            data["corrections"] = dict(self.corrections)
        if self.host_speedups is not None:
            data["host_speedups"] = dict(self.host_speedups)
        if self.alone_corrections is not None:
            data["alone_corrections"] = dict(self.alone_corrections)
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> MachineProfile:
        """Parse a profile file's text.

        Raises:
            ValueError: not JSON, another ``version`` than :data:`PROFILE_VERSION`, or a field
                missing, unknown or of the wrong kind (the message names it).
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"version {data.get('version')!r}, expected {PROFILE_VERSION}")
        missing = [k for k in ("host", "device", "dtype", "hardware", "layer", "forward", "backward", "decode")
                   if k not in data]  # fmt: skip
        if missing:
            raise ValueError(f"missing fields {missing}")
        known = {"version", "calls", *(f.name for f in dataclasses.fields(cls))}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown fields {unknown}")
        timings = {}
        for k in _TIMINGS:
            rows = data.get(k, [])
            if not isinstance(rows, list):
                raise ValueError(f"{k}: expected a list of timings, got {type(rows).__name__}")
            timings[k] = tuple(_from_dict(LayerTiming, row, f"{k}[{i}]") for i, row in enumerate(rows))
        return cls(
            host=data["host"],
            device=data["device"],
            dtype=data["dtype"],
            hardware=HardwareProfile.from_dict(data["hardware"]),
            layer=_from_dict(ProfiledLayer, data["layer"], "layer"),
            calls=CallTimings.from_dict(data["calls"]) if data.get("calls") is not None else None,
            elapsed_s=float(data.get("elapsed_s", 0.0)),
            corrections=_factors(data.get("corrections"), "corrections", _INTERFACES),
            host_speedups=_factors(data.get("host_speedups"), "host_speedups", tuple(_KIND.values())),
            alone_corrections=_factors(data.get("alone_corrections"), "alone_corrections", _INTERFACES),
            **timings,
        )


def _factors(data: Any, name: str, keys: tuple[str, ...]) -> dict[str, float] | None:
    """A profile file's ``name`` (``corrections``, ``host_speedups``): key -> a positive factor."""
    if data is None:
        return None
    if not isinstance(data, dict) or set(data) - set(keys):
        raise ValueError(f"{name}: expected an object with keys among {list(keys)}, got {data!r}")
    factors = {str(k): float(v) for k, v in data.items()}
    if any(not v > 0 for v in factors.values()):
        raise ValueError(f"{name}: factors must be > 0, got {factors}")
    return factors


def save_profile(profile: MachineProfile, path: str | Path) -> Path:
    """Write ``profile`` as JSON to ``path`` (creating its directory, :func:`write_atomic`);
    returns the path."""
    return write_atomic(path, profile.to_json())


def load_profile(path: str | Path) -> MachineProfile:
    """Read a profile written by ``rlflow profile``.

    Raises:
        FileNotFoundError: no file at ``path`` (the message says how to make one).
        ValueError: the file is not a profile of this version; the message names the file and
            the field.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no profile at {path}; create one with `rlflow profile --out {path}`")
    try:
        return MachineProfile.from_json(path.read_text())
    except (ValueError, TypeError) as exc:
        raise ValueError(f"profile {path}: {exc}; measure it again with `rlflow profile --out {path}`") from exc


# ----------------------------------------------------------------------------- rates from a profile


class ProfiledRates(Rates):
    """Device rates read off a profile.

    The profiled layer's timings are split into a fixed per-layer-pass overhead (framework
    dispatch: the smallest decode step's time above its roofline on the measured hardware) and
    an effective FLOP/s, interpolated (log-log) in the tokens of a pass, for the rest. A layer of
    another model is then priced at ``overhead + max(its flops / rate, its bytes / bandwidth)``:
    the measured efficiency, scaled by the model's dimensions. Two more fixed costs come from
    the profile: ``pass_overhead_s`` per pass of a whole stage (what a one-layer model's decode
    step takes beyond its layer and head) and :meth:`sample_step_s` per generated token (the
    sampler's softmax, draw, log-softmax and stop check, by the rows it draws for); profiles
    without these timings price them at 0.
    """

    def __init__(self, profile: MachineProfile, cluster: ClusterSpec, calibrate: bool = True):
        super().__init__(cluster)
        nbytes = profile.layer.bytes_per_param
        spec = profile.layer.spec()
        hw = profile.hardware
        self.bandwidth = hw.memcpy_bandwidth
        decode = [self._work(spec, s, nbytes, decode=True) for s in profile.decode]
        roofline = [max(f / hw.matmul_flops, (m + b) / self.bandwidth) for f, m, b, _, _ in decode]
        self.overhead_s = max(0.0, min((d[4] - r for d, r in zip(decode, roofline)), default=0.0))
        self.pass_overhead_s = self._pass_overhead(spec, profile, nbytes)
        sample = sorted((s.batch, s.seconds) for s in profile.sample)
        self._sample = (np.array([b for b, _ in sample], dtype=np.float64), np.array([t for _, t in sample]))
        forward = [self._work(spec, s, nbytes, decode=False) for s in profile.forward] + decode
        self._fwd = self._table([w[3] for w in forward], [w[0] / self._net(w[4]) for w in forward])
        backward = [self._work(spec, s, nbytes, decode=False) for s in profile.backward]
        rates = [BACKWARD_FLOPS_FACTOR * w[0] / self._net(w[4]) for w in backward]
        self._bwd = self._table([w[3] for w in backward], rates)
        # (fixed_s, scale) per interface type with every worker of a host busy, and with one
        # worker alone (profiles that timed it); see call_scale.
        self.busy_fits: dict[str, tuple[float, float]] = {}
        self.alone_fits: dict[str, tuple[float, float]] = {}
        self.busy_processes = 1
        # The fits price the profiled calls as measured; a run's corrections apply on top of them.
        self.corrections: dict[str, float] = {}
        self.alone_corrections: dict[str, float] = {}
        if calibrate and profile.calls is not None:
            calls = profile.calls
            # Both fits price the profiled calls uncalibrated: neither is set until both are made.
            busy = {
                kind: self._calibrate(calls.timings(_KIND[kind]), calls.model, cluster, kind) for kind in _INTERFACES
            }
            alone = {}
            if calls.timed_alone:
                alone = {kind: self._calibrate(calls.timings(_KIND[kind], alone=True), calls.model, cluster, kind)
                         for kind in _INTERFACES}  # fmt: skip
            self.busy_fits, self.alone_fits, self.busy_processes = busy, alone, calls.processes
        if calibrate:
            self.corrections = dict(profile.corrections or {})
            self.alone_corrections = dict(profile.alone_corrections or {})

    def _calibrate(
        self, timings: list[RolloutTiming | BatchTiming], model: ModelSpec, cluster: ClusterSpec, interface: str
    ) -> tuple[float, float]:
        """``(fixed_s, scale)`` of one interface type from profiled whole calls of that type
        (``timings``: one regime's, one or two batch sizes).

        The layer timings miss what a whole call adds at the planned model's shape: the HF
        model's per-pass work around its layers, the sampler's bookkeeping (its Python per decode
        step), masks with padding, the loss and the optimizer, FSDP's work around its collectives
        and, on a CPU host, what busy workers cost each other. The planned model's calls are
        priced by these rates (uncalibrated) on the layout they were timed on — one device, or
        FSDP over the processes that ran them — and set against their measurement, collectives
        left out (they are priced on their own): with two batch sizes, a line ``measured =
        fixed_s + scale * priced`` through both (on a tiny CPU model most of a call is the fixed
        part: per-op dispatch per layer and decode step, not FLOPs); with one, or when noise
        makes the line's parts negative, the ratio alone (``fixed_s = 0``). ``fixed_s`` is per
        call (generation, inference) or per optimizer step (training); ``scale`` lies in
        ``[1/16, 16]``.
        """
        points = [self._priced(model, timing, cluster, interface) for timing in timings]
        (p1, m1), *rest = sorted(points)
        if rest and rest[-1][0] > p1 * 1.05:
            p2, m2 = rest[-1]
            scale = (m2 - m1) / (p2 - p1)
            fixed = m1 - scale * p1
            if fixed >= 0 and 1 / 16 <= scale <= 16:
                return float(fixed), float(scale)
        ratio = sum(m for _, m in points) / max(sum(p for p, _ in points), 1e-12)
        return 0.0, float(np.clip(ratio, 1 / 16, 16))

    def _priced(self, model: ModelSpec, timing, cluster: ClusterSpec, interface: str) -> tuple[float, float]:
        """``(priced, measured)`` seconds of one profiled call without its collectives, priced
        uncalibrated on the layout it ran on."""
        from rlflow.dataflow.mfc import MFCDef
        from rlflow.planner.cost import Workload, call_cost
        from rlflow.planner.mesh import DeviceMesh
        from rlflow.strategy import ParallelStrategy

        if interface == "generate":
            workload = Workload(timing.prompts, timing.prompt_len, timing.gen_len, timing.n)
        else:  # the rows of every process, in one mini-batch
            workload = Workload(timing.rows * timing.dp, timing.seq, 0, n_ppo_minibatches=1,
                                gradient_checkpointing=False, max_tokens_per_mb=None)  # fmt: skip
        objective = "rl" if interface == "train_step" else None  # the actor's calls were timed
        mfc = MFCDef(f"profiled_{interface}", "profiled", interface, objective=objective)
        dp = timing.dp
        mesh = (
            DeviceMesh(1, 1, devices_per_node=cluster.devices_per_node)
            if dp == 1
            else DeviceMesh(1, dp, devices_per_node=dp)
        )
        # Called before any fit is set: the rates price it uncalibrated.
        cost = call_cost(mfc, model, ParallelStrategy(dp=dp), mesh, cluster, workload, self)
        comm = cost.breakdown.get("fsdp_exposed_s", 0.0) + cost.breakdown.get("sync_s", 0.0)
        return max(cost.time_s - comm, 1e-12), max(timing.seconds - comm, 0.0)

    @property
    def call_scales(self) -> dict[str, float]:
        """The busy fit's scale per interface type (empty without calibration)."""
        return {kind: scale for kind, (_, scale) in self.busy_fits.items()}

    @property
    def call_fixed(self) -> dict[str, float]:
        """The busy fit's fixed seconds per interface type (empty without calibration)."""
        return {kind: fixed for kind, (fixed, _) in self.busy_fits.items()}

    def _fit(self, interface_type: str, busy_devices: int | None) -> tuple[float, float]:
        """``(fixed_s, scale)`` of a call keeping ``busy_devices`` devices of a host busy: the alone
        fit for one, the busy fit for the profiled processes or more (or None), linear in
        between; the busy fit alone when the profile has no alone timings; each times the
        profile's correction of the interface type in its regime (:attr:`MachineProfile.corrections`,
        :attr:`MachineProfile.alone_corrections`)."""
        busy = self.busy_fits.get(interface_type, (0.0, 1.0))
        alone = self.alone_fits.get(interface_type)
        c = self.corrections.get(interface_type, 1.0)  # a run's own calls against these estimates
        if alone is None or busy_devices is None or busy_devices >= self.busy_processes:
            return c * busy[0], c * busy[1]
        a = self.alone_corrections.get(interface_type, 1.0)
        w = (max(busy_devices, 1) - 1) / (self.busy_processes - 1)
        return (1 - w) * a * alone[0] + w * c * busy[0], (1 - w) * a * alone[1] + w * c * busy[1]

    def call_scale(self, interface_type: str, busy_devices: int | None = None) -> float:
        return self._fit(interface_type, busy_devices)[1]

    def call_fixed_s(self, interface_type: str, busy_devices: int | None = None) -> float:
        return self._fit(interface_type, busy_devices)[0]

    def _pass_overhead(self, spec: ModelSpec, profile: MachineProfile, nbytes: int) -> float:
        """Seconds a whole model's pass adds to its layers (embedding, rotary, masks, final norm,
        head launch): the one-layer model's decode step minus the bare layer's at the same size
        and minus the head's roofline; the median over sizes, at least 0."""
        layer_s = {(s.batch, s.seq): s.seconds for s in profile.decode}
        extra = []
        for s in profile.model_decode:
            if (s.batch, s.seq) not in layer_s:
                continue
            head_flops = 2.0 * spec.hidden_size * spec.vocab_size * s.batch
            head_bytes = (spec.hidden_size * spec.vocab_size + s.batch * (spec.hidden_size + spec.vocab_size)) * nbytes
            head = max(head_flops / profile.hardware.matmul_flops, head_bytes / self.bandwidth)
            extra.append(s.seconds - layer_s[(s.batch, s.seq)] - head)
        return max(0.0, float(np.median(extra))) if extra else 0.0

    def sample_step_s(self, rows):
        """The profiled sampler step, interpolated in the rows; beyond the largest profiled batch
        it grows in proportion to the rows (the draw and log-softmax stream every row's logits)."""
        batch, seconds = self._sample
        rows = np.asarray(rows, dtype=np.float64)
        if batch.size == 0:
            return np.zeros_like(rows)
        return np.where(rows > batch[-1], seconds[-1] * rows / batch[-1], np.interp(rows, batch, seconds))

    def _net(self, seconds: float) -> float:
        """Measured seconds without the fixed overhead (at least a tenth of the measurement)."""
        return max(seconds - self.overhead_s, 0.1 * seconds)

    @staticmethod
    def _work(
        spec: ModelSpec, sample: LayerTiming, nbytes: int, decode: bool
    ) -> tuple[float, float, float, int, float]:
        """``(flops, matmul_bytes, stream_bytes, tokens, seconds)`` of one profiled pass."""
        batch, seq = sample.batch, sample.seq
        new, pairs = (1, seq + 1) if decode else (seq, seq * (seq + 1) / 2)
        flops, matmul, stream = layer_work(spec, 1, batch, new, pairs, nbytes, seq if decode else 0)
        return float(flops), float(matmul), float(stream), batch * new, float(sample.seconds)

    @staticmethod
    def _table(tokens, rates) -> tuple[np.ndarray, np.ndarray]:
        """``log(tokens)`` and ``log(rate)`` of the samples, by tokens. Rates are not forced to grow
        with the tokens: on a CPU a pass whose activations leave the cache runs slower per FLOP."""
        order = np.argsort(tokens, kind="stable")
        return np.log(np.asarray(tokens, dtype=np.float64)[order]), np.log(np.asarray(rates, dtype=np.float64)[order])

    def flops_rate(self, tokens, backward: bool = False):
        """Effective FLOP/s of a pass over ``tokens`` tokens (clamped to the profiled range)."""
        x, y = self._bwd if backward else self._fwd
        return np.exp(np.interp(np.log(np.maximum(np.asarray(tokens, dtype=np.float64), 1.0)), x, y))

    def compute_s(self, flops, matmul_bytes, stream_bytes, tokens, backward: bool = False, nbytes: int | None = None):
        """The profiled layer's rates already hold its element-wise kernels: one roofline for all bytes."""
        moved = np.asarray(matmul_bytes) + np.asarray(stream_bytes)
        rate = self.flops_rate(tokens, backward)
        return self.overhead_s + np.maximum(np.asarray(flops) / rate, moved / self.bandwidth)

    @classmethod
    def from_profile(
        cls, profile: MachineProfile | str | Path, cluster: ClusterSpec, calibrate: bool = True
    ) -> ProfiledRates:
        """Rates of ``profile``, or of the profile file at that path (:func:`load_profile`)."""
        return cls(profile if isinstance(profile, MachineProfile) else load_profile(profile), cluster, calibrate)
