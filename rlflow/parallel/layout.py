"""Parameter layouts: which slice of which parameter every rank of a call holds.

A model under a strategy ``(dp, tp, pp)`` is split three ways, applied in this order:

1. **Pipeline stages.** The model is a sequence of *items* — ``embed``, ``layer.0`` …
   ``layer.{L-1}``, ``norm``, ``head`` — cut into ``pp`` contiguous stages balanced by
   parameter count (:func:`assign_pipeline_stages`). The engine's pipeline split and the
   reshard planner both use :func:`pipeline_stages`, so they always agree.
2. **Tensor parallelism** inside a stage, exactly as ``rlflow.parallel.tensor_parallel.apply_tp``
   splits the HF module, both reading the split of the model's family
   (:meth:`rlflow.families.ModelFamily.tp_kind`): column-parallel modules split dim 0 of the
   weight and of its bias, row-parallel ones dim 1 of the weight (their bias replicated), the
   embedding is vocabulary-parallel (dim 0), norms replicated. Shards follow ``torch.chunk``
   sizes. The family's kv modules are replicated when ``num_key_value_heads`` does not divide
   by tp (the layout describes it even where an engine refuses it).
3. **FSDP2** (training layouts only) shards the tp-local tensor along dim 0 over the dp
   ranks with ``torch.chunk`` sizes; ranks past the last chunk hold an empty shard.

A vLLM rollout splits some parameters otherwise (a padded vocabulary, kv heads replicated over
tp ranks): ``build_layout(..., style="vllm")`` describes the slices of the HF parameters a vLLM
rank holds, so that a reshard moves exactly those (:mod:`rlflow.parallel.vllm_layout`).

Parameter names and shapes, and the module paths of the items, are those of the model's family
(:mod:`rlflow.families`). Value models (critics, reward models: ``*ForTokenClassification``)
pass ``head="value"``: their head item is the value head (``num_labels`` outputs), replicated
under tp.

Tied embeddings: the model has one tensor, named by the embedding here (HF's LM-head weight is
the same tensor). The ``head`` item counts it again, because
under pipeline parallelism the first stage (embedding) and the last stage (LM head) both
hold a copy of it; with ``pp == 1`` the copies are one tensor. Keeping the two copies
equal (summing their gradients) is the training engine's job.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from rlflow.families import ModelFamily, family_of
from rlflow.strategy import ParallelStrategy, RankCoords

# A box is a rectangular slice of a full parameter: one half-open [start, stop) per tensor dim.
Box = tuple[tuple[int, int], ...]


def layer_param_shapes(config: Any, layer: int) -> dict[str, tuple[int, ...]]:
    """Names (full HF names) and shapes of the parameters of decoder layer ``layer``.

    Args:
        config: an HF decoder config of a registered family (:func:`rlflow.families.family_of`).
        layer: layer index in ``[0, num_hidden_layers)``.

    Returns:
        ``{name: shape}`` in module registration order.
    """
    return family_of(config).layer_param_shapes(config, layer)


def item_param_shapes(config: Any, head: str = "lm") -> list[tuple[str, dict[str, tuple[int, ...]]]]:
    """The pipeline items of a decoder and the parameters each holds.

    Args:
        config: HF decoder config of a registered family.
        head: ``"lm"`` for ``*ForCausalLM`` (``lm_head``), ``"value"`` for a critic/reward
            ``*ForTokenClassification`` (``score``, ``config.num_labels`` outputs).

    Returns:
        ``[(item, {param_name: shape})]`` for ``embed``, ``layer.0`` … ``layer.{L-1}``,
        ``norm``, ``head``. With tied embeddings the ``head`` item holds the embedding weight
        (the tied tensor) instead of the LM head's.
    """
    return family_of(config).item_param_shapes(config, head)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def pipeline_items(config: Any, head: str = "lm") -> list[tuple[str, int]]:
    """Pipeline items of an HF decoder config with their parameter counts.

    Args:
        config: an HF decoder config of a registered family; no weights needed.
        head: ``"lm"`` (causal LM) or ``"value"`` (scalar ``score`` head of a critic/reward model).

    Returns:
        ``[("embed", n), ("layer.0", n), …, ("norm", n), ("head", n)]``; ``n`` is a number
        of parameters (elements). The head counts the tied embedding as well, because the
        last pipeline stage holds a copy of it.

    >>> from transformers import LlamaConfig
    >>> items = pipeline_items(LlamaConfig(num_hidden_layers=2))
    >>> [name for name, _ in items], items[0][1]
    (['embed', 'layer.0', 'layer.1', 'norm', 'head'], 131072000)
    """
    return [(item, sum(_numel(s) for s in shapes.values())) for item, shapes in item_param_shapes(config, head)]


def assign_pipeline_stages(item_numels: Sequence[int], pp: int) -> list[range]:
    """Cut a sequence of items into ``pp`` contiguous, non-empty stages balanced by size.

    The stages minimise the largest stage; among those, the sum of squared stage sizes
    (so the other stages are balanced too); remaining ties go to the earliest cuts. The
    result is a deterministic function of the input.

    Args:
        item_numels: size (parameter count) of every item, in model order; each >= 0.
        pp: number of pipeline stages, ``1 <= pp <= len(item_numels)``.

    Returns:
        ``pp`` ranges of item indices covering ``range(len(item_numels))`` in order.

    >>> assign_pipeline_stages([4, 1, 1, 1, 1, 4], 2)
    [range(0, 3), range(3, 6)]
    """
    n = len(item_numels)
    if pp < 1:
        raise ValueError(f"pp={pp} must be >= 1")
    if pp > n:
        raise ValueError(f"pp={pp} exceeds the number of pipeline items ({n}); every stage needs one item")
    if any(x < 0 for x in item_numels):
        raise ValueError(f"item sizes must be >= 0, got {list(item_numels)}")
    prefix = [0]
    for x in item_numels:
        prefix.append(prefix[-1] + int(x))
    inf = (float("inf"), float("inf"))
    # best[k][j]: (max stage, sum of squares) of items[:j] cut into k stages; cut[k][j]: start of the k-th stage.
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = (0, 0)
    for k in range(1, pp + 1):
        # The k-th stage ends at j and leaves at least one item for each of the pp-k later stages.
        for j in range(k, n - (pp - k) + 1):
            for i in range(k - 1, j):
                prev = best[k - 1][i]
                if prev is inf:
                    continue
                size = prefix[j] - prefix[i]
                cand = (max(prev[0], size), prev[1] + size * size)
                if cand < best[k][j]:
                    best[k][j], cut[k][j] = cand, i
    bounds, j = [], n
    for k in range(pp, 0, -1):
        i = cut[k][j]
        bounds.append(range(i, j))
        j = i
    return bounds[::-1]


def pipeline_stages(config: Any, pp: int, head: str = "lm") -> list[list[str]]:
    """Items of every pipeline stage for ``pp`` stages of the decoder ``config``.

    ``head`` is ``"lm"`` or ``"value"`` as in :func:`pipeline_items`; the engine and the
    layouts must pass the same value, since the head's size moves the cuts.

    The ReaLHF paper counts 34 items for LLaMA-2-7B (its head includes the final norm); here
    the norm is an item of its own (35 items), which moves no cut: with ``pp=2`` the first
    stage is the embedding and layers 0-15 either way ("after item 17").

    >>> from transformers import LlamaConfig
    >>> stages = pipeline_stages(LlamaConfig(), 2)  # LLaMA-2-7B: cut after item 17 of 34
    >>> stages[0][-1], stages[1][0]
    ('layer.15', 'layer.16')
    """
    blocker = family_of(config).pp_blocker
    if pp > 1 and blocker is not None:
        raise ValueError(f"pp={pp}: {blocker}")
    items = pipeline_items(config, head)
    ranges = assign_pipeline_stages([n for _, n in items], pp)
    return [[items[i][0] for i in r] for r in ranges]


# ---------------------------------------------------------------------------------------------
# Parameters and their tensor-parallel split
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the full model and how tensor parallelism splits it.

    Attributes:
        name: HF parameter name; a tied LM head is the embedding's name.
        shape: full (unsharded) shape.
        items: pipeline items holding it; two for a tied embedding (``("embed", "head")``).
        tp_dim: tensor dim split over the tp ranks with ``torch.chunk`` sizes; ``None`` when
            replicated.
        tp_bounds: ``[start, stop)`` along ``tp_dim`` of every tp rank, for a split that is not
            ``torch.chunk``'s (vLLM's: padded vocabulary shards, kv heads replicated over tp
            ranks; see :mod:`rlflow.parallel.vllm_layout`); ``None`` uses ``torch.chunk`` sizes.
    """

    name: str
    shape: tuple[int, ...]
    items: tuple[str, ...]
    tp_dim: int | None
    tp_bounds: tuple[tuple[int, int], ...] | None = None

    @property
    def numel(self) -> int:
        return _numel(self.shape)


