"""``build_problem``: dataflow graph + model shapes + cluster + workload -> :class:`PlanProblem`.

For every MFC placed on devices it enumerates the options of the search space, prices each
with the cost model (one estimate per mesh *shape* and strategy: a call's own time does not
depend on where the mesh sits), and drops options that cannot fit in device memory even
alone. Then it fills the transfer tables the simulator reads: data edges, reallocation of
trainable models from their home (train) option, reloads of frozen models, and the EMA blends
of weight hooks (``ParamReallocHook``: from the source model's home onto the call's layout).
Every size is priced in the dtypes of ``cluster.precision``.

Calls with ``runs_on_host`` (rule-based rewards) take no devices: they are left out, and
their producers are linked to their consumers so that the order of the graph is kept.
"""

from __future__ import annotations

import itertools

import networkx as nx
import numpy as np

from rlflow.dataflow.graph import mfcs_of, version_edges, version_spans
from rlflow.dataflow.mfc import MFCDef
from rlflow.planner.cluster import ClusterSpec
from rlflow.planner.cost import CallCost, Rates, Workload, call_cost
from rlflow.planner.model_spec import ModelSpec
from rlflow.planner.problem import CallOption, ModelEntry, PlanProblem
from rlflow.planner.space import RuntimeCapabilities, enumerate_options
from rlflow.planner.transfer import (
    adapter_push_time_table,
    data_table,
    ema_time_table,
    key_bytes,
    realloc_time_table,
    reload_time,
)

__all__ = ["Workload", "build_problem", "device_graph", "mfc_options", "pricing_rates"]


def device_graph(graph: nx.DiGraph) -> nx.DiGraph:
    """The graph restricted to MFCs that run on devices.

    Host MFCs are removed; each of their device-side producers gets an edge to each of their
    device-side consumers (keys ``()`` unless a direct edge already carries some).
    """
    out = nx.DiGraph(graph)
    for name in [n for n in graph.nodes if graph.nodes[n]["mfc"].runs_on_host]:
        preds, succs = list(out.predecessors(name)), list(out.successors(name))
        out.remove_node(name)
        for p, s in itertools.product(preds, succs):
            if not out.has_edge(p, s):
                out.add_edge(p, s, keys=())
    return out


def mfc_options(
    mfc: MFCDef,
    model: ModelSpec,
    cluster: ClusterSpec,
    workload: Workload,
    capabilities: RuntimeCapabilities | None = None,
    rates: Rates | None = None,
) -> tuple[list[CallOption], list[CallCost]]:
    """Every option of one MFC with its estimated cost, before any filtering."""
    rates = rates or Rates(cluster)
    pairs = enumerate_options(
        mfc,
        model,
        cluster.num_nodes,
        cluster.devices_per_node,
        workload.n_seqs(mfc),
        workload.n_minibatches(mfc),
        capabilities,
    )
    cache: dict[tuple, CallCost] = {}
    options, costs = [], []
    calls = workload.calls_per_iteration(mfc)  # an option's time is the call's share of an iteration
    for mesh, strategy in pairs:
        key = (mesh.shape, strategy)
        if key not in cache:
            cache[key] = call_cost(mfc, model, strategy, mesh, cluster, workload, rates)
        c = cache[key]
        replicated = mfc.interface_type == "generate"
        options.append(
            CallOption(mesh, strategy, c.time_s * calls, c.act_bytes, c.weight_bytes, c.train_state_bytes, replicated)
        )
        costs.append(c)
    return options, costs


def _select(options: list[CallOption], costs: list[CallCost], memory: float, limit: int | None):
    """Drop options that overflow memory on their own (unless none fits), then keep the ``limit`` fastest."""
    need = [o.act_bytes + o.weight_bytes + o.train_state_bytes for o in options]
    keep = [j for j in range(len(options)) if need[j] <= memory] or list(range(len(options)))
    if limit is not None and len(keep) > limit:
        keep = sorted(sorted(keep, key=lambda j: options[j].time_s)[:limit])
    return [options[j] for j in keep], [costs[j] for j in keep]


