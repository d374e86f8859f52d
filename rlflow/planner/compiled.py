"""A :class:`PlanProblem` flattened into arrays: the form both simulators and the search read.

Compiling does, once per problem, everything that does not depend on the plan: checking the
problem, numbering option layouts, deciding which MFCs may need a reallocation or a reload,
unrolling the dataflow graph over the iterations and listing each option's local moves. The
Python twin (:mod:`rlflow.planner.simulate`) and the C++ simulator (``rlflow._C_planner``)
read the same arrays, so they differ only in how they schedule.

Unrolled graph. Every iteration has ``K = E + 2*M`` nodes (E data edges, M MFCs): node ``e``
is the transfer of data edge ``e`` (inactive when its time is 0), node ``E+2*i`` the
*pre-node* of MFC ``i`` (its reallocation or reload, then its weight hook — an EMA blend — if
any; inactive when none is needed), node ``E+2*i+1`` the call itself. Transfers come first so
that, at equal ready times, the short transfers that unblock a consumer are placed before calls. Node ``(t, j)`` has global id ``t*K + j``. Edges: pre → call; call(i) →
transfer(e) → pre(k) for a data edge ``e = (i, k)``; call(t-s, i) → pre(t, k) for a version
edge ``(i, k)`` of span ``s`` (1, or 1 + ``policy_lag`` into a generation); and for a lagged
edge (``s > 1``) call(t-1, k) → pre(t, k): rollouts are drawn in order — without it the list
scheduler would place every rollout free of a version edge first, ahead of the transfers that
feed the training calls. Every parent of a call thus feeds its pre-node, and the simulators place a
call right after its pre-node, so a reallocation runs just before its call — as the runtime's
pre-call hook does — and the reallocated copy lives only for that call, which is what the
memory model assumes.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import numpy as np

from rlflow.planner.problem import PlanProblem, as_data_table

# Pre-node kinds of an MFC.
PRE_NONE, PRE_REALLOC, PRE_RELOAD = 0, 1, 2


@dataclass(frozen=True, eq=False)
class CompiledProblem:
    """Flat arrays of a :class:`PlanProblem`. Option ``j`` of MFC ``i`` is flat option ``opt_offset[i] + j``.

    Per flat option (length ``num_options``): ``opt_time`` (s), ``opt_act``, ``opt_weight``,
    ``opt_state`` (bytes per device), ``opt_lo``/``opt_size`` (device range), ``opt_layout``
    (equal ids ⇔ equal mesh, strategy and replication), ``nbr_offset``/``nbr`` (local moves, as
    option indices local to the MFC).
    Per MFC: ``mfc_model``, ``pre_kind`` (PRE_*), ``home`` (train MFC of its model or -1),
    ``realloc_offset`` into ``realloc_table`` (row-major ``(n_home, n_i)``), ``reload_offset``
    into ``reload_table``, ``hook_src`` (source MFC of its weight hook or -1) and ``hook_offset``
    into ``hook_table`` (row-major ``(n_src, n_i)``).
    Per model: ``model_trainable``, ``model_home``, ``model_calls_offset``/``model_calls``.
    Per data edge: ``edge_src``, ``edge_dst``, ``edge_offset`` into ``data_table`` (row-major
    ``(2, edge_rows, edge_cols)``: one host / across hosts, source group, destination group),
    ``edge_src_at`` / ``edge_dst_at`` into the per-option ``eopt_group``, ``eopt_host_lo``,
    ``eopt_host_hi`` and ``eopt_key`` (see :func:`data_seconds`).
    Unrolled graph (``num_iterations * nodes_per_iteration`` nodes): ``child_offset``/``child``
    (CSR), ``indegree``; ``period_from``/``period_to``: the iterations between whose ends the
    steady-state period is measured (``s - 1`` and ``T - s`` for the longest version span
    ``s``; ``0`` and ``T - 1`` when that leaves nothing between them).
    """

    problem: PlanProblem
    num_devices: int
    num_mfcs: int
    num_iterations: int
    nodes_per_iteration: int
    device_memory_bytes: float
    opt_offset: np.ndarray
    opt_time: np.ndarray
    opt_act: np.ndarray
    opt_weight: np.ndarray
    opt_state: np.ndarray
    opt_lo: np.ndarray
    opt_size: np.ndarray
    opt_layout: np.ndarray
    nbr_offset: np.ndarray
    nbr: np.ndarray
    mfc_model: np.ndarray
    pre_kind: np.ndarray
    home: np.ndarray
    realloc_offset: np.ndarray
    realloc_table: np.ndarray
    reload_offset: np.ndarray
    reload_table: np.ndarray
    hook_src: np.ndarray
    hook_offset: np.ndarray
    hook_table: np.ndarray
    model_trainable: np.ndarray
    model_home: np.ndarray
    model_calls_offset: np.ndarray
    model_calls: np.ndarray
    edge_src: np.ndarray
    edge_dst: np.ndarray
    edge_offset: np.ndarray
    edge_rows: np.ndarray
    edge_cols: np.ndarray
    edge_src_at: np.ndarray
    edge_dst_at: np.ndarray
    eopt_group: np.ndarray
    eopt_host_lo: np.ndarray
    eopt_host_hi: np.ndarray
    eopt_key: np.ndarray
    data_table: np.ndarray
    child_offset: np.ndarray
    child: np.ndarray
    indegree: np.ndarray
    period_from: int = 0
    period_to: int = 0

    @property
    def num_edges(self) -> int:
        return len(self.edge_src)

    def pre_node(self, i: int) -> int:
        """Local id of MFC ``i``'s pre-node; its call is the next id."""
        return self.num_edges + 2 * i

    @property
    def num_options(self) -> np.ndarray:
        """Options per MFC, shape ``(M,)``."""
        return np.diff(self.opt_offset)

    def check_choice(self, choice) -> np.ndarray:
        """``choice`` as an int64 array, after checking its length and every index's range."""
        arr = np.asarray(choice, dtype=np.int64)
        if arr.shape != (self.num_mfcs,):
            raise ValueError(f"a plan has one option index per MFC ({self.num_mfcs}), got shape {arr.shape}")
        bad = np.nonzero((arr < 0) | (arr >= self.num_options))[0]
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"option {int(arr[i])} of MFC {self.problem.mfc_names[i]!r} is outside [0, {int(self.num_options[i])})"
            )
        return arr


