"""The search space: every (device mesh, parallel strategy) an MFC may take.

Meshes (ReaLHF's): whole hosts — ``(k, devices_per_node)`` starting at any host — or a
consecutive run of one host whose size divides the host's device count, at any aligned
position: on 8-device hosts (1,1), (1,2), (1,4), (1,8), (2,8)… A 1x8 cluster has
8 + 4 + 2 + 1 = 15 meshes; 2x8 has 2*14 + 2 + 1 = 31.

Strategies ``(dp, tp, pp)`` with ``dp*tp*pp == mesh.size``; tp groups are consecutive ranks,
so ``tp`` divides the devices the mesh uses on each host (tp stays inside a host) and divides
the attention and key/value heads (rlflow's engines shard whole heads); ``pp`` is at most the
number of layers; every dp rank gets enough sequences for its micro-batches. What the engines
cannot run is excluded through :class:`RuntimeCapabilities`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from rlflow.dataflow.mfc import MFCDef
from rlflow.planner.mesh import DeviceMesh
from rlflow.planner.model_spec import ModelSpec
from rlflow.strategy import ParallelStrategy

# Micro-batches per pipeline stage when an MFC does not say: 1F1B needs at least pp in flight to
# fill the pipeline; twice that keeps the bubble (pp-1)/n_mb under one half.
MICROBATCHES_PER_STAGE = 2


@dataclass(frozen=True)
class RuntimeCapabilities:
    """What rlflow's engines can run; the planner never proposes anything else.

    Attributes:
        pipeline_generate / pipeline_inference / pipeline_train: ``pp > 1`` is supported for
            that interface. The built-in sampler pipelines generation
            (:mod:`rlflow.engine.rollout.pipelined`); vLLM rollouts do not, and a trainer reads
            what its engine declares (``rlflow.trainer.placement.runtime_capabilities``).
        tensor_parallel_generate: ``tp > 1`` is supported for generation.
        max_tp / max_pp: upper bounds on the degrees (``None``: no bound beyond the mesh).
        generate_world_size: a generation must use exactly this many devices (the whole
            cluster: vLLM's external launcher builds its groups over every worker); ``None``:
            any mesh.
        data_parallel_train_models: models whose train calls run with ``tp = pp = 1`` only
            (a LoRA actor: :mod:`rlflow.engine.lora`).
    """

    pipeline_generate: bool = True
    pipeline_inference: bool = True
    pipeline_train: bool = True
    tensor_parallel_generate: bool = True
    max_tp: int | None = None
    max_pp: int | None = None
    generate_world_size: int | None = None
    data_parallel_train_models: frozenset[str] = frozenset()

    def allows(self, interface_type: str, strategy: ParallelStrategy, model_name: str | None = None) -> bool:
        """True when the engines can run ``interface_type`` of ``model_name`` under ``strategy``."""
        if (
            interface_type == "train_step"
            and model_name in self.data_parallel_train_models
            and (strategy.tp > 1 or strategy.pp > 1)
        ):
            return False
        pipeline = {
            "generate": self.pipeline_generate,
            "inference": self.pipeline_inference,
            "train_step": self.pipeline_train,
        }[interface_type]
        if strategy.pp > 1 and not pipeline:
            return False
        if strategy.tp > 1 and interface_type == "generate" and not self.tensor_parallel_generate:
            return False
        if (
            interface_type == "generate"
            and self.generate_world_size is not None
            and strategy.world_size != self.generate_world_size
        ):
            return False
        if self.max_tp is not None and strategy.tp > self.max_tp:
            return False
        return self.max_pp is None or strategy.pp <= self.max_pp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@lru_cache(maxsize=64)
def enumerate_meshes(num_nodes: int, devices_per_node: int) -> tuple[DeviceMesh, ...]:
    """All meshes of a ``num_nodes`` x ``devices_per_node`` cluster, by size then position.

    >>> len(enumerate_meshes(1, 8)), len(enumerate_meshes(2, 8))
    (15, 31)
    """
    if num_nodes < 1 or devices_per_node < 1:
        raise ValueError(f"cluster shape ({num_nodes}, {devices_per_node}) must be positive")
    meshes = [
        DeviceMesh(1, size, node, start, devices_per_node)
        for size in _divisors(devices_per_node)[:-1]
        for node in range(num_nodes)
        for start in range(0, devices_per_node, size)
    ]
    meshes += [
        DeviceMesh(k, devices_per_node, node, 0, devices_per_node)
        for k in range(1, num_nodes + 1)
        for node in range(num_nodes - k + 1)
    ]
    return tuple(meshes)


def seqs_per_rank(n_seqs: int, dp: int, n_minibatches: int = 1) -> int:
    """Sequences the busiest dp rank processes per (mini-)batch: ``ceil(n_seqs / n_minibatches / dp)``."""
    return math.ceil(math.ceil(n_seqs / n_minibatches) / dp)


def num_microbatches(
    mfc: MFCDef,
    strategy: ParallelStrategy,
    n_seqs: int,
    seq_len: int,
    n_minibatches: int = 1,
    max_tokens_per_mb: int | None = None,
) -> int:
    """Micro-batches every dp rank splits one (mini-)batch into — the planner and the engines agree on it.

    ``mfc.n_mbs`` when set. Otherwise a generation runs its batch at once (``pp`` micro-batches
    when pipelined; the sampler cuts them of whole prompts, so never more than the rank's prompts); other calls take ``MICROBATCHES_PER_STAGE * pp`` under pipelining, else 1,
    raised so that no micro-batch exceeds ``max_tokens_per_mb`` tokens, and never more than
    the rank's sequences.

    Args:
        mfc: the call.
        strategy: its parallel strategy.
        n_seqs: sequences of the call per iteration.
        seq_len: tokens per sequence (prompt + response).
        n_minibatches: optimizer steps per call (train_step).
        max_tokens_per_mb: token budget of one micro-batch; ``None``: unbounded.
    """
    if mfc.n_mbs is not None:
        return mfc.n_mbs
    rank_seqs = seqs_per_rank(n_seqs, strategy.dp, n_minibatches)
    if mfc.interface_type == "generate":
        return min(strategy.pp, rank_seqs)
    n = MICROBATCHES_PER_STAGE * strategy.pp if strategy.pp > 1 else 1
    if max_tokens_per_mb is not None:
        n = max(n, math.ceil(rank_seqs * seq_len / max_tokens_per_mb))
    return max(1, min(n, rank_seqs))


def enumerate_strategies(
    mesh: DeviceMesh,
    model: ModelSpec,
    mfc: MFCDef,
    n_seqs: int,
    n_minibatches: int = 1,
    capabilities: RuntimeCapabilities | None = None,
) -> list[ParallelStrategy]:
    """Valid strategies of ``mfc`` on ``mesh``, ordered by (tp, pp).

    A dp rank needs ``floor(n_seqs / n_minibatches / dp)`` at least ``mfc.min_n_seqs_per_dp``,
    ``mfc.n_mbs`` and ``pp`` sequences (a pipeline with fewer micro-batches than stages idles);
    tp divides the heads and kv heads; a model with a ``tp_blocker`` (``pp_blocker``) gets tp = 1 (pp = 1) only.
    """
    caps = capabilities or RuntimeCapabilities()
    per_batch = n_seqs // n_minibatches
    need = max(mfc.min_n_seqs_per_dp, mfc.n_mbs or 1)
    found = []
    for tp in _divisors(mesh.num_devices):
        if model.num_heads % tp or model.num_kv_heads % tp or (tp > 1 and model.tp_blocker):
            continue
        for pp in _divisors(mesh.size // tp):
            dp = mesh.size // (tp * pp)
            strategy = ParallelStrategy(dp=dp, tp=tp, pp=pp)
            if pp > model.num_layers or per_batch // dp < max(need, pp) or (pp > 1 and model.pp_blocker):
                continue
            if caps.allows(mfc.interface_type, strategy, mfc.model_name):
                found.append(strategy)
    return found


def enumerate_options(
    mfc: MFCDef,
    model: ModelSpec,
    num_nodes: int,
    devices_per_node: int,
    n_seqs: int,
    n_minibatches: int = 1,
    capabilities: RuntimeCapabilities | None = None,
) -> list[tuple[DeviceMesh, ParallelStrategy]]:
    """Every ``(mesh, strategy)`` of ``mfc`` on the cluster, meshes in :func:`enumerate_meshes` order.

    >>> from rlflow.dataflow import algorithm_mfcs
    >>> from rlflow.planner.model_spec import model_preset
    >>> gen = algorithm_mfcs("ppo")[0]
    >>> no_pp = RuntimeCapabilities(pipeline_generate=False)
    >>> len(enumerate_options(gen, model_preset("llama2-7b"), 1, 8, n_seqs=64, capabilities=no_pp))  # dp*tp per mesh
    26
    """
    options = []
    by_shape: dict[tuple[int, int], list[ParallelStrategy]] = {}
    for mesh in enumerate_meshes(num_nodes, devices_per_node):
        if mesh.shape not in by_shape:
            by_shape[mesh.shape] = enumerate_strategies(mesh, model, mfc, n_seqs, n_minibatches, capabilities)
        options += [(mesh, s) for s in by_shape[mesh.shape]]
    return options