def _models(
    device_mfcs: list[MFCDef], models: dict[str, ModelSpec], trainable: set[str] | None
) -> dict[str, int | None]:
    """Model name -> index of its train MFC (``None`` for frozen models), after validation."""
    names = list(dict.fromkeys(m.model_name for m in device_mfcs))
    missing = [n for n in names if n not in models]
    if missing:
        raise ValueError(f"no ModelSpec for model(s) {missing}; `models` has {sorted(models)}")
    trains: dict[str, list[int]] = {}
    for i, m in enumerate(device_mfcs):
        if m.is_train:
            trains.setdefault(m.model_name, []).append(i)
    trainable = set(trains) if trainable is None else set(trainable)
    for name in trainable:
        if len(trains.get(name, [])) != 1:
            found = [device_mfcs[i].name for i in trains.get(name, [])]
            raise ValueError(
                f"trainable model {name!r} needs exactly one train_step MFC (its home layout), found {found}"
            )
    frozen_trained = sorted(set(trains) - trainable)
    if frozen_trained:
        raise ValueError(f"model(s) {frozen_trained} have train_step MFCs but are not in trainable={sorted(trainable)}")
    return {n: (trains[n][0] if n in trainable else None) for n in names}


def _data_tables(
    dgraph: nx.DiGraph,
    index: dict[str, int],
    options,
    cluster: ClusterSpec,
    workload: Workload,
    models: dict[str, ModelSpec],
):
    """Data edges as MFC index pairs and their transfer-time tables (stored by dp degree)."""
    edges, tables = [], []
    for u, v, keys in dgraph.edges(data="keys"):
        mfc = dgraph.nodes[u]["mfc"]
        n, vocab = workload.n_seqs(mfc), models[mfc.model_name].vocab_size  # vocab: a teacher's whole distributions
        nbytes = sum(key_bytes(k, n, workload.seq_len, workload.prompt_len, vocab) for k in keys)
        src, dst = index[u], index[v]
        pairs = [(o.mesh, o.strategy) for o in options[src]], [(o.mesh, o.strategy) for o in options[dst]]
        edges.append((src, dst))
        tables.append(data_table(nbytes, *pairs, cluster))
    return edges, tables


def _pairs(options: list[CallOption]) -> list[tuple]:
    return [(o.mesh, o.strategy) for o in options]


def _weight_tables(mfcs: list[MFCDef], models, homes: dict[str, int | None], options, costs, cluster: ClusterSpec):
    """Reallocation tables ``(home, i)`` of trained models (a model with ``push_params``: its adapter
    pushes, every step's after the first) and reload times of frozen ones."""
    realloc, reload = {}, {}
    for i, m in enumerate(mfcs):
        home, model = homes[m.model_name], models[m.model_name]
        if home is not None and home != i:
            replicated = m.interface_type == "generate"
            table = adapter_push_time_table if model.push_params is not None else realloc_time_table
            realloc[(home, i)] = table(model, _pairs(options[home]), _pairs(options[i]), cluster, replicated=replicated)
        elif home is None:
            weights = np.array([o.weight_bytes for o in options[i]])
            first = np.array([c.first_pass_s for c in costs[i]])
            reload[i] = reload_time(weights, first, model.num_layers, cluster)
    return realloc, reload


def _hook_tables(mfcs: list[MFCDef], models, homes: dict[str, int | None], options, cluster: ClusterSpec):
    """EMA tables ``(src, i)`` of the weight hooks of every call ``i``: from the home option of the
    source model (its train MFC ``src``, or its first call when frozen) onto call ``i``'s option.

    The blend runs in the target model's home layout; for a model with one layout (a resident
    reference: PPO-EMA's ``ref``) that is call ``i``'s. Pre- and post-hooks are priced alike.
    """
    first = {}
    for i, m in enumerate(mfcs):
        first.setdefault(m.model_name, i)
    tables: dict[tuple[int, int], np.ndarray] = {}
    for i, m in enumerate(mfcs):
        for hook in m.pre_hooks + m.post_hooks:
            if hook.source not in first:
                raise ValueError(f"MFC {m.name!r} has a weight hook from {hook.source!r}, which has no device call")
            src = homes[hook.source] if homes.get(hook.source) is not None else first[hook.source]
            table = ema_time_table(models[hook.source], _pairs(options[src]), _pairs(options[i]), cluster)
            if (src, i) in tables:
                table = tables[(src, i)] + table
            tables[(src, i)] = table
    return tables


