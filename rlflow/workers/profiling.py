"""``rlflow profile``: measure this machine so the cost model can price plans for it.

Measures what :class:`rlflow.planner.profile.MachineProfile` records: hardware rates, timings of
one real HF Llama decoder layer for a few (batch, sequence) sizes — forward, backward, and one
decode step against a KV cache — and, for a run, whole calls of the planned model as workers run
them (the rollout sampler, and a ``TrainEngine`` on FSDP over gloo worker processes, forked from
the profiling process where that is sound, else spawned). On CPU
the layer is small and runs in fp32 on one thread (as each CPU worker does); with CUDA it is a
LLaMA-2-7B layer in bf16.

It lives here, above the engines it runs, and not in the planner: the planner only reads a
profile and prices with it (:class:`rlflow.planner.profile.ProfiledRates`). The workers layer is
where a call runs the way a worker runs it, and its package imports nothing on its own, so a
spawned gloo process imports only the engine, not the driver.
"""

from __future__ import annotations

import contextlib
import json
import os
import pkgutil
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from rlflow.files import write_atomic
from rlflow.planner.model_spec import ModelSpec
from rlflow.planner.profile import (
    PROFILE_VERSION,
    BatchTiming,
    CallTimings,
    HardwareProfile,
    LayerTiming,
    MachineProfile,
    ProfiledLayer,
    RolloutTiming,
    cached_profile_path,
    default_profile_path,
    load_profile,
    profile_cache_key,
    save_profile,
)

# Layer shapes and sizes profiled per device kind: (batch, seq) for forward/backward,
# (batch, context) for decode steps. CPU sizes are small, to keep the whole profile short.
_CPU_LAYER = dict(num_layers=1, hidden_size=256, intermediate_size=688, num_heads=8, num_kv_heads=8, vocab_size=256)
_CPU_PASSES = ((1, 64), (4, 128), (4, 256))
_CPU_DECODE = ((1, 128), (8, 128), (32, 128))
_CUDA_LAYER = dict(
    num_layers=1, hidden_size=4096, intermediate_size=11008, num_heads=32, num_kv_heads=32, vocab_size=32000
)
_CUDA_PASSES = ((1, 512), (4, 1024), (16, 1024), (32, 2048))
_CUDA_DECODE = ((1, 1024), (16, 1024), (64, 1024), (256, 1024))


# ----------------------------------------------------------------------------- hardware rates


def _timed(fn, repeat: int, sync, warm_up: bool = True) -> float:
    """Seconds per call of ``fn``: the mean over ``repeat`` calls, after one warm-up call unless
    ``warm_up`` is false (``fn`` already ran in this process)."""
    if warm_up:
        fn()
        sync()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync()
    return (time.perf_counter() - start) / repeat