def _tp_dim(family: ModelFamily, name: str, kv_split: bool) -> int | None:
    """The tensor dim ``apply_tp`` shards parameter ``name`` along, or ``None`` when it is replicated.

    ``kv_split``: tp divides the kv heads (else the family's kv modules are replicated).
    """
    module, _, leaf = name.rpartition(".")
    kind = family.tp_kind(module)
    if not kv_split and family.is_kv_module(module):
        return None  # kv heads cannot be split evenly: every tp rank keeps all of them
    if kind in ("vocab", "colwise"):
        return 0  # vocabulary rows; output features of a column-parallel linear (weight and bias)
    if kind == "rowwise" and leaf == "weight":
        return 1  # a row-parallel bias is added after the reduction and stays replicated
    return None


def model_param_specs(config: Any, tp: int = 1, head: str = "lm") -> tuple[ParamSpec, ...]:
    """Every parameter of the decoder ``config`` with its tensor-parallel split under ``tp``.

    Args:
        config: HF decoder config of a registered family.
        tp: tensor-parallel degree; must divide ``num_attention_heads``.
        head: ``"lm"`` or ``"value"`` (the value head ``score`` is replicated).

    Returns:
        Parameters in model order; a tied embedding appears once, with items ``("embed", "head")``.
    """
    family = family_of(config)
    dims = family.dims(config)
    if tp < 1 or dims.num_heads % tp != 0:
        raise ValueError(f"tp={tp} does not divide num_attention_heads={dims.num_heads}")
    if tp > 1 and family.tp_blocker is not None:
        raise ValueError(f"tp={tp}: {family.tp_blocker}")
    kv_split = dims.num_kv_heads % tp == 0
    specs: dict[str, ParamSpec] = {}
    for item, shapes in family.item_param_shapes(config, head):
        for name, shape in shapes.items():
            if name in specs:  # the tied embedding, seen again as the head
                old = specs[name]
                specs[name] = ParamSpec(name, old.shape, (*old.items, item), old.tp_dim)
            else:
                specs[name] = ParamSpec(name, tuple(shape), (item,), _tp_dim(family, name, kv_split))
    return tuple(specs.values())


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` when ``torch.chunk`` splits ``size`` into ``parts``.

    Chunks have ``ceil(size / parts)`` elements; trailing indices past the last chunk get an
    empty range — the rule of DTensor ``Shard`` and of FSDP2.

    >>> [chunk_bounds(5, 4, i) for i in range(4)]
    [(0, 2), (2, 4), (4, 5), (5, 5)]
    """
    step = -(-size // parts)
    start = min(index * step, size)
    return start, min(start + step, size)


# ---------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Where every slice of a model lives for one call: strategy × global ranks (× FSDP).

    Rank ``ranks[r]`` has call rank ``r`` and coordinates ``strategy.coords(r)`` =
    ``(pp_rank, dp_rank, tp_rank)``. It holds the parameters of the items of stage
    ``pp_rank``, split by tp, and — when ``fsdp`` — further sharded along dim 0 of the
    tp-local tensor over the dp ranks (FSDP2's ``torch.chunk`` rule; later ranks may hold
    empty shards). Without ``fsdp`` the dp ranks are replicas.

    Build one with :func:`build_layout`.
    """

    params: tuple[ParamSpec, ...]
    stages: tuple[tuple[str, ...], ...]
    strategy: ParallelStrategy
    ranks: tuple[int, ...]
    fsdp: bool = False

    def __post_init__(self) -> None:
        if len(self.ranks) != self.strategy.world_size:
            raise ValueError(f"{len(self.ranks)} ranks {self.ranks} do not match {self.strategy}")
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"ranks {self.ranks} repeat a rank")
        if len(self.stages) != self.strategy.pp:
            raise ValueError(f"{len(self.stages)} pipeline stages do not match pp={self.strategy.pp}")
        for p in self.params:
            if p.tp_bounds is not None and len(p.tp_bounds) != self.strategy.tp:
                raise ValueError(f"{p.name}: {len(p.tp_bounds)} tp_bounds do not match tp={self.strategy.tp}")

    @cached_property
    def _call_rank(self) -> dict[int, int]:
        return {g: r for r, g in enumerate(self.ranks)}

    @cached_property
    def _stage_params(self) -> tuple[tuple[ParamSpec, ...], ...]:
        stage_of = {item: s for s, items in enumerate(self.stages) for item in items}
        return tuple(
            tuple(p for p in self.params if any(stage_of[i] == s for i in p.items)) for s in range(len(self.stages))
        )

    @cached_property
    def _boxes(self) -> dict[int, dict[str, Box]]:
        return {g: self._compute_boxes(r) for g, r in self._call_rank.items()}

    def call_rank(self, rank: int) -> int:
        """Rank inside the call of global rank ``rank``."""
        if rank not in self._call_rank:
            raise ValueError(f"global rank {rank} is not in this layout's ranks {self.ranks}")
        return self._call_rank[rank]

    def coords(self, rank: int) -> RankCoords:
        """``(pp_rank, dp_rank, tp_rank)`` of global rank ``rank``."""
        return self.strategy.coords(self.call_rank(rank))

    def stage_params(self, pp_rank: int) -> tuple[ParamSpec, ...]:
        """Parameters held by pipeline stage ``pp_rank`` (a tied embedding by the first and last)."""
        return self._stage_params[pp_rank]

    def boxes(self, rank: int) -> dict[str, Box]:
        """``{param name: box of the full tensor}`` held by global rank ``rank`` (empty boxes included)."""
        self.call_rank(rank)
        return self._boxes[rank]

    def slices(self, rank: int) -> dict[str, tuple[slice, ...]]:
        """``{param name: slices of the full tensor}`` held by global rank ``rank``.

        ``full[slices[name]]`` equals the rank's local tensor (``DTensor.to_local()`` under
        tp/FSDP2), with the shape :meth:`local_shape` gives.
        """
        return {name: tuple(slice(a, b) for a, b in box) for name, box in self.boxes(rank).items()}

    def local_shape(self, rank: int, name: str) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.boxes(rank)[name])

    def local_numel(self, rank: int) -> int:
        """Elements of all parameters held by global rank ``rank``."""
        return sum(_numel(self.local_shape(rank, n)) for n in self.boxes(rank))

    def holders(self, name: str) -> list[tuple[Box, tuple[int, ...]]]:
        """Every distinct non-empty box of parameter ``name`` and the global ranks holding it (sorted).

        Parameters with the same shape, split and stages share one (read-only) list object.
        """
        return self._holders[name]

    @cached_property
    def _holders(self) -> dict[str, list[tuple[Box, tuple[int, ...]]]]:
        # Built from coordinates rather than by comparing the boxes of all ranks: a box depends
        # only on (tp_rank if split, dp_rank if FSDP); the other coordinates hold copies. Most
        # parameters repeat per layer, so results are shared by (shape, tp_dim, stages).
        pp, dp, tp = self.strategy.pp, self.strategy.dp, self.strategy.tp
        stages: dict[str, list[int]] = {p.name: [] for p in self.params}
        for s in range(pp):
            for spec in self._stage_params[s]:
                stages[spec.name].append(s)
        shared: dict[tuple, list[tuple[Box, tuple[int, ...]]]] = {}
        out = {}
        for spec in self.params:
            key = (spec.shape, spec.tp_dim, spec.tp_bounds, tuple(stages[spec.name]))
            if key not in shared:
                # Several tp ranks may hold one box (vLLM replicates a kv head over tp ranks).
                found: dict[Box, list[int]] = {}
                for t in range(tp) if spec.tp_dim is not None else [None]:
                    for d in range(dp) if self.fsdp else [None]:
                        box = self._box(spec, d or 0, t or 0)
                        if all(b > a for a, b in box):
                            found.setdefault(box, []).extend(
                                self.ranks[self.strategy.rank_of(s, dd, tt)]
                                for s in key[3]
                                for dd in (range(dp) if d is None else (d,))
                                for tt in (range(tp) if t is None else (t,))
                            )
                shared[key] = [(box, tuple(sorted(ranks))) for box, ranks in found.items()]
            out[spec.name] = shared[key]
        return out

    def _box(self, spec: ParamSpec, dp_rank: int, tp_rank: int) -> Box:
        box = [(0, n) for n in spec.shape]
        if spec.tp_bounds is not None:
            box[spec.tp_dim] = spec.tp_bounds[tp_rank]
        elif spec.tp_dim is not None:
            box[spec.tp_dim] = chunk_bounds(spec.shape[spec.tp_dim], self.strategy.tp, tp_rank)
        if self.fsdp and box:
            start, stop = box[0]
            lo, hi = chunk_bounds(stop - start, self.strategy.dp, dp_rank)
            box[0] = (start + lo, start + hi)
        return tuple(box)

    def _compute_boxes(self, call_rank: int) -> dict[str, Box]:
        pp_rank, dp_rank, tp_rank = self.strategy.coords(call_rank)
        return {spec.name: self._box(spec, dp_rank, tp_rank) for spec in self._stage_params[pp_rank]}


LAYOUT_STYLES = ("hf", "vllm")


def build_layout(
    config: Any,
    strategy: ParallelStrategy,
    ranks: Sequence[int],
    fsdp: bool = False,
    head: str = "lm",
    style: str = "hf",
) -> Layout:
    """The layout of decoder ``config`` under ``strategy`` on global ``ranks`` (call order).

    Args:
        config: HF decoder config.
        strategy: ``(dp, tp, pp)`` with ``dp*tp*pp == len(ranks)``.
        ranks: global ranks of the call, in call-rank order.
        fsdp: shard every tp-local tensor along dim 0 over dp (FSDP2 training layout);
            otherwise dp ranks hold replicas.
        head: ``"lm"`` (causal LM) or ``"value"`` (critic/reward ``score`` head).
        style: ``"hf"``: the tensor-parallel split of ``apply_tp`` (module docstring);
            ``"vllm"``: the slices of the HF parameters a vLLM rank holds
            (:func:`rlflow.parallel.vllm_layout.vllm_param_specs`; pp = 1, no FSDP, ``head="lm"``).

    >>> from transformers import LlamaConfig
    >>> cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
    ...                   num_attention_heads=4, num_key_value_heads=2)
    >>> layout = build_layout(cfg, ParallelStrategy(dp=2, tp=2), ranks=[4, 5, 6, 7], fsdp=True)
    >>> layout.slices(7)["model.layers.0.self_attn.o_proj.weight"]  # dp_rank 1, tp_rank 1
    (slice(32, 64, None), slice(32, 64, None))
    """
    stages = tuple(tuple(s) for s in pipeline_stages(config, strategy.pp, head))
    if style == "hf":
        specs = model_param_specs(config, strategy.tp, head)
    elif style == "vllm":
        if strategy.pp != 1 or fsdp or head != "lm":
            raise ValueError(
                f"style='vllm' describes a vLLM rollout: pp=1, no FSDP, head='lm'; got pp={strategy.pp}, "
                f"fsdp={fsdp}, head={head!r}"
            )
        from rlflow.parallel.vllm_layout import vllm_param_specs  # it builds on this module

        specs = vllm_param_specs(config, strategy.tp)
    else:
        raise ValueError(f"style={style!r}; expected one of {LAYOUT_STYLES}")
    return Layout(specs, stages, strategy, tuple(int(r) for r in ranks), fsdp)