def pricing_rates(cluster: ClusterSpec, profile=None) -> Rates:
    """The rates calls are priced with: the analytic roofline of ``cluster``, or a measured profile
    (a ``MachineProfile`` or JSON path) on it."""
    if profile is None:
        return Rates(cluster)
    from rlflow.planner.profile import ProfiledRates

    return ProfiledRates.from_profile(profile, cluster)


def build_problem(
    graph: nx.DiGraph,
    models: dict[str, ModelSpec],
    cluster: ClusterSpec,
    workload: Workload,
    capabilities: RuntimeCapabilities | None = None,
    trainable: set[str] | None = None,
    profile=None,
    num_iterations: int = 3,
    max_options_per_mfc: int | None = None,
    policy_lag: int = 0,
) -> PlanProblem:
    """Price every placement of every MFC of ``graph`` and the transfers between them.

    Args:
        graph: a dataflow graph (``rlflow.dataflow.build_graph`` / ``algorithm_graph``).
        models: ``ModelSpec`` of every model a device MFC runs on (critics and reward models
            with ``value_head=True``).
        cluster: the hardware.
        workload: batch and sequence lengths of one iteration.
        capabilities: what the engines support (default: :class:`RuntimeCapabilities`, the built-in engines'
            — pipelined generation included).
        trainable: models trained by the graph; default: every model with a train_step MFC.
        profile: measured profile (a ``MachineProfile`` or JSON path) replacing the analytic roofline.
        num_iterations: iterations the simulator unrolls; under ``policy_lag`` L, 2·L more, so
            that the steady state (rollout of t beside training of t-1-L..t-1) is reached.
        max_options_per_mfc: keep only the fastest options of each MFC (after the memory filter).
        policy_lag: iterations a rollout may lag the newest weights (``algorithm.policy_lag``):
            the version edges into generations span 1 + ``policy_lag`` iterations.

    Returns:
        The :class:`PlanProblem`; MFC ``i`` is the ``i``-th device MFC in topological order.
    """
    rates = pricing_rates(cluster, profile)
    mfcs = [m for m in mfcs_of(graph) if not m.runs_on_host]
    index = {m.name: i for i, m in enumerate(mfcs)}
    homes = _models(mfcs, models, trainable)
    model_names = list(homes)
    options, costs = [], []
    for m in mfcs:
        opts, cs = mfc_options(m, models[m.model_name], cluster, workload, capabilities, rates)
        opts, cs = _select(opts, cs, cluster.device_memory_bytes, max_options_per_mfc)
        if not opts:
            raise ValueError(
                f"MFC {m.name!r} has no valid (mesh, strategy) on a {cluster.num_nodes}x{cluster.devices_per_node} cluster"
            )
        options.append(opts)
        costs.append(cs)
    data_edges, data_time = _data_tables(device_graph(graph), index, options, cluster, workload, models)
    realloc, reload = _weight_tables(mfcs, models, homes, options, costs, cluster)
    hooks = _hook_tables(mfcs, models, homes, options, cluster)
    kept = [(e, s) for e, s in zip(version_edges(graph), version_spans(graph, policy_lag)) if set(e) <= set(index)]
    versions, spans = [e for e, _ in kept], [s for _, s in kept]
    return PlanProblem(
        num_nodes=cluster.num_nodes,
        devices_per_node=cluster.devices_per_node,
        device_memory_bytes=cluster.device_memory_bytes,
        mfc_names=[m.name for m in mfcs],
        mfc_models=[model_names.index(m.model_name) for m in mfcs],
        options=options,
        models=[ModelEntry(n, homes[n] is not None, homes[n]) for n in model_names],
        data_edges=data_edges,
        data_time=data_time,
        version_edges=[(index[a], index[b]) for a, b in versions],
        version_spans=spans,
        realloc_time=realloc,
        reload_time=reload,
        hook_time=hooks,
        num_iterations=num_iterations + 2 * policy_lag,
    )