def _loopback(nbytes: int = 32 << 20, pings: int = 200) -> tuple[float, float]:
    """Bandwidth (bytes/s) and one-way latency (s) of a local TCP connection."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            for _ in range(pings):
                conn.sendall(conn.recv(1))
            received = 0
            while received < nbytes:
                received += len(conn.recv(1 << 20))
            conn.sendall(b"k")

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        for _ in range(pings):
            client.sendall(b"p")
            client.recv(1)
        latency = (time.perf_counter() - start) / pings / 2
        payload = bytes(1 << 20)
        start = time.perf_counter()
        for _ in range(nbytes >> 20):
            client.sendall(payload)
        client.recv(1)
        bandwidth = nbytes / (time.perf_counter() - start)
    thread.join()
    server.close()
    return bandwidth, latency


def _gloo_process(rank: int, world: int, port: int, job, args: tuple, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # as rlflow runs CPU workers
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out.put((rank, job(rank, *args)))
    finally:
        dist.destroy_process_group()
    # Done: skip the interpreter's teardown of torch and transformers (a second and more).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start_method(threads: int) -> str:
    """How :func:`_in_gloo_processes` starts processes that compute on ``threads`` threads:
    ``fork`` where a forked child is sound, else ``spawn``.

    A forked child starts at once with this process's imports; a spawned one imports torch and
    transformers again, seconds of a profile. Forking is sound here when no other thread of this
    process runs but tqdm's monitor (a lock another thread held would stay held in the child; the
    monitor only refreshes open bars, which the child does not touch), this process has no process
    group, no Ray and no CUDA, and the child computes on one thread: GNU OpenMP's thread pool,
    which this process may have used, does not survive a fork (a parallel region of more threads
    in the child never returns).
    """
    import multiprocessing

    torch = sys.modules.get("torch")
    ray = sys.modules.get("ray")
    others = [t for t in threading.enumerate() if t is not threading.current_thread()]
    sound = (
        threads == 1
        and "fork" in multiprocessing.get_all_start_methods()
        and all(type(t).__name__ == "TMonitor" for t in others)
        and not (ray is not None and ray.is_initialized())
        and not (torch is not None and (torch.distributed.is_initialized() or torch.cuda.is_initialized()))
    )
    return "fork" if sound else "spawn"


def _in_gloo_processes(job, world: int, *args, threads: int = 1) -> list:
    """``job(rank, *args)`` in ``world`` new processes that form one gloo group (the default process
    group) and compute on one thread each, ``threads`` where the job sets more; their results in
    rank order. ``job`` must be importable (a module-level function) and its results small."""
    import torch.multiprocessing as mp

    from rlflow.rendezvous import free_port, main_module_hidden

    method = _start_method(threads)
    out = mp.get_context(method).SimpleQueue()
    # A spawned child must not run the script of a __main__ without a main guard again.
    with main_module_hidden() if method == "spawn" else contextlib.nullcontext():
        context = mp.start_processes(
            _gloo_process, args=(world, free_port(), job, args, out), nprocs=world, start_method=method, join=False
        )
    while not context.join():
        pass
    results = dict(out.get() for _ in range(world))
    return [results[rank] for rank in range(world)]


LATENCY_ITERS = 100  # small all-reduces timed for the gloo latency (after ten untimed)
_LATENCY = "collective_latency_s"  # its key among the call-timing processes' seconds


def _all_reduce_seconds(rank: int, iters: int) -> float:
    import torch
    import torch.distributed as dist

    x = torch.ones(16)
    for _ in range(10):
        dist.all_reduce(x)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    return (time.perf_counter() - start) / iters


def gloo_collective_latency(iters: int = LATENCY_ITERS) -> float:
    """Seconds of one small gloo all-reduce between two single-threaded worker processes.

    What a tensor-parallel CPU layer pays per collective, on top of moving its bytes: the
    socket round trips, gloo's own protocol and the wake-up of the peer process, which a raw
    TCP ping (``loopback_latency_s``) does not see (measured here at tens of times more).
    """
    return float(_in_gloo_processes(_all_reduce_seconds, 2, iters)[0])


def measure_hardware(device: str = "cpu") -> HardwareProfile:
    """Matmul FLOP/s, memory-copy bandwidth, loopback bandwidth/latency and host memory (about a second)."""
    import torch

    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n = 8192 if cuda else 384
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    matmul_s = _timed(lambda: a @ b, 10 if cuda else 3, sync)
    src = torch.empty(256 << 20 if cuda else 32 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = _timed(lambda: dst.copy_(src), 10 if cuda else 3, sync)
    loop_bw, loop_lat = _loopback()
    return HardwareProfile(
        matmul_flops=2.0 * n**3 / matmul_s,
        memcpy_bandwidth=2.0 * src.numel() / copy_s,  # read + write
        loopback_bandwidth=loop_bw,
        loopback_latency_s=loop_lat,
        host_memory_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
    )


# ----------------------------------------------------------------------------- layer timings


def _build_layer(spec: ModelSpec, device: str, dtype):
    """The profiled decoder layer, its rotary embedding, and a one-layer causal LM of the same shape."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        num_hidden_layers=1,
        vocab_size=spec.vocab_size,
    )
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, layer_idx=0).to(device=device, dtype=dtype)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    return config, layer, LlamaRotaryEmbedding(config).to(device), model