def compile_problem(problem: PlanProblem) -> CompiledProblem:
    """Check ``problem`` and flatten it (see the module docstring).

    Raises:
        ValueError: a mesh outside the cluster, a cycle among data edges, a trainable model
            without a train MFC, or a missing reallocation / reload table.
    """
    _check_meshes(problem)
    _check_acyclic(problem)
    opts = _option_arrays(problem)
    mfc = _mfc_arrays(problem, opts["opt_offset"])
    edges = _edge_arrays(problem)
    graph = _unroll(problem)
    return CompiledProblem(
        problem=problem,
        num_devices=problem.num_devices,
        num_mfcs=problem.num_mfcs,
        num_iterations=problem.num_iterations,
        nodes_per_iteration=2 * problem.num_mfcs + len(problem.data_edges),
        device_memory_bytes=float(problem.device_memory_bytes),
        **opts,
        **mfc,
        **edges,
        **graph,
        **_steady_state(problem),
    )


def _steady_state(problem: PlanProblem) -> dict[str, int]:
    t_count, span = problem.num_iterations, max(problem.spans, default=1)
    first, last = span - 1, t_count - span
    if last <= first:
        first, last = 0, max(t_count - 1, 0)
    return {"period_from": first, "period_to": last}


def _check_meshes(problem: PlanProblem) -> None:
    if problem.num_iterations < 1:
        raise ValueError(f"num_iterations={problem.num_iterations} must be >= 1")
    for i, opts in enumerate(problem.options):
        for opt in opts:
            m = opt.mesh
            if m.devices_per_node != problem.devices_per_node or m.first_device + m.size > problem.num_devices:
                raise ValueError(
                    f"MFC {problem.mfc_names[i]!r}: mesh {m} (devices_per_node={m.devices_per_node}) is outside the "
                    f"cluster of {problem.num_nodes}x{problem.devices_per_node} devices"
                )
            if opt.strategy.world_size != m.size:
                raise ValueError(f"MFC {problem.mfc_names[i]!r}: strategy {opt.strategy} does not fill mesh {m}")


