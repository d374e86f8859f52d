"""Transfer costs between the options of MFCs (seconds): weights, data and offloaded models.

Parameter reallocation (trained model: home layout -> a call's layout). The home layout is a
training layout: pipeline stage -> tp shard -> FSDP shard over dp, so every byte of the model
lives on exactly one home device. Weights travel as the fp32 master weights
(``precision.param_bytes``: the reshard wire format of ``rlflow.parallel.realloc``). A
generation's layout replicates the stage's tp shard on every dp rank, so even on the home's own
mesh and strategy it gathers the FSDP shards; every other call runs on an FSDP layout
(``TrainEngine``), whose devices need only their ``1/dp`` of the block. Every destination device
needs ``P_stage / tp`` bytes (replicated) or ``P_stage / (tp * dp)`` (FSDP); what it already
holds is free, what sits on a device of its own host comes at the intra-host bandwidth, the rest
at the inter-host bandwidth (both summed: conservative). Destinations receive in parallel (a
source slice wanted by several dp replicas is broadcast), so the reallocation takes as long as
the slowest destination. This is computed analytically per (stage, tp shard) block — a block's
bytes are spread evenly over its FSDP shards — for whole tables of option pairs at once.

Adapter push (a model with ``ModelSpec.push_params``: LoRA whose kept copies merge the adapters
themselves, :mod:`rlflow.parallel.low_rank`): after the first push, every destination device takes
the whole adapters of its stage whatever the call's split, each home device holding ``1/size`` of
them (its FSDP shards); priced like a reallocation by the slowest destination
(:func:`adapter_push_time_table`). The copy's merge, one ``(out, r) @ (r, in)`` product per adapted
weight, is not priced.

EMA blend (``ParamReallocHook(source, eta)``, ``ReallocManager.ema_update``): the source's home
weights are resharded onto the target's home (FSDP) layout into scratch tensors — the same
transfer as a reallocation to an FSDP layout, free between identical layouts — then every
target device blends its shard: ``t.lerp_(scratch, eta)``.

Data transfer of an edge's keys: results leave the producer's dp ranks through host memory
(Ray's object store) and reach the consumer's dp ranks: ``D2H + link + H2D``.

Reload of a frozen model offloaded to host memory: ``weight_bytes / host_device_bandwidth``,
streamed layer by layer under the call's first forward pass, so only what that pass cannot hide
(and at least one layer's share) is paid.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rlflow.planner.cluster import ClusterSpec
from rlflow.planner.mesh import DeviceMesh
from rlflow.planner.model_spec import ModelSpec
from rlflow.planner.problem import DataTable
from rlflow.strategy import ParallelStrategy

Option = tuple[DeviceMesh, ParallelStrategy]

_COLUMN_KEYS = ("device", "tp", "r", "share", "s", "e")
# Passes over a target shard in an EMA blend: the reshard writes the scratch tensor, and
# ``lerp_`` reads the shard and the scratch and writes the shard.
EMA_BLEND_PASSES = 4


# ----------------------------------------------------------------------------- data keys


def key_bytes(key: str, n_seqs: int, seq_len: int, prompt_len: int, vocab_size: int = 1) -> float:
    """Bytes of one dataflow key for ``n_seqs`` sequences.

    Token ids are int64, masks one byte per token, per-sequence rewards one fp32, whole next-token
    distributions (``*vocab_logp``, the distillation teacher's) ``vocab_size`` fp32 per token, every
    other key (log-probs, values, advantages, …) one fp32 per token; prompt keys span the prompt only.

    >>> key_bytes("input_ids", 2, 10, 4), key_bytes("greedy_rewards", 2, 10, 4), key_bytes("old_logp", 2, 10, 4)
    (160.0, 8.0, 80.0)
    """
    base = key.removeprefix("greedy_")
    if base.endswith("vocab_logp"):
        return 4.0 * n_seqs * seq_len * vocab_size
    if base in ("prompts", "prompt_mask"):
        return float(n_seqs * prompt_len * (8 if base == "prompts" else 1))
    if base.endswith("rewards") or base == "answers":
        return 4.0 * n_seqs
    if base.endswith("_ids"):
        return 8.0 * n_seqs * seq_len
    if base.endswith("mask"):
        return 1.0 * n_seqs * seq_len
    return 4.0 * n_seqs * seq_len


def _option_arrays(options: Sequence[Option]) -> dict[str, np.ndarray]:
    meshes = [m for m, _ in options]
    return {
        "first": np.array([m.first_device for m in meshes], dtype=np.int64),
        "size": np.array([m.size for m in meshes], dtype=np.int64),
        "node_lo": np.array([m.node_start for m in meshes], dtype=np.int64),
        "nodes": np.array([m.num_nodes for m in meshes], dtype=np.int64),
        "dp": np.array([s.dp for _, s in options], dtype=np.int64),
        "tp": np.array([s.tp for _, s in options], dtype=np.int64),
        "pp": np.array([s.pp for _, s in options], dtype=np.int64),
    }


def _same_layout(a: dict, b: dict) -> np.ndarray:
    """``(len(a), len(b))``: equal mesh and strategy."""
    keys = ("first", "size", "dp", "tp", "pp")
    return np.logical_and.reduce([a[k][:, None] == b[k][None, :] for k in keys])


def placement_keys(options: Sequence[Option]) -> np.ndarray:
    """One int64 per option, equal exactly when mesh and strategy are (first device, size, dp, tp, pp)."""
    a = _option_arrays(options)
    key = np.zeros(len(options), dtype=np.int64)
    for k in ("first", "size", "dp", "tp", "pp"):  # 12 bits each: 60 bits in all
        if len(options) and a[k].max() >= 1 << 12:
            raise ValueError(f"placement keys hold {k} < 4096, got {int(a[k].max())}")
        key = (key << 12) | a[k]
    return key


def data_table(nbytes: float, src: Sequence[Option], dst: Sequence[Option], cluster: ClusterSpec) -> DataTable:
    """Seconds to move ``nbytes`` of an edge's keys between every source and destination option.

    Through host memory: ``latency + (B / dp_src) / host_device_bw + (B / dp_dst) / link +
    (B / dp_dst) / host_device_bw``, ``link`` the intra-host bandwidth when both meshes lie on one
    host, else the inter-host one; 0 between equal placements or when ``nbytes`` is 0.
    """
    a, b = _option_arrays(src), _option_arrays(dst)
    src_dp, src_group = np.unique(a["dp"], return_inverse=True)
    dst_dp, dst_group = np.unique(b["dp"], return_inverse=True)
    link = np.array([cluster.intra_host_bandwidth, cluster.inter_host_bandwidth])[:, None, None]
    send = nbytes / src_dp[None, :, None] / cluster.host_device_bandwidth
    recv = nbytes / dst_dp[None, None, :]
    t = cluster.collective_latency_s + send + recv / link + recv / cluster.host_device_bandwidth
    return DataTable(
        t if nbytes > 0 else np.zeros(t.shape),
        src_group.reshape(-1),
        dst_group.reshape(-1),
        np.stack([a["node_lo"], a["node_lo"] + a["nodes"]], axis=1),
        np.stack([b["node_lo"], b["node_lo"] + b["nodes"]], axis=1),
        placement_keys(src),
        placement_keys(dst),
    )


def data_time_table(nbytes: float, src: Sequence[Option], dst: Sequence[Option], cluster: ClusterSpec) -> np.ndarray:
    """:func:`data_table` cell by cell, shape ``(len(src), len(dst))``; 0 on equal layouts."""
    return np.asarray(data_table(nbytes, src, dst, cluster))


# ----------------------------------------------------------------------------- reallocation


def _stage_table(model: ModelSpec, pps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Item bounds of every stage for each pp: ``start, stop`` of shape ``(len(pps), max pp)``."""
    width = int(pps.max())
    start, stop = np.zeros((len(pps), width), dtype=np.int64), np.zeros((len(pps), width), dtype=np.int64)
    for pp in np.unique(pps):
        rows = pps == pp
        ranges = model.stages(int(pp))
        start[rows, :pp] = [r.start for r in ranges]
        stop[rows, :pp] = [r.stop for r in ranges]
    return start, stop


def _node_holdings(model: ModelSpec, home: dict, start, stop, num_nodes: int, dpn: int, param_bytes: int) -> np.ndarray:
    """``cum[h, n, k]``: bytes of items ``< k`` that home option ``h`` holds on node ``n``.

    Each (stage, dp rank) tp group holds ``1/dp`` of its stage's items (all tp shards of it),
    and tp groups never straddle hosts.
    """
    item_bytes = model.item_params.astype(np.float64) * param_bytes
    n_items = len(item_bytes)
    cum = np.zeros((len(home["first"]), num_nodes, n_items + 1))
    for h in range(len(cum)):
        dp, tp, pp, first = int(home["dp"][h]), int(home["tp"][h]), int(home["pp"][h]), int(home["first"][h])
        groups = np.arange(dp * pp)
        counts = np.zeros((num_nodes, pp))
        np.add.at(counts, ((first + groups * tp) // dpn, groups // dp), 1.0)
        stage_of_item = np.repeat(np.arange(pp), stop[h, :pp] - start[h, :pp])
        held = counts[:, stage_of_item] / dp * item_bytes
        cum[h, :, 1:] = np.cumsum(held, axis=1)
    return cum


def _interval_overlap(a_lo, a_hi, b_lo, b_hi):
    return np.clip(np.minimum(a_hi, b_hi) - np.maximum(a_lo, b_lo), 0, None)


def _target_columns(t: dict, start, stop, replicated: bool) -> dict[str, np.ndarray]:
    """One column per (target option, rank): its device, tp rank and degree, the share of its
    (stage, tp) block it needs (1, or ``1/dp`` on an FSDP layout), and stage item bounds."""
    sizes = t["size"]
    opt = np.repeat(np.arange(len(sizes)), sizes)
    rank = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    dp, tp = t["dp"][opt], t["tp"][opt]
    stage = rank // (dp * tp)
    return {
        "device": t["first"][opt] + rank,
        "tp": tp,
        "r": rank % tp,
        "share": np.ones(len(opt)) if replicated else 1.0 / dp,
        "dp": dp,
        "s": start[opt, stage],
        "e": stop[opt, stage],
        "segments": np.cumsum(sizes) - sizes,
    }


# A destination receives nothing when what it holds of the home layout is all it needs, up to rounding.
_LOCAL_TOLERANCE = 1e-9

# Bits of each field of a column's sort key, device first: unique columns come out sorted by device.
_KEY_BITS = (("device", 13), ("tp", 7), ("r", 7), ("share_dp", 13), ("s", 10), ("e", 10))


def _column_keys(cols: dict[str, np.ndarray], replicated: bool) -> np.ndarray:
    """One int64 per column, equal exactly when (device, tp, tp rank, share, stage bounds) are: a
    1-D sort of millions of columns instead of a row-wise ``np.unique(axis=0)``."""
    fields = {**cols, "share_dp": np.ones_like(cols["tp"]) if replicated else cols["dp"]}
    key = np.zeros(len(cols["device"]), dtype=np.int64)
    for name, bits in _KEY_BITS:
        values = np.asarray(fields[name], dtype=np.int64)
        if values.size and values.max() >= 1 << bits:
            raise ValueError(f"reallocation columns hold {name} < {1 << bits}, got {int(values.max())}")
        key = (key << bits) | values
    return key


def _column_bytes(model, cluster, h: dict, h_start, h_stop, holdings, cols: dict, sl: slice):
    """Bytes every destination device in ``cols[sl]`` needs, of each home option: ``total``, what
    its own host holds (``on_node``, itself included) and what it holds itself (``local``), each
    ``(len(home), n_columns)``. Its intra-host bytes are ``on_node - local``, its inter-host
    bytes ``total - on_node``."""
    b, dpn = cluster.precision.param_bytes, cluster.devices_per_node
    cum = np.concatenate([[0.0], np.cumsum(model.item_params.astype(np.float64) * b)])
    device, tp, r, share, s_j, e_j = (cols[k][sl] for k in _COLUMN_KEYS)
    node = device // dpn
    total = (cum[e_j] - cum[s_j]) / tp * share
    on_node = (holdings[:, node, e_j] - holdings[:, node, s_j]) / tp * share
    # What the destination device itself holds in the home layout: the overlap of its home
    # (stage, tp shard) block with the block it needs, over the home's dp (FSDP) degree.
    h_first, h_size, h_dp, h_tp = (h[k][:, None] for k in ("first", "size", "dp", "tp"))
    rho = device[None, :] - h_first
    inside = (rho >= 0) & (rho < h_size)
    rho = np.where(inside, rho, 0)
    q, i = rho % h_tp, rho // (h_tp * h_dp)
    lo = np.maximum(np.take_along_axis(h_start, i, axis=1), s_j)
    hi = np.minimum(np.take_along_axis(h_stop, i, axis=1), e_j)
    shared = cum[np.maximum(hi, lo)] - cum[lo]
    tp_part = _interval_overlap(q / h_tp, (q + 1) / h_tp, r / tp, (r + 1) / tp)
    local = np.where(inside, shared * tp_part / h_dp * share, 0.0)
    return np.broadcast_to(total, local.shape), on_node, local


def _column_costs(model, cluster, h: dict, h_start, h_stop, holdings, cols: dict, sl: slice) -> np.ndarray:
    """Receive time ``(len(home), n_columns)`` of every destination device in ``cols[sl]``."""
    total, on_node, local = _column_bytes(model, cluster, h, h_start, h_stop, holdings, cols, sl)
    tensors = np.concatenate([[0], np.cumsum(model.item_tensors)])
    s_j, e_j = cols["s"][sl], cols["e"][sl]
    seconds = (on_node - local) / cluster.intra_host_bandwidth + (total - on_node) / cluster.inter_host_bandwidth
    # One broadcast per parameter tensor of the destination stage; a device that already holds
    # all it needs (one worker training and generating) copies it in memory, no collective.
    receives = total - local > _LOCAL_TOLERANCE * total
    latency = (tensors[e_j] - tensors[s_j]) * cluster.collective_latency_s
    return np.where(receives, seconds + latency, local / cluster.intra_host_bandwidth)


def realloc_time_table(
    model: ModelSpec,
    home: Sequence[Option],
    targets: Sequence[Option],
    cluster: ClusterSpec,
    chunk: int = 1 << 21,
    replicated: bool = True,
    backend: str = "cpp",
) -> np.ndarray:
    """Seconds to reallocate ``model`` from each home (training) option to each target option.

    Args:
        model: the model moved.
        home: training options (FSDP layouts).
        targets: call options.
        cluster: bandwidths, latencies and the wire dtype (``precision.param_bytes``).
        chunk: table cells the numpy backend computes at once (bounds its temporary memory).
        replicated: the targets are generations (dp-replicated copies; a copy is needed even on
            the home's mesh and strategy); ``False``: FSDP layouts (forward copies, another
            model's home), equal to the home when mesh and strategy are.
        backend: ``"cpp"`` (``rlflow._C_planner.realloc_table``: one home row at a time, no
            temporaries) or ``"numpy"`` (its twin); both give the same bits.

    Returns:
        Array ``(len(home), len(targets))``: the slowest destination device's receive time;
        0 where an FSDP target equals the home.
    """
    h, t = _option_arrays(home), _option_arrays(targets)
    h_start, h_stop = _stage_table(model, h["pp"])
    t_start, t_stop = _stage_table(model, t["pp"])
    cols = _target_columns(t, t_start, t_stop, replicated)
    # Many (option, rank) columns describe the same destination: same device, tp shard, share and stage.
    _, first, inverse = np.unique(_column_keys(cols, replicated), return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    ucols = {k: cols[k][first] for k in _COLUMN_KEYS}
    if backend == "cpp":
        table = _realloc_table_cpp(model, cluster, {**h, "start": h_start, "stop": h_stop}, t, ucols, inverse, cols)
    elif backend == "numpy":
        table = _realloc_table_numpy(model, cluster, h, h_start, h_stop, ucols, inverse, cols, chunk)
    else:
        raise ValueError(f"backend={backend!r}; expected 'cpp' or 'numpy'")
    return table if replicated else np.where(_same_layout(h, t), 0.0, table)


def _realloc_table_numpy(model, cluster, h, h_start, h_stop, ucols, inverse, cols, chunk: int) -> np.ndarray:
    b = cluster.precision.param_bytes
    holdings = _node_holdings(model, h, h_start, h_stop, cluster.num_nodes, cluster.devices_per_node, b)
    n_unique = len(ucols["device"])
    costs = np.empty((len(h["first"]), n_unique))
    step = max(1, chunk // max(1, len(h["first"])))
    for lo in range(0, n_unique, step):
        sl = slice(lo, min(n_unique, lo + step))
        costs[:, sl] = _column_costs(model, cluster, h, h_start, h_stop, holdings, ucols, sl)
    return np.maximum.reduceat(costs[:, inverse], cols["segments"], axis=1)


def _realloc_table_cpp(model, cluster, home: dict, targets: dict, ucols, inverse, cols) -> np.ndarray:
    from rlflow.planner.simulate import load_extension

    b = cluster.precision.param_bytes
    item_bytes = model.item_params.astype(np.float64) * b
    return load_extension().realloc_table(
        home,
        ucols,
        inverse,
        cols["segments"],
        targets["first"],
        np.concatenate([[0.0], np.cumsum(item_bytes)]),
        np.concatenate([[0], np.cumsum(model.item_tensors)]).astype(np.int64),
        item_bytes,
        cluster.devices_per_node,
        cluster.num_nodes,
        cluster.intra_host_bandwidth,
        cluster.inter_host_bandwidth,
        cluster.collective_latency_s,
    )


def realloc_bytes(
    model: ModelSpec, src: Option, dst: Option, cluster: ClusterSpec, replicated: bool = True
) -> dict[str, float]:
    """Bytes the reallocation :func:`realloc_time_table` prices moves, by link, summed over the
    destination devices of ``dst`` (the same receive-side accounting: a byte two destinations
    receive counts twice).

    Every destination takes what a device of its own host holds from there, the rest from another
    host. This is what :func:`rlflow.parallel.reshard.plan_reshard` moves wherever the model's
    even spread of each block over its FSDP shards is the layouts' own: FSDP homes to
    dp-replicated generations, every parameter's first dimension divisible by the home's dp and
    the LM head untied. Elsewhere it is an estimate (docs/placement.md, "Transfer model").

    Returns:
        ``{"local_bytes", "intra_host_bytes", "inter_host_bytes"}``; all 0 for an FSDP ``dst``
        equal to ``src`` (no reallocation).

    >>> from rlflow.planner.cluster import cluster_preset
    >>> from rlflow.planner.mesh import DeviceMesh
    >>> from rlflow.planner.model_spec import ModelSpec
    >>> model = ModelSpec(num_layers=1, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=2, vocab_size=8)
    >>> cluster = cluster_preset("a100-80g", num_nodes=2, devices_per_node=2)
    >>> home = (DeviceMesh(2, 2, 0, 0, 2), ParallelStrategy(dp=4))
    >>> gen = (DeviceMesh(1, 2, 1, 0, 2), ParallelStrategy(dp=2))
    >>> moved = realloc_bytes(model, home, gen, cluster)  # the second host's two devices each need it all
    >>> [moved[k] / (model.num_params * 4) for k in ("local_bytes", "intra_host_bytes", "inter_host_bytes")]
    [0.5, 0.5, 1.0]
    """
    h, t = _option_arrays([src]), _option_arrays([dst])
    if not replicated and bool(_same_layout(h, t)[0, 0]):
        return {"local_bytes": 0.0, "intra_host_bytes": 0.0, "inter_host_bytes": 0.0}
    h_start, h_stop = _stage_table(model, h["pp"])
    t_start, t_stop = _stage_table(model, t["pp"])
    cols = _target_columns(t, t_start, t_stop, replicated)
    b, dpn = cluster.precision.param_bytes, cluster.devices_per_node
    holdings = _node_holdings(model, h, h_start, h_stop, cluster.num_nodes, dpn, b)
    every = slice(0, len(cols["device"]))
    total, on_node, local = _column_bytes(model, cluster, h, h_start, h_stop, holdings, cols, every)
    return {
        "local_bytes": float(local.sum()),
        "intra_host_bytes": float((on_node - local).sum()),
        "inter_host_bytes": float((total - on_node).sum()),
    }


def _push_bytes(model: ModelSpec, cluster: ClusterSpec, h: dict, cols: dict, sl: slice):
    """Adapter push bytes every destination device in ``cols[sl]`` needs, of each home option:
    ``(total, on_node, local)``, each ``(len(home), n_columns)``, as :func:`_column_bytes` gives them."""
    b, dpn = cluster.precision.param_bytes, cluster.devices_per_node
    layer = model.push_params * b / model.num_layers  # the adapters sit in the decoder layers alone
    device, s_j, e_j = cols["device"][sl], cols["s"][sl], cols["e"][sl]
    layers = np.clip(e_j, 1, model.num_layers + 1) - np.clip(s_j, 1, model.num_layers + 1)
    total = np.broadcast_to(layers * layer, (len(h["first"]), len(device)))
    lo, size = h["first"][:, None], h["size"][:, None]
    node = device[None, :] // dpn
    on_node_devices = _interval_overlap(lo, lo + size, node * dpn, (node + 1) * dpn)
    inside = (device[None, :] >= lo) & (device[None, :] < lo + size)
    return total, total * on_node_devices / size, np.where(inside, total / size, 0.0)


def _push_columns(targets: Sequence[Option], model: ModelSpec) -> tuple[dict, dict]:
    t = _option_arrays(targets)
    t_start, t_stop = _stage_table(model, t["pp"])
    return t, _target_columns(t, t_start, t_stop, replicated=True)


def adapter_push_time_table(
    model: ModelSpec, home: Sequence[Option], targets: Sequence[Option], cluster: ClusterSpec, replicated: bool = True
) -> np.ndarray:
    """Seconds of an adapter push (module docstring) from each home option to each target option.

    Args:
        model: a model with ``push_params`` (and ``push_tensors``: one message latency each).
        home, targets, cluster: as :func:`realloc_time_table`.
        replicated: the targets are generations; ``False``: FSDP layouts, free where equal to the home.

    Returns:
        Array ``(len(home), len(targets))``: the slowest destination device's receive time.
    """
    if model.push_params is None:
        raise ValueError(f"model {model.name!r} has no push_params: its pushes move its weights (realloc_time_table)")
    h = _option_arrays(home)
    t, cols = _push_columns(targets, model)
    # Many (option, rank) columns describe the same destination: same device and stage.
    _, first, inverse = np.unique(_column_keys(cols, True), return_index=True, return_inverse=True)
    unique = {k: cols[k][first] for k in ("device", "s", "e")}
    total, on_node, local = _push_bytes(model, cluster, h, unique, slice(0, len(first)))
    seconds = (on_node - local) / cluster.intra_host_bandwidth + (total - on_node) / cluster.inter_host_bandwidth
    layers = np.clip(unique["e"], 1, model.num_layers + 1) - np.clip(unique["s"], 1, model.num_layers + 1)
    latency = layers * model.push_tensors / model.num_layers * cluster.collective_latency_s
    receives = total - local > _LOCAL_TOLERANCE * total
    costs = np.where(receives, seconds + latency, local / cluster.intra_host_bandwidth)[:, inverse.reshape(-1)]
    table = np.maximum.reduceat(costs, cols["segments"], axis=1)
    return table if replicated else np.where(_same_layout(h, t), 0.0, table)


def adapter_push_bytes(model: ModelSpec, src: Option, dst: Option, cluster: ClusterSpec) -> dict[str, float]:
    """Bytes an adapter push (module docstring) from ``src`` to ``dst`` moves, by link, summed over the
    destination devices, as :func:`realloc_bytes` counts them.

    >>> from rlflow.planner.cluster import cluster_preset
    >>> from rlflow.planner.mesh import DeviceMesh
    >>> model = ModelSpec(num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=2,
    ...                   vocab_size=8, push_params=100, push_tensors=4)
    >>> cluster = cluster_preset("a100-80g", num_nodes=1, devices_per_node=2)
    >>> mesh = DeviceMesh(1, 2, 0, 0, 2)
    >>> adapter_push_bytes(model, (mesh, ParallelStrategy(dp=2)), (mesh, ParallelStrategy(tp=2)), cluster)
    {'local_bytes': 400.0, 'intra_host_bytes': 400.0, 'inter_host_bytes': 0.0}
    """
    if model.push_params is None:
        raise ValueError(f"model {model.name!r} has no push_params: its pushes move its weights (realloc_bytes)")
    _, cols = _push_columns([dst], model)
    total, on_node, local = _push_bytes(model, cluster, _option_arrays([src]), cols, slice(0, len(cols["device"])))
    return {
        "local_bytes": float(local.sum()),
        "intra_host_bytes": float((on_node - local).sum()),
        "inter_host_bytes": float((total - on_node).sum()),
    }


def realloc_time(model: ModelSpec, src: Option, dst: Option, cluster: ClusterSpec, replicated: bool = True) -> float:
    """Seconds to reallocate ``model`` from the training layout ``src`` to the call layout ``dst``."""
    return float(realloc_time_table(model, [src], [dst], cluster, replicated=replicated)[0, 0])


def ema_time_table(
    model: ModelSpec, source_home: Sequence[Option], target_home: Sequence[Option], cluster: ClusterSpec
) -> np.ndarray:
    """Seconds of an EMA blend of ``model``'s weights from each source home option into each target
    home option: the reshard onto the target's FSDP layout (:func:`realloc_time_table`), then
    :data:`EMA_BLEND_PASSES` passes over every target device's fp32 shard.

    Returns:
        Array ``(len(source_home), len(target_home))``.
    """
    move = realloc_time_table(model, source_home, target_home, cluster, replicated=False)
    b = cluster.precision.param_bytes
    shard = np.array([model.stage_params(s.pp).max() * b / (s.tp * s.dp) for _, s in target_home], dtype=np.float64)
    return move + EMA_BLEND_PASSES * shard[None, :] / cluster.bandwidth


# ----------------------------------------------------------------------------- offload


def reload_time(
    weight_bytes: np.ndarray, first_pass_s: np.ndarray, num_layers: int, cluster: ClusterSpec
) -> np.ndarray:
    """Seconds a reload from host memory adds before a call, per option.

    Args:
        weight_bytes: weights per device of each option.
        first_pass_s: the call's first forward pass per option (the reload streams under it).
        num_layers: layers of the model (the first one cannot be hidden).
    """
    load = np.asarray(weight_bytes, dtype=np.float64) / cluster.host_device_bandwidth
    return np.maximum(load / max(1, num_layers), load - np.asarray(first_pass_s, dtype=np.float64))
