"""The reallocation manager: keeps each model's copies in other layouts current, lazily.

Every pool worker owns one :class:`ReallocManager`. Per model it knows

* the **home** layout and module — where the model trains (gradients and optimizer state
  live there) or, for a frozen model, where it rests (possibly offloaded to host);
* a **version** counter, bumped after every optimizer step (:meth:`bump_version`) and by
  :meth:`ema_update`;
* per other layout, the **copy** this worker holds (if any) and the version it was made from.

Calling protocol (what the worker/trainer layer must do; ``U = home.ranks ∪ layout.ranks``):

1. start-up, on every pool rank: ``init_global_group``, then ``build_plan_groups`` for all
   calls of the plan (same order everywhere), then ``register(...)`` for every model;
2. before a call of model ``m`` on ``layout``: ``pre_call(m, layout)`` on every rank of ``U``;
   it returns the module to run on ranks of ``layout`` (None on the others);
3. after the call: ``post_call(m, layout)`` on the ranks of ``layout`` (frees the copy unless
   the model was registered with ``keep_copies``; offloads a frozen model's home module when so
   registered). A kept copy carries the home version it was made from; ``pre_call`` reshards
   it only when the home changed since (counted in ``stats["skipped"]`` otherwise), and then
   only the parameters registered as ``changing`` when every rank's copy was filled before (a
   LoRA home: the adapted weights; the frozen rest of a kept copy is current already), or, for a
   model registered ``low_rank``, only its adapters, which the copy merges itself
   (:mod:`rlflow.parallel.low_rank`);
4. after each optimizer step of ``m``: ``bump_version(m)`` on the ranks of ``m``'s home layout;
5. an EMA reference: ``ema_update(ref, actor, eta)`` on every rank of both home layouts;
6. a model that starts as a copy of another (``init: copy``): ``copy_weights(target, source)``
   on every rank of both home layouts (shared parameters only: a critic keeps its value head).

Agreement: whether a copy is stale is decided by one coordinator (the first home rank) from
the states the copy's ranks report, and announced to all of ``U`` — two rounds of tiny
point-to-point messages — so ranks never disagree, even when copies are freed by a local
memory decision.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

from rlflow.parallel.executor import ParamViews, ReshardStats, execute_reshard, module_param_tensors
from rlflow.parallel.layout import Layout
from rlflow.parallel.low_rank import LowRankUpdate, LowRankViews, adapter_layouts, empty_boxes, merge_into
from rlflow.parallel.offload import Offload, offload_module
from rlflow.parallel.reshard import ReshardPlan, plan_reshard

# Builds this rank's empty module of a layout (the engine layer provides it), or an engine
# exposing its parameters as views (ParamViews: the vLLM rollout). It must not create process
# groups: groups come from build_call_groups' cache, filled at start-up.
ModuleFactory = Callable[[Layout], nn.Module | ParamViews]


@dataclass
class _Copy:
    module: nn.Module | ParamViews
    version: int
    base: dict[str, torch.Tensor] | None = None  # W0 of its adapted weights (a low-rank push's copy)


@dataclass
class _Model:
    home: Layout
    module: nn.Module | None  # None on ranks outside the home layout
    factory: ModuleFactory
    dtype: torch.dtype
    trainable: bool
    offload_home: bool
    keep_copies: bool = False
    changing: frozenset[str] | None = None
    low_rank: tuple[LowRankUpdate, ...] | None = None
    version: int = 0
    copies: dict[Layout, _Copy] = field(default_factory=dict)
    offloaded: Offload | None = None


class ReallocManager:
    """Per-worker bookkeeping and execution of reallocations (see the module docstring).

    Args:
        rank: this worker's global rank.
        host_of: host index of every global rank (all on one host if None).
        group: the pool's process group (default group if None).
        device: device of the small control messages (``cuda`` under NCCL; CPU by default).
    """

    def __init__(
        self,
        rank: int,
        *,
        host_of: Mapping[int, int] | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.rank = rank
        self.host_of = dict(host_of) if host_of is not None else None
        self.group = group
        self.device = torch.device(device)
        self._models: dict[str, _Model] = {}
        self._plans: dict[tuple[Layout, Layout], ReshardPlan] = {}
        self._low_rank_layouts: dict[tuple, tuple[Layout, Layout]] = {}
        # Counters for metrics: reshards run on this rank, their seconds and wire bytes (what it
        # sent also split by the receiver's host: its own or another), and the calls off home
        # whose copy was current (no reshard).
        self.stats = {
            "reshards": 0,
            "reshard_seconds": 0.0,
            "sent_bytes": 0,
            "received_bytes": 0,
            "sent_intra_host_bytes": 0,
            "sent_inter_host_bytes": 0,
            "copied_bytes": 0,
            "skipped": 0,
            "partial": 0,
        }

    # ---- registration and versions ----

    def register(
        self,
        name: str,
        home: Layout,
        module: nn.Module | None,
        factory: ModuleFactory,
        *,
        dtype: torch.dtype,
        trainable: bool = True,
        offload_home: bool = False,
        keep_copies: bool = False,
        changing: frozenset[str] | None = None,
        low_rank: tuple[LowRankUpdate, ...] | None = None,
    ) -> None:
        """Declare model ``name`` with its home layout (every pool rank calls it).

        Args:
            name: model name (``"actor"``, ``"ref"`` …).
            home: the home layout (training layout of a trainable model).
            module: this rank's home module; None on ranks outside ``home``.
            factory: builds an empty module of another layout on this rank.
            dtype: dtype of the weights on the wire (the copies' dtype).
            trainable: whether the model takes optimizer steps.
            offload_home: frozen models only: keep the home module on host between calls.
            keep_copies: keep this rank's copies of the model in other layouts after their
                calls; they are resharded only when the home version changed.
            changing: names of the only parameters whose values a version bump can change (a
                LoRA home: its adapted weights, merged; the rest is its frozen base); a kept copy
                filled before gets only these (counted in ``stats["partial"]``). None: all of them.
            low_rank: the weights a step changes through adapters (a LoRA home, given as
                :class:`~rlflow.parallel.low_rank.LowRankViews`), with ``keep_copies``: a copy holds
                their base and merges the adapters itself — its first push moves the base and the
                adapters, later ones the adapters only (:mod:`rlflow.parallel.low_rank`). Copies
                that are not kept get the home's ``param_tensors()`` (merged) as usual.
        """
        if name in self._models:
            raise ValueError(f"model {name!r} is already registered")
        in_home = self.rank in home.ranks
        if in_home != (module is not None):
            raise ValueError(f"rank {self.rank}: module must be given exactly on home ranks {home.ranks} of {name!r}")
        if offload_home and trainable:
            raise ValueError(
                f"{name!r}: offload_home is for frozen models; a trainable model keeps its optimizer state"
            )
        if low_rank is not None and module is not None and not isinstance(module, LowRankViews):
            raise ValueError(f"{name!r}: low_rank needs a home module with base_tensors() and adapter_tensors()")
        entry = _Model(home, module, factory, dtype, trainable, offload_home, keep_copies, changing, low_rank)
        if offload_home and module is not None:
            entry.offloaded = offload_module(module)
        self._models[name] = entry

    def _model(self, name: str) -> _Model:
        if name not in self._models:
            raise KeyError(f"unknown model {name!r}; registered: {sorted(self._models)}")
        return self._models[name]

    def version(self, name: str) -> int:
        return self._model(name).version

    def copy_version(self, name: str, layout: Layout) -> int | None:
        """The home version this rank's copy of ``name`` in ``layout`` was made from; None without a copy."""
        copy = self._model(name).copies.get(layout)
        return copy.version if copy is not None else None

    def home_module(self, name: str) -> nn.Module | None:
        return self._model(name).module

    def holds_copy(self, name: str, layout: Layout) -> bool:
        """Whether this rank holds a copy of ``name`` in ``layout`` (current or not)."""
        return layout in self._model(name).copies

    def bump_version(self, name: str) -> int:
        """Mark model ``name`` as changed (after an optimizer step); call on its home ranks."""
        m = self._model(name)
        if self.rank not in m.home.ranks:
            raise ValueError(f"rank {self.rank} is not in the home layout of {name!r}; bump versions on {m.home.ranks}")
        m.version += 1
        return m.version

    def restore_version(self, name: str, version: int) -> None:
        """Set ``name``'s version to the one a checkpoint recorded, after its weights were loaded:
        every copy this rank holds is stale from now on (its next call reshards)."""
        m = self._model(name)
        m.version = version
        for copy in m.copies.values():
            copy.version = -1

    # ---- calls ----

    def pre_call(self, name: str, layout: Layout) -> nn.Module | ParamViews | None:
        """Make this rank's copy of ``name`` in ``layout`` current; collective over home ∪ layout ranks.

        Returns:
            The module (or :class:`ParamViews` engine) to run on ranks of ``layout`` (the home
            module itself when ``layout`` is the home layout); None on home-only ranks.
        """
        m = self._model(name)
        if layout == m.home:
            if m.offloaded is not None and m.offloaded.offloaded:
                m.offloaded.reload()
            return m.module
        stale, version, filled = self._agree_staleness(m, layout)
        if stale:
            self._reshard(m, layout, version, filled)
        else:
            self.stats["skipped"] += 1
        copy = m.copies.get(layout)
        return copy.module if copy is not None else None

    def post_call(self, name: str, layout: Layout) -> None:
        """After a call on ``layout``: free this rank's copy unless the model keeps its copies."""
        m = self._model(name)
        if layout == m.home:
            if m.offload_home and m.module is not None:
                m.offloaded.offload()
            return
        if not m.keep_copies:
            m.copies.pop(layout, None)

    # ---- EMA ----

    @torch.no_grad()
    def ema_update(self, ref: str, actor: str, eta: float) -> None:
        """``ref = (1 - eta) * ref + eta * actor`` in the reference's home layout.

        Collective over the ranks of both home layouts: the actor's current weights are
        resharded into scratch tensors shaped like the reference's local shards, then blended.
        """
        if not 0.0 <= eta <= 1.0:
            raise ValueError(f"eta={eta} must be in [0, 1]")
        r, a = self._model(ref), self._model(actor)
        plan = self._plan(a.home, r.home)
        actor_reloaded = self._reload_home(a)
        src = module_param_tensors(a.module) if a.module is not None else None
        dst = scratch = None
        reloaded = self._reload_home(r)
        if r.module is not None:
            dst = module_param_tensors(r.module)
            scratch = {n: [torch.empty_like(ts[0], dtype=r.dtype)] for n, ts in dst.items()}
        self._count(execute_reshard(plan, self.rank, src, scratch, dtype=r.dtype, group=self.group))
        if dst is not None:
            for n, ts in dst.items():
                for t in ts:
                    t.lerp_(scratch[n][0].to(t.dtype), eta)
            r.version += 1
        if reloaded:
            r.offloaded.offload()
        if actor_reloaded:
            a.offloaded.offload()

    # ---- copies between models ----

    @torch.no_grad()
    def copy_weights(self, target: str, source: str) -> tuple[str, ...]:
        """``target ← source`` for every parameter both models have, in the target's home layout.

        For two models of one architecture this is ``ema_update(target, source, eta=1.0)``. A
        target with another head — a critic copied from a policy — takes the shared backbone
        (same names, same shapes) and keeps its own head. Collective over the ranks of both
        home layouts; the weights go home to home, resharded like any reallocation. The
        target's version is bumped, so its copies in other layouts become stale.

        Returns:
            The target's parameters left as they were (its own head), sorted.

        Raises:
            ValueError: a parameter of both models with different shapes, or none in common.
        """
        t, s = self._model(target), self._model(source)
        src_layout, dst_layout, kept = _shared_layouts(s.home, t.home, source, target)
        plan = self._plan(src_layout, dst_layout)
        source_reloaded, target_reloaded = self._reload_home(s), self._reload_home(t)
        src = _restrict(module_param_tensors(s.module), src_layout, self.rank) if s.module is not None else None
        dst = _restrict(module_param_tensors(t.module), dst_layout, self.rank) if t.module is not None else None
        self._count(execute_reshard(plan, self.rank, src, dst, dtype=t.dtype, group=self.group))
        if t.module is not None:
            t.version += 1
        if target_reloaded:
            t.offloaded.offload()
        if source_reloaded:
            s.offloaded.offload()
        return kept

    # ---- internals ----

    def _plan(self, src: Layout, dst: Layout) -> ReshardPlan:
        key = (src, dst)
        if key not in self._plans:
            self._plans[key] = plan_reshard(src, dst, self.host_of)
        return self._plans[key]

    def _agree_staleness(self, m: _Model, layout: Layout) -> tuple[bool, int, bool]:
        """Coordinator (first home rank) collects copy versions, decides, and tells everyone:
        ``(stale, home version, every rank's copy was filled at some version)``."""
        coordinator = m.home.ranks[0]
        participants = sorted(set(m.home.ranks) | set(layout.ranks))
        if self.rank == coordinator:
            versions = []
            for r in layout.ranks:
                if r == self.rank:
                    versions.append(self._copy_version(m, layout))
                else:
                    buf = torch.empty(1, dtype=torch.int64, device=self.device)
                    dist.recv(buf, r, group=self.group)
                    versions.append(int(buf))
            stale, filled = any(v != m.version for v in versions), all(v >= 0 for v in versions)
            decision = torch.tensor([int(stale), m.version, int(filled)], dtype=torch.int64, device=self.device)
            for r in participants:
                if r != self.rank:
                    dist.send(decision, r, group=self.group)
            return stale, m.version, filled
        if self.rank in layout.ranks:
            mine = torch.tensor([self._copy_version(m, layout)], dtype=torch.int64, device=self.device)
            dist.send(mine, coordinator, group=self.group)
        decision = torch.empty(3, dtype=torch.int64, device=self.device)
        dist.recv(decision, coordinator, group=self.group)
        return bool(decision[0]), int(decision[1]), bool(decision[2])

    @staticmethod
    def _copy_version(m: _Model, layout: Layout) -> int:
        copy = m.copies.get(layout)
        return copy.version if copy is not None else -1

    @staticmethod
    def _reload_home(m: _Model) -> bool:
        """Reload an offloaded home module for a moment; True when it must be offloaded again."""
        if m.offloaded is not None and m.offloaded.offloaded:
            m.offloaded.reload()
            return True
        return False

    def _reshard(self, m: _Model, layout: Layout, version: int, filled: bool) -> None:
        if m.low_rank is not None and m.keep_copies:
            self._push_low_rank(m, layout, version, filled)
            return
        src = dst = None
        reloaded = self._reload_home(m)
        src_layout, dst_layout = _changing_layouts(m, layout) if filled else (m.home, layout)
        partial = dst_layout is not layout
        if m.module is not None:
            src = module_param_tensors(m.module)
            src = _restrict(src, src_layout, self.rank) if partial else src
        if self.rank in layout.ranks:
            dst = module_param_tensors(self._copy_of(m, layout).module)
            dst = _restrict(dst, dst_layout, self.rank) if partial else dst
        plan = self._plan(src_layout, dst_layout)
        self._count(execute_reshard(plan, self.rank, src, dst, dtype=m.dtype, group=self.group))
        self.stats["partial"] += int(partial)
        self._pushed(m, layout, version)
        if reloaded:
            m.offloaded.offload()

    @staticmethod
    def _copy_of(m: _Model, layout: Layout) -> _Copy:
        """This rank's copy of ``layout``, built empty (version -1) when it has none."""
        if layout not in m.copies:
            m.copies[layout] = _Copy(m.factory(layout), -1)  # current once filled
        return m.copies[layout]

    def _pushed(self, m: _Model, layout: Layout, version: int) -> None:
        """Mark this rank's copy of ``layout`` current at ``version`` (a :class:`ParamViews` engine is told)."""
        if self.rank in layout.ranks:
            copy = m.copies[layout]
            copy.version = version
            if not isinstance(copy.module, nn.Module):
                copy.module.weights_updated()

    def _push_low_rank(self, m: _Model, layout: Layout, version: int, filled: bool) -> None:
        """A kept copy of a low-rank home: the base first (its adapted weights into ``W0`` buffers the
        copy keeps) unless every rank's copy was filled before, then the adapters, merged on the copy."""
        home_adapters, copy_adapters = self._adapter_layouts(m, layout)
        in_copy = self.rank in layout.ranks
        copy = self._copy_of(m, layout) if in_copy else None
        tensors = module_param_tensors(copy.module) if in_copy else None
        device = next(iter(tensors.values()))[0].device if tensors else torch.device("cpu")
        if not filled:
            dst = None
            if in_copy:
                copy.base = empty_boxes(layout, self.rank, [u.weight for u in m.low_rank], m.dtype, device)
                dst = {**tensors, **{name: [t] for name, t in copy.base.items()}}
            src = m.module.base_tensors() if m.module is not None else None
            plan = self._plan(m.home, layout)
            self._count(execute_reshard(plan, self.rank, src, dst, dtype=m.dtype, group=self.group))
        elif in_copy and copy.base is None:
            raise RuntimeError(f"rank {self.rank}: a filled copy of a low-rank model holds no base weights")
        adapters = empty_boxes(copy_adapters, self.rank, None, m.dtype, device) if in_copy else None
        src = m.module.adapter_tensors() if m.module is not None else None
        dst = {name: [t] for name, t in adapters.items()} if in_copy else None
        plan = self._plan(home_adapters, copy_adapters)
        self._count(execute_reshard(plan, self.rank, src, dst, dtype=m.dtype, group=self.group))
        self.stats["partial"] += int(filled)
        if in_copy:
            merge_into(m.low_rank, m.home, layout, self.rank, copy.base, adapters, tensors)
        self._pushed(m, layout, version)

    def _adapter_layouts(self, m: _Model, layout: Layout) -> tuple[Layout, Layout]:
        key = (m.home, layout, m.low_rank)
        if key not in self._low_rank_layouts:
            self._low_rank_layouts[key] = adapter_layouts(m.home, layout, m.low_rank)
        return self._low_rank_layouts[key]

    def _count(self, stats: ReshardStats) -> None:
        self.stats["reshards"] += 1
        self.stats["reshard_seconds"] += stats.seconds
        self.stats["sent_bytes"] += stats.sent_bytes
        self.stats["received_bytes"] += stats.received_bytes
        self.stats["sent_intra_host_bytes"] += stats.sent_intra_host_bytes
        self.stats["sent_inter_host_bytes"] += stats.sent_inter_host_bytes
        self.stats["copied_bytes"] += stats.copied_bytes


def _changing_layouts(m: _Model, layout: Layout) -> tuple[Layout, Layout]:
    """``m``'s home and ``layout`` cut down to its ``changing`` parameters; the whole layouts when it
    registered none, or when ``layout`` names them otherwise (a fused layout: every tensor moves)."""
    if m.changing is None or not m.changing <= {p.name for p in layout.params}:
        return m.home, layout

    def cut(lay: Layout) -> Layout:
        return replace(lay, params=tuple(p for p in lay.params if p.name in m.changing))

    return cut(m.home), cut(layout)


def _shared_layouts(src: Layout, dst: Layout, source: str, target: str) -> tuple[Layout, Layout, tuple[str, ...]]:
    """``src`` and ``dst`` cut down to the parameters both hold, and the names only ``dst`` holds."""
    shapes = {p.name: p.shape for p in src.params}
    for p in dst.params:
        if p.name in shapes and shapes[p.name] != p.shape:
            raise ValueError(
                f"cannot copy {source!r} into {target!r}: {p.name} has shape {shapes[p.name]} in the source, "
                f"{p.shape} in the target"
            )
    shared = {p.name for p in dst.params if p.name in shapes}
    if not shared:
        raise ValueError(f"cannot copy {source!r} into {target!r}: the models have no parameter in common")
    kept = tuple(sorted(p.name for p in dst.params if p.name not in shared))

    def cut(layout: Layout) -> Layout:
        return replace(layout, params=tuple(p for p in layout.params if p.name in shared))

    return cut(src), cut(dst), kept


def _restrict(tensors: dict[str, list[torch.Tensor]], layout: Layout, rank: int) -> dict[str, list[torch.Tensor]]:
    """The local tensors of the parameters ``layout`` gives ``rank``."""
    names = layout.boxes(rank)
    return {name: ts for name, ts in tensors.items() if name in names}