def _check_acyclic(problem: PlanProblem) -> None:
    g = nx.DiGraph(list(problem.data_edges))
    g.add_nodes_from(range(problem.num_mfcs))
    for i, k in problem.data_edges + problem.version_edges:
        if not (0 <= i < problem.num_mfcs and 0 <= k < problem.num_mfcs):
            raise ValueError(f"edge ({i}, {k}) names an MFC outside [0, {problem.num_mfcs})")
    if not nx.is_directed_acyclic_graph(g):
        cycle = [problem.mfc_names[i] for i, _ in nx.find_cycle(g)]
        raise ValueError(f"data edges form a cycle through {cycle}")


def _option_arrays(problem: PlanProblem) -> dict[str, np.ndarray]:
    flat = [(i, j, o) for i, opts in enumerate(problem.options) for j, o in enumerate(opts)]
    layouts: dict[tuple, int] = {}
    layout_ids = [layouts.setdefault((o.mesh, o.strategy, o.replicated), len(layouts)) for _, _, o in flat]
    offset = np.zeros(problem.num_mfcs + 1, dtype=np.int64)
    offset[1:] = np.cumsum([len(o) for o in problem.options])
    nbr_offset, nbr = [0], []
    for opts in problem.options:
        for moves in _local_moves(opts):
            nbr.extend(moves)
            nbr_offset.append(len(nbr))
    return {
        "opt_offset": offset,
        "opt_time": np.array([o.time_s for _, _, o in flat], dtype=np.float64),
        "opt_act": np.array([o.act_bytes for _, _, o in flat], dtype=np.float64),
        "opt_weight": np.array([o.weight_bytes for _, _, o in flat], dtype=np.float64),
        "opt_state": np.array([o.train_state_bytes for _, _, o in flat], dtype=np.float64),
        "opt_lo": np.array([o.mesh.first_device for _, _, o in flat], dtype=np.int64),
        "opt_size": np.array([o.mesh.size for _, _, o in flat], dtype=np.int64),
        "opt_layout": np.array(layout_ids, dtype=np.int64),
        "nbr_offset": np.array(nbr_offset, dtype=np.int64),
        "nbr": np.array(nbr, dtype=np.int64),
    }


