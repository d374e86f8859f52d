"""What a model worker is told at construction: models, calls, layouts, algorithm and sampling.

The driver builds one :class:`WorkerSetup` from its config and plan and hands the same object
to every worker of the pool. These are plain frozen dataclasses, validated on construction,
so that a worker never imports ``rlflow.trainer`` and a bad plan fails on the driver, before
any process starts.

Placement rules the worker follows (see :mod:`rlflow.workers.model_worker`):

* the **home layout** of a trainable model is the layout of its ``train_step`` MFCs (all on
  one layout); the training engine and its optimizer state live there for the whole run;
* a frozen model's home is the layout of its first MFC; when all its calls share that layout
  it stays resident there, otherwise it rests offloaded to host memory between calls;
* a call on another layout than home — and every ``generate`` call, whose rollout engine
  needs its weights in its own ``layout_style`` — runs on a copy resharded from home
  (:meth:`WorkerSetup.hook_ranks` says which ranks take part);
* ``generate`` layouts follow the rollout engine's declared capabilities
  (:class:`~rlflow.engine.rollout.RolloutCapabilities`): its parallel axes; every worker when
  it ``spans_world`` (vLLM builds its groups over the whole world); one layout for every
  ``generate`` call when it has a ``shared_layout`` (one instance per process).

>>> from rlflow.strategy import ParallelStrategy, RankCoords
>>> CallLayout((0, 1), ParallelStrategy(dp=2)).local_coords(1)
RankCoords(pp=0, dp=1, tp=0)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlflow.algos.params import AlgorithmParams
from rlflow.dataflow.mfc import PAIR_OBJECTIVES, MFCDef
from rlflow.engine.lora import LoraSpec
from rlflow.engine.optim import OptimConfig
from rlflow.engine.rollout import SamplingParams, get_rollout_engine, list_rollout_engines
from rlflow.strategy import ParallelStrategy, RankCoords
from rlflow.workers.environments import MultiTurnSetup
from rlflow.workers.reward_errors import REWARD_ERROR_POLICIES

if TYPE_CHECKING:
    from rlflow.workers.reward_funcs import RewardFuncs

__all__ = ["COMPUTE_DTYPES", "MODEL_ROLES", "PARAM_DTYPE", "CallLayout", "ModelSetup", "WorkerSetup"]

MODEL_ROLES = ("actor", "critic", "ref", "reward", "teacher")

# Master weights, copies and the reshard wire format are fp32 (the engines' compute dtype is separate).
# Here, not in rlflow.workers.residency, so that the driver reads it without the engines' imports.
PARAM_DTYPE = torch.float32
# What a model may compute in (ModelSetup.compute_dtype): the resolved choices of models.<role>.dtype.
COMPUTE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class CallLayout:
    """Where one MFC runs: global ranks in call-rank order, arranged as ``strategy``.

    Call rank ``r`` is the worker ``ranks[r]``; its coordinates are ``strategy.coords(r)``
    (``rank = (pp_rank*dp + dp_rank)*tp + tp_rank``, see ``rlflow.strategy``).
    """

    ranks: tuple[int, ...]
    strategy: ParallelStrategy

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        if len(self.ranks) != self.strategy.world_size:
            raise ValueError(f"CallLayout: {len(self.ranks)} ranks {self.ranks} do not match {self.strategy}")
        if len(set(self.ranks)) != len(self.ranks) or min(self.ranks) < 0:
            raise ValueError(f"CallLayout: ranks {self.ranks} must be distinct non-negative global ranks")

    def local_coords(self, global_rank: int) -> RankCoords | None:
        """The coordinates of ``global_rank`` in the call, or ``None`` when it is not in the call."""
        if global_rank not in self.ranks:
            return None
        return self.strategy.coords(self.ranks.index(global_rank))


@dataclass(frozen=True)
class ModelSetup:
    """One named model.

    Args:
        name: the model name MFCs refer to (``MFCDef.model_name``).
        role: ``"actor"``, ``"critic"``, ``"ref"``, ``"reward"`` or ``"teacher"``; selects the interface.
        path: local HF directory (a causal LM, or a value model when ``value_head``); ``None``
            only for a rule-based reward.
        trainable: the model has a ``train_step`` MFC and an optimizer.
        optim: optimizer settings of a trainable model.
        gradient_checkpointing: recompute layer activations in backward.
        shared_prefix: rows that share a prompt may run it once (``EngineConfig.shared_prefix``).
        fused_cpu_ops: RMSNorms, SwiGLU, RoPE and causal attention run as fused C++ passes on a CPU
            (``EngineConfig.fused_cpu_ops``).
        max_tokens_per_micro_batch: token budget of one micro-batch; ``None`` uses the MFC's
            ``n_mbs`` micro-batches (one when unset).
        reward_fn: rule-based reward name (``rlflow.workers.rewards`` registry) or Python reward
            functions (``rlflow.workers.reward_funcs.RewardFuncs``); role ``reward`` with ``path=None``.
        reward_errors: what a sample whose ``reward_fn`` raises scores: ``raise``, ``zero`` or
            ``skip`` (:mod:`rlflow.workers.reward_errors`).
        value_head: the model is ``AutoModelForTokenClassification`` with one label (critic,
            reward model); a causal-LM ``path`` then gets a fresh zero-initialised head.
        compute_dtype: what its forwards, backwards and generations compute in: ``torch.float32``
            or ``torch.bfloat16`` (``models.<role>.dtype``, ``auto`` resolved by the driver so that
            every worker of a run computes alike). Master weights, gradients' reduction and
            optimizer state stay in :data:`PARAM_DTYPE` either way.
        lora: a trainable causal LM's low-rank adapters (:mod:`rlflow.engine.lora`): only they
            train, at its home; ``None`` trains every weight.
        router_aux_loss_coef: weight of a mixture-of-experts model's router loss in training
            (:mod:`rlflow.engine.router_loss`); ``None``: its config's; 0: off.
    """

    name: str
    role: str
    path: str | None
    trainable: bool = False
    optim: OptimConfig | None = None
    gradient_checkpointing: bool = False
    shared_prefix: bool = True
    fused_cpu_ops: bool = True
    max_tokens_per_micro_batch: int | None = None
    reward_fn: str | RewardFuncs | None = None
    reward_errors: str = "raise"
    value_head: bool = False
    compute_dtype: torch.dtype = torch.float32
    lora: LoraSpec | None = None
    router_aux_loss_coef: float | None = None

    def __post_init__(self) -> None:
        where = f"model {self.name!r}"
        if self.lora is not None and (not self.trainable or self.value_head):
            raise ValueError(f"{where}: lora needs a trainable causal LM (trainable=True, value_head=False)")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"{where}: compute_dtype={self.compute_dtype}, expected one of {COMPUTE_DTYPES}")
        if self.role not in MODEL_ROLES:
            raise ValueError(f"{where}: role={self.role!r}, expected one of {MODEL_ROLES}")
        if self.reward_fn is not None and (self.role != "reward" or self.path is not None):
            raise ValueError(f"{where}: reward_fn={self.reward_fn!r} needs role 'reward' and path=None")
        if self.reward_errors not in REWARD_ERROR_POLICIES:
            raise ValueError(f"{where}: reward_errors={self.reward_errors!r}, expected one of {REWARD_ERROR_POLICIES}")
        if self.path is None and self.reward_fn is None:
            raise ValueError(f"{where}: path=None is only allowed for a rule-based reward (give reward_fn)")
        if self.trainable and self.role == "teacher":
            raise ValueError(f"{where}: the distillation teacher is frozen; trainable must be False")
        if self.trainable and (self.optim is None or self.path is None):
            raise ValueError(f"{where}: a trainable model needs a path and optim settings")
        if self.role == "critic" and not self.value_head:
            raise ValueError(f"{where}: a critic needs value_head=True")
        if self.role in ("actor", "ref", "teacher") and self.value_head:
            raise ValueError(f"{where}: role {self.role!r} is a causal LM; value_head must be False")
        if self.role == "reward" and self.path is not None and not self.value_head:
            raise ValueError(f"{where}: a reward model needs value_head=True")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ValueError(f"{where}: max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} must be >= 1")

    @property
    def rule_based(self) -> bool:
        return self.reward_fn is not None


@dataclass(frozen=True)
class WorkerSetup:
    """Everything a :class:`~rlflow.workers.model_worker.ModelWorker` needs; identical on every worker.

    Args:
        models: model name -> :class:`ModelSetup`.
        mfcs: MFC name -> :class:`~rlflow.dataflow.MFCDef` (every call the driver will issue).
        layouts: MFC name -> :class:`CallLayout`.
        algo: the algorithm's hyper-parameters; stored resolved (:meth:`AlgorithmParams.resolved`:
            the estimator and the KL placement of a null field are the algorithm's defaults).
        sampling: rollout sampling parameters (``n`` = samples per prompt).
        eval_sampling: sampling parameters of held-out evaluation.
        tokenizer_path: local tokenizer directory (rule-based rewards decode with it).
        seed: base seed of model initialisation and sampling.
        keep_copies: the models whose copies (on layouts other than home, and every rollout
            copy) are kept between calls instead of freed: a kept copy is resharded only when
            its home weights changed since it was made (an optimizer step, an EMA blend, a
            weight copy). The driver decides it (``placement.keep_copies``: the planner's memory
            model, or the config); kept copies are static device memory for the whole step.
        rollout_engine: a registered rollout engine (:func:`~rlflow.engine.rollout.list_rollout_engines`):
            ``"hf"`` (built-in sampler on a tensor-parallel HF copy), ``"vllm"``, or one a user
            registered; its declarations decide how workers build, keep and feed it.
        rollout_memory_fraction: the share of each device's memory a rollout engine that
            ``holds_memory_fraction`` (vLLM's ``gpu_memory_utilization``) takes while it generates.
        log_level: the level of the worker's ``rlflow`` logger (``logging.level``).
        multi_turn: the actor's rollouts are episodes of this environment (``rollout.multi_turn``);
            None: one response per prompt.
    """

    models: Mapping[str, ModelSetup]
    mfcs: Mapping[str, MFCDef]
    layouts: Mapping[str, CallLayout]
    algo: AlgorithmParams
    sampling: SamplingParams
    eval_sampling: SamplingParams
    tokenizer_path: str
    seed: int = 0
    keep_copies: tuple[str, ...] = ()
    rollout_engine: str = "hf"
    rollout_memory_fraction: float = 0.5
    log_level: str = "info"
    multi_turn: MultiTurnSetup | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", dict(self.models))
        object.__setattr__(self, "mfcs", dict(self.mfcs))
        object.__setattr__(self, "layouts", dict(self.layouts))
        object.__setattr__(self, "algo", self.algo.resolved())
        if isinstance(self.keep_copies, (str, bool)):
            raise TypeError(f"keep_copies={self.keep_copies!r}; expected a tuple of model names")
        object.__setattr__(self, "keep_copies", tuple(self.keep_copies))
        for name, model in self.models.items():
            if model.name != name:
                raise ValueError(f"models[{name!r}] is named {model.name!r}")
        for name, mfc in self.mfcs.items():
            self._check_mfc(name, mfc)
        weighted = sorted(n for n, m in self.models.items() if not m.rule_based)
        for name in self.keep_copies:
            if name not in weighted:
                raise ValueError(f"keep_copies names {name!r}; expected models with weights among {weighted}")
        for name, model in self.models.items():
            trains = [m.name for m in self.mfcs.values() if m.model_name == name and m.is_train]
            if len({self.layouts[t] for t in trains}) > 1:
                raise ValueError(f"model {name!r} trains on several layouts ({trains}); its train_step MFCs need one")
            if trains and not model.trainable:
                raise ValueError(f"model {name!r} is not trainable but MFC {trains[0]!r} trains it")
            if model.trainable and not trains:
                raise ValueError(f"model {name!r} is trainable but no train_step MFC gives it a home layout")
        for name, mfc in self.mfcs.items():
            self._check_placement(name, mfc)
        self._check_rollout_engine()

    def _check_mfc(self, name: str, mfc: MFCDef) -> None:
        if mfc.name != name:
            raise ValueError(f"mfcs[{name!r}] is named {mfc.name!r}")
        if mfc.model_name not in self.models:
            raise ValueError(f"MFC {name!r} runs on model {mfc.model_name!r}, not in models {sorted(self.models)}")
        if name not in self.layouts:
            raise ValueError(f"MFC {name!r} has no layout; layouts cover {sorted(self.layouts)}")
        for source in mfc.hook_sources:
            if source not in self.models or not self.models[source].trainable:
                raise ValueError(f"MFC {name!r}: hook source {source!r} must be a trainable model in models")

    def _check_placement(self, name: str, mfc: MFCDef) -> None:
        model = self.models[mfc.model_name]
        if model.rule_based and mfc.interface_type != "inference":
            raise ValueError(f"MFC {name!r}: the rule-based reward {model.name!r} only serves inference calls")
        if mfc.hook_sources and (model.trainable or model.rule_based):
            raise ValueError(f"MFC {name!r}: hooks blend weights into {model.name!r}, which must be a frozen model")
        if mfc.objective in PAIR_OBJECTIVES:
            if (mfc.n_mbs or 1) > 1 or model.max_tokens_per_micro_batch is not None:
                raise ValueError(
                    f"MFC {name!r}: {mfc.objective} pairs must stay in one micro-batch; got n_mbs={mfc.n_mbs}, "
                    f"max_tokens_per_micro_batch={model.max_tokens_per_micro_batch}"
                )

    def _check_rollout_engine(self) -> None:
        """Generate layouts against the declared capabilities of the rollout engine."""
        if self.rollout_engine not in list_rollout_engines():
            raise ValueError(f"rollout_engine={self.rollout_engine!r}; expected one of {list_rollout_engines()}")
        caps = get_rollout_engine(self.rollout_engine).capabilities
        world = tuple(sorted({r for layout in self.layouts.values() for r in layout.ranks}))
        generate = {n: self.layouts[n] for n, m in self.mfcs.items() if m.interface_type == "generate"}
        for name, layout in generate.items():
            why = caps.unsupported(layout.strategy)
            if why is not None:
                raise ValueError(f"MFC {name!r}: the {self.rollout_engine!r} rollout engine cannot generate with {why}")
            if caps.spans_world and tuple(sorted(layout.ranks)) != world:
                raise ValueError(
                    f"MFC {name!r}: the {self.rollout_engine!r} rollout engine generates on every worker {world}, "
                    f"got ranks {layout.ranks}"
                )
        if caps.shared_layout and len(set(generate.values())) > 1:
            strategies = {n: f"{c.strategy} on {c.ranks}" for n, c in generate.items()}
            raise ValueError(
                f"the {self.rollout_engine!r} rollout engine runs one instance per process, so every generate MFC "
                f"needs one layout; they differ: {strategies}"
            )

    # ------------------------------------------------------------------ placement rules
    def model_mfcs(self, model_name: str) -> list[MFCDef]:
        """The MFCs that run on ``model_name``, in declaration order."""
        return [m for m in self.mfcs.values() if m.model_name == model_name]

    def home_layout(self, model_name: str) -> CallLayout | None:
        """Where a model's weights live between calls.

        The layout of its ``train_step`` for a trainable model, else the layout of its first
        MFC; ``None`` for a rule-based reward (no weights).
        """
        if self.models[model_name].rule_based:
            return None
        mfcs = self.model_mfcs(model_name)
        train = [m for m in mfcs if m.is_train]
        return self.layouts[(train or mfcs)[0].name] if mfcs else None

    def offloads_home(self, model_name: str) -> bool:
        """A frozen model used on several layouts rests in host memory between its calls."""
        model = self.models[model_name]
        if model.trainable or model.rule_based:
            return False
        return len({self.layouts[m.name] for m in self.model_mfcs(model_name)}) > 1

    def uses_home(self, mfc_name: str) -> bool:
        """The call runs on the model's home engine (same layout, not a rollout); else on a copy."""
        mfc = self.mfcs[mfc_name]
        return mfc.interface_type != "generate" and self.layouts[mfc_name] == self.home_layout(mfc.model_name)

    def hook_ranks(self, mfc_name: str) -> tuple[int, ...]:
        """Global ranks that must run ``pre_call`` / ``post_call`` of ``mfc_name``; empty when it needs none.

        * a call on a copy (any ``generate``, or a layout other than home): home ∪ call ranks,
          which take part in the reshard;
        * a call on the home of a model that rests offloaded: the home ranks (reload, offload);
        * each ``ParamReallocHook``: the source's and the target's home ranks (the blend runs
          in the target's home layout).
        """
        mfc, layout = self.mfcs[mfc_name], self.layouts[mfc_name]
        home = self.home_layout(mfc.model_name)
        ranks: set[int] = set()
        if home is not None and not self.uses_home(mfc_name):
            ranks |= set(home.ranks) | set(layout.ranks)
        elif home is not None and self.offloads_home(mfc.model_name):
            ranks |= set(home.ranks)
        for source in mfc.hook_sources:
            ranks |= set(self.home_layout(source).ranks) | set(home.ranks)
        return tuple(sorted(ranks))