def _call_model(spec: dict, dtype):
    """An HF Llama causal LM of the planned model's shape (``spec``: :class:`ModelSpec` fields),
    whose whole calls are timed (:func:`_time_call`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_attention_heads=spec["num_heads"],
        num_key_value_heads=spec["num_kv_heads"],
        head_dim=spec.get("head_dim") or spec["hidden_size"] // spec["num_heads"],
        num_hidden_layers=spec["num_layers"],
        vocab_size=spec["vocab_size"],
        tie_word_embeddings=spec.get("tie_embeddings", False),
        attention_bias=spec.get("qkv_bias", False),
        mlp_bias=spec.get("mlp_bias", False),
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).to(dtype=dtype)


def _left_padded(rows: int, length: int, vocab: int):
    """Random ids and a mask whose every other row is left-padded by a quarter of ``length``,
    as a batch of prompts of unequal lengths is."""
    import torch

    ids = torch.randint(vocab, (rows, length))
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[::2, : length // 4] = 0
    return ids, mask


def _time_call(kind: str, rollout, engine, shape: dict, warm_up: bool = True) -> float:
    """Seconds of one whole call of the planned model, run as rlflow's workers run it:
    ``generate`` (the HF rollout engine over ``rollout``, whatever its sampler's decode loop:
    prefill, cache repeat, ``gen_len`` decode steps — no stop tokens, so every row runs to
    ``gen_len`` as priced), ``forward`` (log-probs and entropies of every token) or ``train``
    (one optimizer step of the PPO-family policy loss: that forward, the loss, backward,
    gradient clip, AdamW step), both through ``engine`` (a ``TrainEngine``). ``warm_up``: one
    untimed call first (the first call of a kind pays its one-time costs: FSDP's lazy set-up,
    the optimizer's state, the sampler's buffers)."""
    import torch

    from rlflow.algos.params import AlgorithmParams
    from rlflow.engine.rollout.base import SamplingParams
    from rlflow.engine.rollout.hf_sampler import HFRolloutEngine
    from rlflow.workers.interfaces.base import train_epochs
    from rlflow.workers.losses import policy_loss_fn

    vocab, no_sync = rollout.config.vocab_size, lambda: None
    if kind == "generate":
        ids, mask = _left_padded(shape["prompts"], shape["prompt_len"], vocab)
        params = SamplingParams(n=shape["n"], max_new_tokens=shape["gen_len"], seed=0)
        sampler = HFRolloutEngine(rollout, pad_token_id=0)

        def generate():
            # In a run every rollout follows a weight update, which voids what a sampler keeps
            # per set of weights (the lean decoder's fused matrices): update them in place too.
            with torch.no_grad():
                for p in rollout.parameters():
                    p.mul_(1.0)
            sampler.generate((ids, mask), params)

        return _timed(generate, _CALL_REPEATS, no_sync, warm_up)
    ids, mask = _left_padded(shape["rows"], shape["seq"], vocab)
    if kind == "forward":
        forward = lambda: engine.forward({"input_ids": ids, "attention_mask": mask})  # noqa: E731
        return _timed(forward, _CALL_REPEATS, no_sync, warm_up)
    batch = {"input_ids": ids, "attention_mask": mask, "response_mask": mask,
             "old_logp": torch.full(ids.shape, -4.0), "advantages": torch.randn(ids.shape)}  # fmt: skip
    loss = policy_loss_fn(AlgorithmParams().resolved(), kl_coef=0.0)  # what the workers receive
    return _timed(
        lambda: train_epochs(engine, batch, loss, epochs=1, num_mini_batches=1, loss_mask_key="response_mask"),
        _CALL_REPEATS,
        no_sync,
        warm_up,
    )


_CALLS = ("generate", "forward", "train")
# A whole call is timed once after a warm-up call, in CALL_ROUNDS rounds: a call lasts long
# enough that one timing is steady, and the whole-call timings are most of a profile's time.
_CALL_REPEATS = 1
CALL_ROUNDS = 1


def _call_shapes(calls: dict, suffix: str = "") -> dict[str, dict]:
    """The shape each kind of call is timed at: ``calls["generate" + suffix]`` and
    ``calls["train" + suffix]`` (the training shape is also timed as a forward). Suffixes: ``""``
    (the run's per-worker shape), ``"_alt"`` (a second batch size), ``"_alone"`` and
    ``"_alone_alt"`` (one process by itself: the whole batch and one worker's share)."""
    gen, train = calls["generate" + suffix], calls["train" + suffix]
    return {"generate": gen, "forward": train, "train": train}


def _suffixes(calls: dict, alone: bool) -> list[str]:
    """The shape suffixes ``calls`` describes of one regime: with every process busy, or one alone."""
    return [s for s in (("_alone", "_alone_alt") if alone else ("", "_alt")) if "train" + s in calls]


def _median_call_seconds(
    rollout, engine, calls: dict, suffixes: list[str], rounds: int, warmed: set[str] | None = None
) -> dict[str, float]:
    """Median seconds of every call kind at every shape of ``suffixes``, in round-robin rounds.

    Only a kind's first call on ``rollout`` and ``engine`` is warmed up (``warmed``: the kinds
    that already ran on them, updated): its one-time costs (FSDP's lazy set-up, the optimizer's
    state) are paid once, not once per shape."""
    warmed = set() if warmed is None else warmed

    def timed(kind: str, shape: dict) -> float:
        seconds = _time_call(kind, rollout, engine, shape, warm_up=kind not in warmed)
        warmed.add(kind)
        return seconds

    shapes = [(suffix, _call_shapes(calls, suffix)) for suffix in suffixes]
    keys = [kind + suffix for suffix, _ in shapes for kind in _CALLS]
    timings = [[timed(k, s[k]) for _, s in shapes for k in _CALLS] for _ in range(rounds)]
    return dict(zip(keys, np.median(timings, axis=0).tolist()))


def _call_parts(calls: dict):
    """The planned model's weights (``torch.manual_seed(0)``: the same in every process), its
    rollout copy in the workers' compute dtype, and the training engine's config."""
    import copy

    import torch

    from rlflow.engine.optim import OptimConfig
    from rlflow.engine.train_engine import EngineConfig

    torch.manual_seed(0)
    master = _call_model(calls["model"], torch.float32)
    # The workers' precision: fp32 master weights in training, the sampler's copy in the compute dtype.
    precision = calls.get("precision", "fp32")
    rollout = copy.deepcopy(master).to(torch.bfloat16 if precision == "bf16" else torch.float32).eval()
    optim = OptimConfig(lr=1e-6, max_grad_norm=1.0)  # the weights barely move between repetitions
    return master, rollout, EngineConfig(device="cpu", optim=optim, mixed_precision=precision)


def _engine_on(ranks: range, master, config):
    """A ``TrainEngine`` on FSDP over ``ranks`` of the default group (collective); None off them."""
    import copy

    from rlflow.engine.train_engine import TrainEngine
    from rlflow.parallel.groups import build_call_groups
    from rlflow.strategy import ParallelStrategy

    groups = build_call_groups(ranks, ParallelStrategy(dp=len(ranks)), "cpu")
    return None if groups is None else TrainEngine(copy.deepcopy(master), groups.mesh, config)


def _busy_call_seconds(rank: int, calls: dict, rounds: int) -> dict[str, float]:
    """One worker-like process of :func:`concurrent_call_seconds` with every process busy: its
    medians of the busy shapes (training on FSDP over all the processes) and, with two or more,
    the seconds of one small all-reduce among them."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    master, rollout, config = _call_parts(calls)
    engine = _engine_on(range(world), master, config)
    torch.manual_seed(rank)  # each rank its own rows
    dist.barrier()
    seconds = {_LATENCY: _all_reduce_seconds(rank, LATENCY_ITERS)} if world > 1 else {}
    return seconds | _median_call_seconds(rollout, engine, calls, _suffixes(calls, alone=False), rounds)


def _alone_call_seconds(rank: int, calls: dict, rounds: int) -> dict[str, float]:
    """The ``*_alone`` shapes timed in this process, the only one at work, on an engine of its
    rank only (no FSDP, as a one-worker plan trains) — and the whole batch again on
    ``calls["host_threads"]`` threads when given (a plan of one worker may take every core).
    Runs in a group of one process: the default one (a spawned process of
    :func:`_in_gloo_processes`), or one of this process's own for the call."""
    import torch
    import torch.distributed as dist

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
            master, rollout, config = _call_parts(calls)
            single = _engine_on(range(1), master, config)
            torch.set_num_threads(1)
            warmed: set[str] = set()
            seconds = _median_call_seconds(rollout, single, calls, _suffixes(calls, alone=True), rounds, warmed)
            if calls.get("host_threads"):
                torch.set_num_threads(calls["host_threads"])
                host = {**calls, "generate_host": calls["generate_alone"], "train_host": calls["train_alone"]}
                seconds.update(_median_call_seconds(rollout, single, host, ["_host"], rounds, warmed))
    finally:
        torch.set_num_threads(threads)
        if own_group:
            dist.destroy_process_group()
    return seconds


def concurrent_call_seconds(calls: dict, processes: int, rounds: int = CALL_ROUNDS) -> dict[str, float]:
    """Seconds of the planned model's whole calls (:func:`_time_call`) on CPU in ``processes``
    single-threaded worker processes at once, the slowest process's median: each its own
    rollout of the per-worker shape, and a forward and a training step of a ``TrainEngine`` on
    FSDP over all of them (dp = ``processes``, gloo), as a data-parallel plan runs them; with two
    or more processes, also the seconds of one small all-reduce among them
    (``collective_latency_s``, as :func:`gloo_collective_latency` measures it). Then, when
    ``calls`` has them, the ``*_alone`` shapes in one process while no other works (keys
    ``generate_alone``, ``train_alone_alt``, ...), and the whole batch again in that process with
    ``calls["host_threads"]`` threads, when given (``generate_host``, ``forward_host``,
    ``train_host``): in this process, or in one spawned for them where this one is a rank of a
    larger process group.

    A CPU device is one worker process: when a plan keeps every worker of a host busy, they
    share its caches and memory bandwidth, and Ray's daemons and the driver take their slices
    of its cores; FSDP adds its hooks, copies and collectives around every unit. A
    data-parallel call lasts as long as its slowest rank. A call on one worker of a host whose
    other workers idle has the host to itself: the ``*_alone`` timings price it.
    """
    import torch.distributed as dist

    per_process = _in_gloo_processes(_busy_call_seconds, processes, calls, rounds)
    seconds = {k: max(p[k] for p in per_process) for k in per_process[0]}
    if _suffixes(calls, alone=True):
        if dist.is_initialized() and dist.get_world_size() > 1:
            threads = calls.get("host_threads") or 1
            seconds |= _in_gloo_processes(_alone_call_seconds, 1, calls, rounds, threads=threads)[0]
        else:
            seconds |= _alone_call_seconds(0, calls, rounds)
    return seconds


def _decode_step(config, model, batch: int, context: int, device: str):
    """One decode step of the whole one-layer model at ``context`` cached tokens (the cache is
    cropped back after it, so that repetitions see the same context)."""
    import torch
    from transformers.cache_utils import DynamicCache

    from rlflow.engine.models import cache_kwarg

    ids = torch.randint(config.vocab_size, (batch, context), device=device)
    mask = torch.ones(batch, context + 1, dtype=torch.long, device=device)
    cache = DynamicCache(config=config)
    cached = {cache_kwarg(model.forward): cache}  # the name this transformers takes the cache under
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask[:, :-1], **cached, use_cache=True)
    new, pos = ids[:, -1:], torch.full((batch, 1), context, device=device)

    @torch.no_grad()
    def step():
        model(
            input_ids=new,
            attention_mask=mask,
            position_ids=pos,
            **cached,
            use_cache=True,
            logits_to_keep=1,
        )
        cache.crop(-1)

    return step


def _sample_step(config, batch: int, device: str):
    """The rollout engine's per-token work on ``(batch, vocab)`` logits: sample from the softmax,
    the log-softmax of the drawn tokens, and the stop-token check."""
    import torch

    logits = torch.randn(batch, config.vocab_size, device=device)
    stop = torch.tensor([0], device=device)
    generator = torch.Generator(device=device).manual_seed(0)

    def step():
        tokens = torch.multinomial(torch.softmax(logits / 1.0, dim=-1), 1, generator=generator).squeeze(1)
        torch.log_softmax(logits.float() / 1.0, dim=-1).gather(-1, tokens.unsqueeze(-1))
        torch.isin(tokens, stop)

    return step


def _layer_timer(kind: str, batch: int, seq: int, parts, device: str, dtype, sync) -> Callable[[], float]:
    """The seconds of one ``kind`` timing at ``(batch, seq)`` as a function to call once per round:
    what the timing needs — its inputs, a KV cache filled with ``seq`` tokens — is made here, once
    (filling the cache took longer than timing its decode steps), and only the first round warms
    the timed functions up."""
    import torch
    from transformers.cache_utils import DynamicCache

    from rlflow.engine.models import cache_kwarg

    config, layer, rope, model = parts
    warmed = set()

    def timed(fn, repeat: int) -> float:  # each function warmed up in its first round only
        first = fn not in warmed
        warmed.add(fn)
        return _timed(fn, repeat, sync, warm_up=first)

    if kind == "model_decode":
        step = _decode_step(config, model, batch, seq, device)
        return lambda: timed(step, 5)
    if kind == "sample":
        step = _sample_step(config, batch, device)
        return lambda: timed(step, 10)
    h = config.hidden_size
    x = torch.randn(batch, seq, h, device=device, dtype=dtype, requires_grad=kind == "backward")
    pe = rope(x, torch.arange(seq, device=device)[None].expand(batch, -1))

    @torch.no_grad()
    def forward():
        layer(x, position_embeddings=pe)

    if kind == "forward":
        return lambda: timed(forward, 3)
    if kind == "backward":

        def step():
            layer(x, position_embeddings=pe).sum().backward()

        # Forward + backward, minus a forward: the backward alone.
        return lambda: max(timed(step, 2) - timed(forward, 2), 1e-9)
    cache = DynamicCache(config=config)
    cached = {cache_kwarg(layer.forward): cache}
    with torch.no_grad():
        layer(x, position_embeddings=pe, **cached, use_cache=True)
        new = torch.randn(batch, 1, h, device=device, dtype=dtype)
        pe1 = rope(new, torch.full((batch, 1), seq, device=device))

    @torch.no_grad()
    def decode():
        layer(new, position_embeddings=pe1, **cached, use_cache=True)
        cache.crop(-1)  # drop the new token: the context length stays fixed across repetitions

    return lambda: timed(decode, 5)


def run_profile(
    path: str | Path | None = None,
    device: str | None = None,
    progress: bool | None = None,
    passes: tuple[tuple[int, int], ...] | None = None,
    decodes: tuple[tuple[int, int], ...] | None = None,
    layer: dict[str, int] | None = None,
    rounds: int = 3,
    calls: dict | None = None,
    call_processes: int = 1,
    call_rounds: int = CALL_ROUNDS,
) -> MachineProfile:
    """Measure this machine and write the profile JSON.

    Args:
        path: where to write; ``None``: :func:`default_profile_path`.
        device: ``"cpu"`` or ``"cuda"``; ``None``: CUDA when available.
        progress: show a tqdm bar; ``None``: when stderr is a terminal.
        passes: ``(batch, seq)`` sizes of the forward/backward timings (default per device kind).
        decodes: ``(batch, context)`` sizes of the decode-step timings; the whole one-layer
            model's decode step and the sampler's per-token work are timed at the same sizes.
        layer: ``hidden_size``, ``intermediate_size``, ``num_heads``, ``num_kv_heads`` and
            optionally ``vocab_size`` of the layer to profile (default per device kind);
            profiling the shape of the model to be planned removes the error of scaling the
            measured rates across model sizes.
        rounds: every size is timed once per round, rounds one after another; the profile
            keeps the median.
        calls: whole calls of the planned model to time on CPU workers, which calibrate the
            cost model's estimates of its calls (:class:`ProfiledRates`): ``model``
            (:class:`ModelSpec` fields of the actor), ``generate`` (``prompts``, ``prompt_len``,
            ``n`` samples per prompt, ``gen_len``) and ``train`` (``rows``, ``seq``; also timed
            as a forward), the shapes one worker runs, and optionally ``generate_alt`` and
            ``train_alt`` at another batch size (both, or neither), and ``generate_alone``,
            ``train_alone`` (optionally with ``_alone_alt``) timed in one process while the
            others idle (how a one-worker plan runs); see
            ``rlflow.trainer.placement.profile_shapes``.
        call_processes: the worker processes that time those calls at once
            (:func:`concurrent_call_seconds`; the workers of one host).
        call_rounds: the rounds of whole-call timings (their median is kept).

    Raises:
        ValueError: ``calls`` with a CUDA device (GPU clusters are priced from the presets).

    Returns:
        The profile (also written to ``path``).
    """
    import torch
    from tqdm.auto import tqdm

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    spec = ModelSpec(**{**(_CUDA_LAYER if cuda else _CPU_LAYER), **(layer or {})}, name="profile-layer")
    passes = passes or (_CUDA_PASSES if cuda else _CPU_PASSES)
    decodes = decodes or (_CUDA_DECODE if cuda else _CPU_DECODE)
    if calls and cuda:
        raise ValueError("run_profile(calls=...) times whole calls in CPU worker processes; use device='cpu'")
    jobs = (
        [("forward", b, s) for b, s in passes]
        + [("backward", b, s) for b, s in passes]
        + [("decode", b, c) for b, c in decodes]
        + [("model_decode", b, c) for b, c in decodes]
        + [("sample", b, 0) for b, _ in decodes]
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread per worker process, as rlflow runs CPU workers
    start = time.perf_counter()
    try:
        disable = None if progress is None else not progress  # tqdm's None: hidden when stderr is no terminal
        bar = tqdm(total=len(jobs) + 1, desc=f"rlflow profile ({device})", disable=disable)
        hardware = measure_hardware(device)
        measured_calls, latency = _timed_calls(calls, call_processes, call_rounds) if calls else (None, None)
        if not cuda:  # CPU workers talk through gloo; NCCL's latencies come from the GPU presets
            # the call-timing processes measure it where there are two of them (no second spawn)
            hardware = replace(hardware, collective_latency_s=latency or gloo_collective_latency())
        bar.update()
        parts = _build_layer(spec, device, dtype)
        samples: dict[str, list[LayerTiming]] = {
            k: [] for k in ("forward", "backward", "decode", "model_decode", "sample")
        }
        # Round-robin rounds, the median per size: a burst of load from other jobs on a shared
        # machine disturbs one round of every size rather than every round of one size.
        timers = [_layer_timer(kind, b, s, parts, device, dtype, sync) for kind, b, s in jobs]
        timings = [[timer() for timer in timers] for _ in range(rounds)]
        del timers  # their inputs and KV caches
        for (kind, batch, seq), seconds in zip(jobs, np.median(timings, axis=0)):
            samples[kind].append(LayerTiming(batch, seq, float(seconds)))
        bar.update(len(jobs))
        bar.close()
    finally:
        torch.set_num_threads(threads)
    profile = MachineProfile(
        host=socket.gethostname(),
        device=torch.cuda.get_device_name() if cuda else "cpu",
        dtype=str(dtype).removeprefix("torch."),
        hardware=hardware,
        layer=ProfiledLayer(
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            vocab_size=spec.vocab_size,
            bytes_per_param=2 if cuda else 4,  # the dtype the layer ran in
        ),
        **{k: tuple(v) for k, v in samples.items()},
        calls=measured_calls,
        elapsed_s=time.perf_counter() - start,
    )
    save_profile(profile, path if path is not None else default_profile_path())
    return profile


def _timed_calls(calls: dict, processes: int, rounds: int) -> tuple[CallTimings, float | None]:
    """The whole calls ``calls`` describes (see :func:`run_profile`), timed in ``processes``
    worker processes at once; each record says the layout it ran on (``dp``: the rollouts run
    one per process, the forward and training step on FSDP over all of them). Also the seconds of
    a small all-reduce between those processes (:func:`gloo_collective_latency`'s figure), None
    for one process."""
    seconds = concurrent_call_seconds(calls, processes, rounds)
    latency = seconds.pop(_LATENCY, None)
    timings = {}
    for alone in (False, True):
        busy = 1 if alone else processes  # the processes at work while these calls were timed
        suffixes = _suffixes(calls, alone) + (["_host"] if alone and "generate_host" in seconds else [])
        for suffix in suffixes:
            shapes = _call_shapes(calls, suffix if suffix != "_host" else "_alone")
            for kind in _CALLS:
                record, dp = (RolloutTiming, 1) if kind == "generate" else (BatchTiming, busy)
                seconds_k = seconds[kind + suffix]
                timings[kind + suffix] = record(**shapes[kind], seconds=seconds_k, processes=busy, dp=dp)
    return CallTimings(model=ModelSpec(**calls["model"]), **timings), latency


def profile_or_measure(
    profile: MachineProfile | str | Path | None = None, *, refresh: bool = False
) -> MachineProfile | HardwareProfile:
    """What prices a CPU cluster (``cluster_preset("cpu", profile=...)``): ``profile`` (a path is
    loaded) when given, else this host's profile at :func:`~rlflow.planner.profile.default_profile_path`
    when there is one, else this host's hardware rates (:func:`cached_hardware`; ``refresh``:
    measured again)."""
    if profile is not None:
        return profile if isinstance(profile, MachineProfile) else load_profile(profile)
    if default_profile_path().exists():
        return load_profile(default_profile_path())
    return cached_hardware(refresh=refresh)


# ----------------------------------------------------------------------------- the profile cache


@dataclass(frozen=True)
class CachedProfile:
    """A profile of this machine at a run's shapes, and where it came from.

    Attributes:
        profile: the profile.
        path: its file in the cache (:func:`~rlflow.planner.profile.cached_profile_path`).
        cached: True when it was read from ``path``, False when it was measured now (and
            written there).
        calibrate_to: where the run's own calls write this profile once they have calibrated it
            (``placement.calibrate: run``): the cache file of the run's shapes, when ``profile``
            is this host's machine profile (no profile at those shapes yet); else None.
    """

    profile: MachineProfile
    path: Path
    cached: bool
    calibrate_to: Path | None = None


_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # rlflow/, where setup.py puts rlflow._C_<name>


def host_identity(device: str = "cpu") -> dict[str, Any]:
    """What a profile measured on this host depends on besides the shapes it measured: the host,
    its CPU model and cores (all of them, and those this process may run on), the torch version,
    the device (``"cpu"`` or the GPU's name), the instruction-set caps its environment sets
    (:func:`~rlflow.engine.parallelize.cpu_isa_caps`), and which of rlflow's C++ kernels are built (the
    sampler's decode step runs in ``rlflow._C_decode`` where it is, several times faster on small
    models, so a profile timed without it misprices generation). Profiles run on one thread per
    worker process whatever the environment sets, so threads are not part of it; the workers that
    time whole calls at once are (``call_processes`` among the shapes)."""
    import torch

    from rlflow.engine.parallelize import cpu_isa_caps, cpu_model

    cuda = device.startswith("cuda")
    return {
        "hostname": socket.gethostname(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        # setup.py builds kernels/<name>.cpp as rlflow._C_<name>: the ones present in the package
        "kernels": sorted(m.name for m in pkgutil.iter_modules([str(_PACKAGE_DIR)]) if m.name.startswith("_C_")),
        # capped instruction sets measure another machine's speeds (absent when uncapped: the key stays)
        **({"isa_caps": caps} if (caps := cpu_isa_caps()) else {}),
    }


def _read_cached(path: Path) -> MachineProfile | None:
    """The profile at ``path``; None when there is none, or with a warning when it cannot be read
    (a file cut short, another format): the caller measures again and replaces it."""
    if not path.exists():
        return None
    try:
        return load_profile(path)
    except (OSError, ValueError) as exc:
        warnings.warn(f"the cached profile {path} is unusable ({exc.__cause__ or exc}); measuring again", stacklevel=3)
        return None


def cached_profile_of(shapes: dict) -> CachedProfile | None:
    """The cached profile of this host at ``shapes`` (measured, or calibrated by an earlier run's
    calls), or None when the cache has none (or an unusable one, with a warning)."""
    path = cached_profile_path(profile_cache_key(host_identity("cpu"), shapes))
    profile = _read_cached(path)
    return None if profile is None else CachedProfile(profile, path, cached=True)


def cached_profile(shapes: dict, *, refresh: bool = False, progress: bool | None = None) -> CachedProfile:
    """A CPU profile of this machine at ``shapes`` (:func:`run_profile` arguments, as
    ``rlflow.trainer.placement.profile_shapes`` makes them): read from the cache when a profile of
    the same host and shapes is there (:func:`host_identity`,
    :func:`~rlflow.planner.profile.profile_cache_key`), else measured now and written there.

    Args:
        shapes: ``layer``, ``passes``, ``decodes`` and optionally ``rounds``, ``calls`` and ``call_processes``.
        refresh: measure again even when the cache has the profile (and replace it).
        progress: show the measuring progress bar; ``None``: when stderr is a terminal.
    """
    path = cached_profile_path(profile_cache_key(host_identity("cpu"), shapes))
    profile = None if refresh else _read_cached(path)
    if profile is not None:
        return CachedProfile(profile, path, cached=True)
    profile = run_profile(path=path, device="cpu", progress=progress, **shapes)
    if (why := busy_host(profile)) is not None:
        path.unlink(missing_ok=True)
        warnings.warn(
            f"the profile of this machine was measured while other work held its cores ({why}); "
            "the run plans with it, but it is not cached: the next run measures again",
            stacklevel=2,
        )
    return CachedProfile(profile, path, cached=False)


# A call on every core of the host that runs slower than this share of its one-thread speed was
# measured while other processes held the cores: a second thread waits for a busy core.
BUSY_HOST_SPEEDUP = 0.6


def busy_host(profile: MachineProfile) -> str | None:
    """Why ``profile``'s whole calls look measured on a busy host: a call kind whose every-core run
    (``<kind>_host``) took longer than its one-thread run by more than 1 / ``BUSY_HOST_SPEEDUP``;
    ``None`` when none did (or the profile has no such timings)."""
    if profile.calls is None:
        return None
    for kind in _CALLS:
        speedup = profile.calls.host_speedup(kind)
        if speedup is not None and speedup < BUSY_HOST_SPEEDUP:
            return f"{kind} on every core ran {1 / speedup:.1f}x slower than on one thread"
    return None


def cached_hardware(*, refresh: bool = False) -> HardwareProfile:
    """This host's hardware rates (:func:`measure_hardware`, about a second), cached as the
    profiles are (keyed by :func:`host_identity`): read from the cache unless ``refresh`` or the
    file is unusable (then with a warning), else measured now and written there."""
    path = cached_profile_path(profile_cache_key(host_identity("cpu"), {"measured": "hardware"}))
    if path.exists() and not refresh:
        try:
            data = json.loads(path.read_text())
            if data.get("version") != PROFILE_VERSION:
                raise ValueError(f"version {data.get('version')!r}, expected {PROFILE_VERSION}")
            return HardwareProfile.from_dict(data.get("hardware"))
        except (OSError, ValueError, AttributeError) as exc:
            warnings.warn(f"the cached hardware rates {path} are unusable ({exc}); measuring again", stacklevel=2)
    hardware = measure_hardware()
    write_atomic(path, json.dumps({"version": PROFILE_VERSION, "hardware": hardware.to_dict()}, indent=1))
    return hardware