def _local_moves(opts) -> list[list[int]]:
    """For every option, the options one small step away, in index order: a factor moved between
    two parallel degrees on the same mesh, the same strategy on a mesh of the same shape elsewhere,
    the mesh halved/doubled around it with dp halved/doubled, or a run of hosts one host longer or
    shorter around it with dp scaled alike (:func:`_one_host_more_or_less`). Options are grouped by mesh and by
    (size, strategy), so the cost grows with the neighbours, not with the square of the options."""
    keys = [(o.mesh.first_device, o.mesh.size, o.strategy.dp, o.strategy.tp, o.strategy.pp) for o in opts]
    dpn = opts[0].mesh.devices_per_node if opts else 1
    by_mesh: dict[tuple[int, int], list[int]] = {}
    by_shape: dict[tuple[int, int, int, int], list[int]] = {}
    for j, (lo, size, dp, tp, pp) in enumerate(keys):
        by_mesh.setdefault((lo, size), []).append(j)
        by_shape.setdefault((size, dp, tp, pp), []).append(j)
    moves = []
    for lo, size, dp, tp, pp in keys:
        near = [
            j
            for j in by_mesh[(lo, size)]
            if (keys[j][2] != dp) + (keys[j][3] != tp) + (keys[j][4] != pp) == 2  # a factor moved
        ]
        near += [j for j in by_shape[(size, dp, tp, pp)] if keys[j][0] != lo]  # shifted
        resized = [by_shape.get((2 * size, 2 * dp, tp, pp), [])]
        if size % 2 == 0 and dp % 2 == 0:
            resized.append(by_shape.get((size // 2, dp // 2, tp, pp), []))
        near += [j for group in resized for j in group if keys[j][0] < lo + size and lo < keys[j][0] + keys[j][1]]
        near += _one_host_more_or_less(keys, by_shape, lo, size, dp, tp, pp, dpn)
        moves.append(sorted(set(near)))
    return moves


def _one_host_more_or_less(keys, by_shape, lo: int, size: int, dp: int, tp: int, pp: int, dpn: int) -> list[int]:
    """Options on a run of hosts one host longer or shorter than a whole-host mesh, nested with it,
    with the same tp and pp and dp scaled by the size. Without this move a mesh of k hosts reaches
    k + 1 only by doubling or by a random jump (1 in thousands of options on 16 hosts), so a plan
    that leaves a host idle is a local optimum of the other moves."""
    if size < dpn:
        return []
    out = []
    for new_size in (size - dpn, size + dpn):
        if new_size < dpn or (dp * new_size) % size:
            continue
        for j in by_shape.get((new_size, dp * new_size // size, tp, pp), []):
            first, last = keys[j][0], keys[j][0] + keys[j][1]
            if (lo <= first and last <= lo + size) or (first <= lo and lo + size <= last):
                out.append(j)
    return out


def _mfc_arrays(problem: PlanProblem, opt_offset: np.ndarray) -> dict[str, np.ndarray]:
    m_count, n_models = problem.num_mfcs, len(problem.models)
    calls: list[list[int]] = [[] for _ in range(n_models)]
    for i, model in enumerate(problem.mfc_models):
        if not 0 <= model < n_models:
            raise ValueError(f"MFC {problem.mfc_names[i]!r} names model {model}, outside [0, {n_models})")
        calls[model].append(i)
    model_home = np.full(n_models, -1, dtype=np.int64)
    for mi, model in enumerate(problem.models):
        if model.trainable:
            if model.train_mfc is None or model.train_mfc not in calls[mi]:
                raise ValueError(
                    f"trainable model {model.name!r} needs train_mfc among its MFCs {calls[mi]}, got {model.train_mfc}"
                )
            model_home[mi] = model.train_mfc
    pre_kind = np.zeros(m_count, dtype=np.int64)
    home = np.full(m_count, -1, dtype=np.int64)
    realloc_offset = np.full(m_count, -1, dtype=np.int64)
    reload_offset = np.full(m_count, -1, dtype=np.int64)
    realloc_parts, reload_parts, realloc_len, reload_len = [], [], 0, 0
    for i, mi in enumerate(problem.mfc_models):
        model, h = problem.models[mi], int(model_home[mi])
        if model.trainable and i != h:
            table = problem.realloc_time.get((h, i))
            if table is None:
                raise ValueError(
                    f"realloc_time lacks the table ({h}, {i}) for {problem.mfc_names[h]!r} -> {problem.mfc_names[i]!r}"
                )
            pre_kind[i], home[i], realloc_offset[i] = PRE_REALLOC, h, realloc_len
            realloc_parts.append(np.asarray(table, dtype=np.float64).ravel())
            realloc_len += realloc_parts[-1].size
        elif not model.trainable and len(calls[mi]) > 1:
            table = problem.reload_time.get(i)
            n_i = int(opt_offset[i + 1] - opt_offset[i])
            if table is None or np.shape(table) != (n_i,):
                raise ValueError(
                    f"reload_time[{i}] ({problem.mfc_names[i]!r}) must have shape ({n_i},), got {None if table is None else np.shape(table)}"
                )
            pre_kind[i], reload_offset[i] = PRE_RELOAD, reload_len
            reload_parts.append(np.asarray(table, dtype=np.float64).ravel())
            reload_len += n_i
    calls_offset = np.zeros(n_models + 1, dtype=np.int64)
    calls_offset[1:] = np.cumsum([len(c) for c in calls])
    hook_src = np.full(m_count, -1, dtype=np.int64)
    hook_offset = np.full(m_count, -1, dtype=np.int64)
    hook_parts, hook_len = [], 0
    for (src, i), table in sorted(problem.hook_time.items()):
        hook_src[i], hook_offset[i] = src, hook_len
        hook_parts.append(np.asarray(table, dtype=np.float64).ravel())
        hook_len += hook_parts[-1].size
    return {
        "hook_src": hook_src,
        "hook_offset": hook_offset,
        "hook_table": np.concatenate(hook_parts) if hook_parts else np.zeros(0),
        "mfc_model": np.asarray(problem.mfc_models, dtype=np.int64),
        "pre_kind": pre_kind,
        "home": home,
        "realloc_offset": realloc_offset,
        "realloc_table": np.concatenate(realloc_parts) if realloc_parts else np.zeros(0),
        "reload_offset": reload_offset,
        "reload_table": np.concatenate(reload_parts) if reload_parts else np.zeros(0),
        "model_trainable": np.array([m.trainable for m in problem.models], dtype=np.int64),
        "model_home": model_home,
        "model_calls_offset": calls_offset,
        "model_calls": np.array([c for cs in calls for c in cs], dtype=np.int64),
    }


def _edge_arrays(problem: PlanProblem) -> dict[str, np.ndarray]:
    """Data edges: ``data_table`` holds each edge's ``(2, rows, cols)`` seconds from ``edge_offset``;
    the ``eopt_*`` arrays hold, from ``edge_src_at`` / ``edge_dst_at``, the group, hosts and
    placement key of each source / destination option (:class:`~rlflow.planner.problem.DataTable`)."""
    tables = [as_data_table(t) for t in problem.data_time]
    sides = [
        side for t in tables for side in ((t.src_group, t.src_hosts, t.src_key), (t.dst_group, t.dst_hosts, t.dst_key))
    ]
    at = np.concatenate([[0], np.cumsum([len(g) for g, _, _ in sides])]).astype(np.int64)
    sizes = [t.seconds.size for t in tables]
    empty = np.zeros(0, dtype=np.int64)
    return {
        "edge_src": np.array([i for i, _ in problem.data_edges], dtype=np.int64),
        "edge_dst": np.array([k for _, k in problem.data_edges], dtype=np.int64),
        "edge_offset": np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if sizes else empty,
        "edge_rows": np.array([t.seconds.shape[1] for t in tables], dtype=np.int64),
        "edge_cols": np.array([t.seconds.shape[2] for t in tables], dtype=np.int64),
        "edge_src_at": at[0:-1:2],
        "edge_dst_at": at[1::2],
        "eopt_group": np.concatenate([g for g, _, _ in sides]).astype(np.int64) if sides else empty,
        "eopt_host_lo": np.concatenate([h[:, 0] for _, h, _ in sides]).astype(np.int64) if sides else empty,
        "eopt_host_hi": np.concatenate([h[:, 1] for _, h, _ in sides]).astype(np.int64) if sides else empty,
        "eopt_key": np.concatenate([k for _, _, k in sides]).astype(np.int64) if sides else empty,
        "data_table": (
            np.concatenate([np.asarray(t.seconds, dtype=np.float64).ravel() for t in tables]) if sizes else np.zeros(0)
        ),
    }


def data_seconds(cp: CompiledProblem, e: int, a: int, b: int) -> float:
    """Seconds of data edge ``e`` from source option ``a`` to destination option ``b`` (the C++
    simulator's ``data_seconds``)."""
    sa, sb = int(cp.edge_src_at[e]) + a, int(cp.edge_dst_at[e]) + b
    if cp.eopt_key[sa] >= 0 and cp.eopt_key[sa] == cp.eopt_key[sb]:
        return 0.0
    lo = min(cp.eopt_host_lo[sa], cp.eopt_host_lo[sb])
    hi = max(cp.eopt_host_hi[sa], cp.eopt_host_hi[sb])
    cross = int(hi - lo != 1)
    rows, cols = int(cp.edge_rows[e]), int(cp.edge_cols[e])
    return float(cp.data_table[cp.edge_offset[e] + (cross * rows + cp.eopt_group[sa]) * cols + cp.eopt_group[sb]])


def _unroll(problem: PlanProblem) -> dict[str, np.ndarray]:
    m, e_count, t_count = problem.num_mfcs, len(problem.data_edges), problem.num_iterations
    k = e_count + 2 * m
    children: list[list[int]] = [[] for _ in range(t_count * k)]
    for t in range(t_count):
        pre, call = t * k + e_count, t * k + e_count + 1  # + 2*i
        for i in range(m):
            children[pre + 2 * i].append(call + 2 * i)
        for e, (src, dst) in enumerate(problem.data_edges):
            children[call + 2 * src].append(t * k + e)
            children[t * k + e].append(pre + 2 * dst)
        for (src, dst), span in zip(problem.version_edges, problem.spans):
            if t >= span:
                children[call - span * k + 2 * src].append(pre + 2 * dst)
            if t >= 1 and span > 1:
                children[call - k + 2 * dst].append(pre + 2 * dst)
    indegree = np.zeros(t_count * k, dtype=np.int64)
    for cs in children:
        for c in cs:
            indegree[c] += 1
    offset = np.zeros(t_count * k + 1, dtype=np.int64)
    offset[1:] = np.cumsum([len(c) for c in children])
    return {
        "child_offset": offset,
        "child": np.array([c for cs in children for c in cs], dtype=np.int64),
        "indegree": indegree,
    }
