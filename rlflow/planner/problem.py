"""The numeric planning problem: what the cost model hands to the simulator and the search.

``build_problem`` (cost model side) turns a dataflow graph, model specs and a cluster into a
:class:`PlanProblem`: for every MFC the list of (mesh, strategy) options it may take, each
with its estimated time and memory, plus the transfer costs between options. The simulator
(Python and C++) and the MCMC search only read these numbers; a *plan* is one option index
per MFC.

Semantics the simulator implements (all times in seconds, all memory in bytes per device):

* The graph is unrolled over ``num_iterations``. Node ``(t, i)`` is MFC ``i`` of iteration ``t``.
  Data edges ``(i, k)`` join nodes of one iteration; version edges ``(i, k)`` of span ``s`` join
  ``(t-s, i)`` to ``(t, k)`` (the first call on a model in iteration t waits for its last call in
  t-1; a generation under ``policy_lag`` L for the last call of t-1-L, span 1+L).
* A call occupies the devices of its option's mesh for ``time_s``. Calls whose device sets
  overlap run one after another; disjoint ones overlap (list scheduling, ReaLHF Algorithm 1).
* Trainable models have a *home*: the option of their ``train_mfc``. Another call of the model
  on a different option is preceded by a reallocation node of ``realloc_time[(train_mfc, i)][h, o]``
  occupying the union of both meshes. Equal layouts cost nothing (the table holds 0).
* A frozen model whose calls all take the same layout stays resident; otherwise each of its
  calls is preceded by a reload node of ``reload_time[i][o]`` on the call's mesh.
* A layout is a mesh, a strategy and whether the call runs on a dp-replicated copy
  (``CallOption.replicated``: generations); a generation never shares its home's FSDP layout, so
  it is always preceded by a reallocation (on the home's own mesh and strategy: a gather of the
  FSDP shards).
* A weight hook (an EMA blend, ``ParamReallocHook``) of call ``i`` from the model trained by
  ``src`` adds ``hook_time[(src, i)][o_src, o_i]`` to the node before call ``i``, which then also
  occupies the mesh of ``src``'s option.
* A data edge ``(i, k)`` whose ``data_time[e][oi, ok]`` is positive becomes a transfer node
  occupying both meshes.
* Memory on a device = static + peak dynamic. Static: ``train_state_bytes`` + ``weight_bytes``
  of every trainable model on its home mesh, and ``weight_bytes`` of resident frozen models.
  Dynamic, during a call: its ``act_bytes``, plus ``weight_bytes`` when the call runs on a
  reallocated copy or a reloaded frozen model.
* A plan whose peak memory exceeds ``device_memory_bytes`` on any device does not fit; the
  search multiplies its time by a large penalty.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from rlflow.planner.mesh import DeviceMesh
from rlflow.strategy import ParallelStrategy


@dataclass(frozen=True, eq=False)
class DataTable:
    """Seconds of one data edge for every (source option, destination option) pair, stored by group.

    A transfer's time depends on the two options' dp degrees (their *groups*) and on whether both
    meshes lie on one host — not on where the meshes sit — and it is 0 between options of the same
    placement. So an edge between MFCs of thousands of options is a ``(2, G_src, G_dst)`` table of
    a few dozen dp degrees each: entry ``(a, b)`` is ``seconds[crosses_hosts, src_group[a],
    dst_group[b]]``, or 0 when ``src_key[a] == dst_key[b] >= 0``.

    Attributes:
        seconds: ``(2, G_src, G_dst)``; ``[0]`` both meshes on one host, ``[1]`` across hosts.
        src_group / dst_group: ``(n_src,)`` / ``(n_dst,)`` group of every option.
        src_hosts / dst_hosts: ``(n, 2)`` first host and one past the last host of every option.
        src_key / dst_key: placement keys (:func:`rlflow.planner.transfer.placement_keys`); negative
            keys never match.
    """

    seconds: np.ndarray
    src_group: np.ndarray
    dst_group: np.ndarray
    src_hosts: np.ndarray
    dst_hosts: np.ndarray
    src_key: np.ndarray
    dst_key: np.ndarray

    @classmethod
    def dense(cls, table) -> DataTable:
        """A table given cell by cell (one group per option, no free placements)."""
        t = np.asarray(table, dtype=np.float64)
        if t.ndim != 2:
            raise ValueError(f"a dense data table has 2 dimensions, got shape {t.shape}")
        rows, cols = np.arange(t.shape[0]), np.arange(t.shape[1])
        hosts = np.zeros((t.shape[0], 2), dtype=np.int64), np.zeros((t.shape[1], 2), dtype=np.int64)
        hosts[0][:, 1], hosts[1][:, 1] = 1, 1
        return cls(np.stack([t, t]), rows, cols, *hosts, -np.ones(len(rows), np.int64), -np.ones(len(cols), np.int64))

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.src_group), len(self.dst_group)

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    def __getitem__(self, index: tuple[int, int]) -> float:
        a, b = index
        if self.src_key[a] >= 0 and self.src_key[a] == self.dst_key[b]:
            return 0.0
        lo = min(self.src_hosts[a, 0], self.dst_hosts[b, 0])
        hi = max(self.src_hosts[a, 1], self.dst_hosts[b, 1])
        return float(self.seconds[int(hi - lo != 1), self.src_group[a], self.dst_group[b]])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        lo = np.minimum(self.src_hosts[:, None, 0], self.dst_hosts[None, :, 0])
        hi = np.maximum(self.src_hosts[:, None, 1], self.dst_hosts[None, :, 1])
        t = self.seconds[(hi - lo != 1).astype(np.int64), self.src_group[:, None], self.dst_group[None, :]]
        same = (self.src_key[:, None] >= 0) & (self.src_key[:, None] == self.dst_key[None, :])
        t = np.where(same, 0.0, t)
        return t if dtype is None else t.astype(dtype)

    def take(self, rows: Sequence[int], cols: Sequence[int]) -> DataTable:
        """The table of source options ``rows`` and destination options ``cols``."""
        r, c = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
        return replace(
            self,
            src_group=self.src_group[r],
            dst_group=self.dst_group[c],
            src_hosts=self.src_hosts[r],
            dst_hosts=self.dst_hosts[c],
            src_key=self.src_key[r],
            dst_key=self.dst_key[c],
        )


def as_data_table(table: DataTable | np.ndarray) -> DataTable:
    """``table`` itself if it is a :class:`DataTable`, else the dense array as one."""
    return table if isinstance(table, DataTable) else DataTable.dense(table)


@dataclass(frozen=True)
class CallOption:
    """One candidate placement of one MFC, with its estimated cost."""

    mesh: DeviceMesh
    strategy: ParallelStrategy
    time_s: float  # seconds the call itself runs an iteration (compute + its own collectives; every round of it)
    act_bytes: float  # peak dynamic bytes per device during the call, weights excluded
    weight_bytes: float  # bytes of the model's weights held per device under this strategy
    train_state_bytes: float = 0.0  # grads + optimizer state per device (train_step options only)
    replicated: bool = False  # runs on a dp-replicated copy of the weights (generation), never on FSDP shards


@dataclass
class ModelEntry:
    """A named set of weights and how the planner treats it."""

    name: str
    trainable: bool
    train_mfc: int | None = None  # index of the MFC whose option is the model's home layout


@dataclass
class PlanProblem:
    """Everything the simulator and the search need, as plain numbers.

    Attributes:
        num_nodes, devices_per_node, device_memory_bytes: the cluster.
        mfc_names: MFC names, index = MFC id.
        mfc_models: model index (into ``models``) of every MFC.
        options: ``options[i]`` lists the placements MFC ``i`` may take.
        data_edges: ``(i, k)`` pairs within one iteration; ``data_time[e]`` has shape
            ``(len(options[i]), len(options[k]))``: a :class:`DataTable` (what ``build_problem``
            makes: stored by dp degree) or a dense array.
        version_edges: ``(i, k)``: call ``k`` of iteration t waits for call ``i`` of t-``span``.
        version_spans: the span of every version edge (iterations, >= 1); empty: all 1.
        realloc_time: ``(train_mfc, i) -> array (len(options[train_mfc]), len(options[i]))``.
        reload_time: ``i -> array (len(options[i]),)`` for MFCs of frozen models.
        hook_time: ``(src, i) -> array (len(options[src]), len(options[i]))``: weight hooks (EMA
            blends) before call ``i`` from the home of ``src``'s model; one source per call.
        num_iterations: how many iterations the simulator unrolls.
    """

    num_nodes: int
    devices_per_node: int
    device_memory_bytes: float
    mfc_names: list[str]
    mfc_models: list[int]
    options: list[list[CallOption]]
    models: list[ModelEntry]
    data_edges: list[tuple[int, int]] = field(default_factory=list)
    data_time: list[DataTable | np.ndarray] = field(default_factory=list)
    version_edges: list[tuple[int, int]] = field(default_factory=list)
    version_spans: list[int] = field(default_factory=list)
    realloc_time: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    reload_time: dict[int, np.ndarray] = field(default_factory=dict)
    hook_time: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    num_iterations: int = 3

    def __post_init__(self) -> None:
        n = len(self.mfc_names)
        if len(self.mfc_models) != n or len(self.options) != n:
            raise ValueError(
                f"mfc_names ({n}), mfc_models ({len(self.mfc_models)}) and options ({len(self.options)}) differ in length"
            )
        for i, opts in enumerate(self.options):
            if not opts:
                raise ValueError(f"MFC {self.mfc_names[i]!r} has no feasible option")
        if len(self.data_time) != len(self.data_edges):
            raise ValueError(f"{len(self.data_edges)} data edges but {len(self.data_time)} data_time tables")
        for (i, k), table in zip(self.data_edges, self.data_time):
            expected = (len(self.options[i]), len(self.options[k]))
            if table.shape != expected:
                raise ValueError(
                    f"data_time for edge {self.mfc_names[i]}->{self.mfc_names[k]} has shape {table.shape}, expected {expected}"
                )
        for attr in ("realloc_time", "hook_time"):
            for (h, i), table in getattr(self, attr).items():
                if not (0 <= h < n and 0 <= i < n):
                    raise ValueError(f"{attr}[{h},{i}] names an MFC outside [0, {n})")
                expected = (len(self.options[h]), len(self.options[i]))
                if np.shape(table) != expected:
                    raise ValueError(f"{attr}[{h},{i}] has shape {np.shape(table)}, expected {expected}")
        if self.version_spans and len(self.version_spans) != len(self.version_edges):
            raise ValueError(f"{len(self.version_edges)} version edges but {len(self.version_spans)} version_spans")
        if any(s < 1 for s in self.version_spans):
            raise ValueError(f"version_spans={self.version_spans}: every span must be >= 1 iteration")
        targets = [i for _, i in self.hook_time]
        if len(targets) != len(set(targets)):
            doubled = sorted({self.mfc_names[i] for i in targets if targets.count(i) > 1})
            raise ValueError(f"MFC(s) {doubled} have weight hooks from several sources; one source per call is priced")

    @property
    def spans(self) -> list[int]:
        """The span of every version edge (1 where ``version_spans`` is empty)."""
        return list(self.version_spans) or [1] * len(self.version_edges)

    @property
    def num_mfcs(self) -> int:
        return len(self.mfc_names)

    def restricted(self, keep: Mapping[int, Sequence[int]]) -> PlanProblem:
        """The same problem with MFC ``i``'s options cut to ``keep[i]`` (indices, in that order).

        Every table indexed by those options is sliced to match, so a plan of the restricted
        problem prices exactly as the same placements in this one. Used to tie calls together
        (every ``generate`` of one vLLM model on one strategy) by searching once per tie.
        """
        idx = {i: list(keep.get(i, range(len(opts)))) for i, opts in enumerate(self.options)}

        def cut(table: np.ndarray, rows: int, cols: int) -> np.ndarray:
            return np.asarray(table)[np.ix_(idx[rows], idx[cols])]

        return replace(
            self,
            options=[[opts[j] for j in idx[i]] for i, opts in enumerate(self.options)],
            data_time=[as_data_table(t).take(idx[i], idx[k]) for (i, k), t in zip(self.data_edges, self.data_time)],
            realloc_time={(h, i): cut(t, h, i) for (h, i), t in self.realloc_time.items()},
            reload_time={i: np.asarray(t)[idx[i]] for i, t in self.reload_time.items()},
            hook_time={(h, i): cut(t, h, i) for (h, i), t in self.hook_time.items()},
        )

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    def option_index(self, mfc: int, mesh: DeviceMesh, strategy: ParallelStrategy) -> int:
        """Index of the option of ``mfc`` with this mesh and strategy; ``KeyError`` if absent."""
        for j, opt in enumerate(self.options[mfc]):
            if opt.mesh == mesh and opt.strategy == strategy:
                return j
        raise KeyError(f"MFC {self.mfc_names[mfc]!r} has no option with mesh {mesh} and strategy {strategy}")
