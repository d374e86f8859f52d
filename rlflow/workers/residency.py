"""Where each model's weights live in one worker process: engines, copies, and the reallocation manager.

This is the worker side of "Placement and reallocation" (``docs/architecture.md``). Moving
weights is :class:`~rlflow.parallel.realloc.ReallocManager`'s job (versions, staleness,
reshards, offload, EMA); this module builds the engines around the modules it manages:

* every model with weights is registered with its **home** layout (:meth:`WorkerSetup.home_layout`):
  a :class:`~rlflow.engine.train_engine.TrainEngine` (with optimizer for a trainable model)
  whose pipeline stage is the home module. A frozen model used on several layouts is
  registered ``offload_home`` and rests in host memory between calls;
* a call off home runs on a **copy** the manager builds with this module's factory: a
  ``TrainEngine`` stage for a forward (FSDP layout), or for a rollout the engine registered as
  ``WorkerSetup.rollout_engine``, built by its ``build()``; the manager writes the home weights
  into its ``weight_target()`` (a tensor-parallel HF model for the built-in sampler, views into
  vLLM's own fused parameters for vLLM) on the layout of its ``layout_style``, in the model's
  compute dtype (``ModelSetup.compute_dtype``; forward copies keep fp32 masters). What happens
  between calls follows the engine's declarations (:class:`~rlflow.engine.rollout.RolloutEngine`),
  never its name: a ``per_call`` engine is freed after its call unless the model is in
  ``WorkerSetup.keep_copies``; a ``per_process`` one is kept, and one that ``can_sleep`` sleeps
  between its calls so that colocated training gets the device memory back;
* a kept copy (``WorkerSetup.keep_copies``) carries the home version it was made from: the
  pre-hook moves no weights while it is current (a second rollout in one step, an evaluation
  rollout with no train step since, a frozen model's copy) and reshards after a train step;
* ``ParamReallocHook(source, eta)`` runs :meth:`ReallocManager.ema_update` on the target;
  :meth:`Residency.copy_weights` (``init: copy`` models when RL starts) runs
  :meth:`ReallocManager.copy_weights`.

:meth:`Residency.prepare` / :meth:`Residency.release` are the MFC pre/post hooks; a rank not in
``WorkerSetup.hook_ranks(mfc)`` returns at once, and every rank in it takes part.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoConfig, PretrainedConfig

from rlflow.dataflow.mfc import MFCDef
from rlflow.engine.loading import build_meta_model, init_buffers, sharded_model
from rlflow.engine.lora import MergedViews, adapted_weight_names, low_rank_updates
from rlflow.engine.models import build_value_model, init_value_model_from_lm, load_causal_lm
from rlflow.engine.optim import build_lr_scheduler, build_optimizer
from rlflow.engine.rollout import PER_PROCESS, RolloutBuild, RolloutEngine, get_rollout_engine
from rlflow.engine.train_engine import EngineConfig, TrainEngine
from rlflow.parallel.groups import CallGroups, build_call_groups
from rlflow.parallel.layout import Layout, build_layout
from rlflow.parallel.realloc import ReallocManager
from rlflow.workers.setup import PARAM_DTYPE, CallLayout, ModelSetup, WorkerSetup

__all__ = ["PARAM_DTYPE", "HostedModel", "Residency"]


@dataclass
class HostedModel:
    """This process's share of one model.

    Attributes:
        setup: the model's setup.
        config: its HF config (``None`` for a rule-based reward).
        head: ``"lm"`` or ``"value"``.
        home: its home call layout (``None`` for a rule-based reward).
        engine: the home engine, on home ranks.
    """

    setup: ModelSetup
    config: PretrainedConfig | None = None
    head: str = "lm"
    home: CallLayout | None = None
    engine: TrainEngine | None = None


def load_hf_model(model: ModelSetup) -> torch.nn.Module:
    """The model's initial weights from its local directory, whole (fp32, on the CPU).

    A value model whose directory holds a causal LM gets a zero-initialised head. The home
    engines load this way only when :func:`rlflow.engine.loading.sharded_model` cannot (no
    safetensors files); it reads the same values, each rank only its shards.
    """
    if not model.value_head:
        return load_causal_lm(model.path, dtype=PARAM_DTYPE)
    config = AutoConfig.from_pretrained(model.path, local_files_only=True)
    if any(arch.endswith("ForCausalLM") for arch in (config.architectures or [])):
        return init_value_model_from_lm(model.path, dtype=PARAM_DTYPE)
    return build_value_model(model.path, dtype=PARAM_DTYPE)


def _reshard_fsdp(module: torch.nn.Module) -> None:
    """Free FSDP2's gathered parameters (the root keeps them after a forward) before offloading."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


class Residency:
    """The models of one worker process and their engines; see the module docstring.

    Args:
        setup: the worker setup.
        rank: this worker's global rank.
        device: ``cuda:0`` on a GPU worker, else ``cpu``.
    """

    def __init__(self, setup: WorkerSetup, rank: int, device: torch.device) -> None:
        self.setup, self.rank, self.device = setup, rank, device
        self.models: dict[str, HostedModel] = {}
        self.manager: ReallocManager | None = None
        self._groups: dict[CallLayout, CallGroups | None] = {}
        self._layouts: dict[tuple[str, CallLayout, bool], Layout] = {}
        self._copies: dict[tuple[str, Layout], Any] = {}  # engines around the manager's copies
        self._side_optimizers: dict[str, tuple] = {}  # model -> ((mfc, lr), optimizer, scheduler, config)

    # ------------------------------------------------------------------ building (collective, all pool ranks)
    def build(self, node_rank: int) -> None:
        """Create every process group of the plan, then this rank's engines; all pool ranks call it."""
        hosts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, node_rank)
        self.manager = ReallocManager(self.rank, host_of=dict(enumerate(hosts)), device=self.device)
        for layout in dict.fromkeys(self.setup.layouts.values()):  # the same order on every rank
            self._groups[layout] = build_call_groups(layout.ranks, layout.strategy, self.device.type)
        for model in self.setup.models.values():
            self.models[model.name] = self._register(model)

    def _register(self, model: ModelSetup) -> HostedModel:
        if model.rule_based:
            return HostedModel(model)
        config = AutoConfig.from_pretrained(model.path, local_files_only=True)
        if model.value_head:  # as the value-model loaders build it: one label, no dropout
            config.num_labels, config.classifier_dropout = 1, 0.0
        hosted = HostedModel(model, config, "value" if model.value_head else "lm", self.setup.home_layout(model.name))
        if self.rank in hosted.home.ranks:
            mesh = self.call_groups(hosted.home).mesh
            layout = self.layout(hosted, hosted.home, fsdp=True)
            # A meta model whose shards this rank reads from the safetensors files once parallelized;
            # other formats (logged) are loaded whole first.
            sharded = sharded_model(model.path, config, hosted.head, layout, self.rank, dtype=PARAM_DTYPE)
            module, load_weights = sharded if sharded is not None else (load_hf_model(model), None)
            engine_config = self._engine_config(model, hosted.home)
            hosted.engine = TrainEngine(module, mesh, engine_config, load_weights=load_weights)
        home_module = hosted.engine.stage if hosted.engine is not None else None
        if home_module is not None and model.lora is not None:
            home_module = MergedViews(home_module)  # copies (the rollout's among them) get the merged weights
        home_layout = self.layout(hosted, hosted.home, fsdp=True)
        # A LoRA model's steps change its adapted weights only: a kept copy gets just those, merged
        # (push "merged"), or keeps their base and merges the adapters it gets (push "adapters").
        names = [p.name for p in home_layout.params]
        adapters = model.lora is not None and model.lora.push == "adapters"
        changing = adapted_weight_names(names, model.lora) if model.lora and not adapters else None
        low_rank = low_rank_updates(names, model.lora) if adapters else None
        self.manager.register(
            model.name,
            home_layout,
            home_module,
            lambda layout: self._build_copy(hosted, layout),
            dtype=PARAM_DTYPE,
            trainable=model.trainable,
            offload_home=self.setup.offloads_home(model.name),
            keep_copies=model.name in self.setup.keep_copies,
            changing=changing,
            low_rank=low_rank,
        )
        return hosted

    def _mfcs_on(self, model_name: str, layout: CallLayout) -> list[MFCDef]:
        """The MFCs of ``model_name`` that run on ``layout``, in declaration order."""
        return [m for m in self.setup.model_mfcs(model_name) if self.setup.layouts[m.name] == layout]

    def _engine_config(self, model: ModelSetup, layout: CallLayout) -> EngineConfig:
        """Engine settings: micro-batches of the model's first MFC on ``layout``; optimizer at a trainable home."""
        mfcs = self._mfcs_on(model.name, layout)
        mfc = next((m for m in mfcs if m.is_train), mfcs[0])
        train = model.trainable and mfc.is_train
        split = (
            {"max_tokens_per_micro_batch": model.max_tokens_per_micro_batch}
            if model.max_tokens_per_micro_batch is not None
            else {"num_micro_batches": mfc.n_mbs}
        )
        return EngineConfig(
            optim=model.optim if train else None,
            gradient_checkpointing=model.gradient_checkpointing and train,
            shared_prefix=model.shared_prefix,
            fused_cpu_ops=model.fused_cpu_ops,
            # fp32 masters, computed in the model's dtype (FSDP2 casts what it gathers)
            mixed_precision="bf16" if model.compute_dtype == torch.bfloat16 else "fp32",
            # The adapters live at the trainable home only; every copy holds merged weights.
            lora=model.lora if train else None,
            router_aux_loss_coef=model.router_aux_loss_coef,
            device=self.device.type,
            **split,
        )

    def _build_copy(self, hosted: HostedModel, layout: Layout) -> Any:
        """The manager's factory: this rank's empty module of a forward ``layout`` (engine kept for
        the call), or the weight target of the rollout engine of a generate ``layout``."""
        call = CallLayout(layout.ranks, layout.strategy)
        groups = self.call_groups(call)
        if not layout.fsdp:
            return self._rollout_engine(hosted, layout, groups).weight_target()
        # A forward copy: the engine's stage, built on meta so only this rank's shards exist.
        model = build_meta_model(hosted.config, hosted.head, dtype=PARAM_DTYPE)
        # The manager writes the weights next; only the rotary buffers need computing here.
        engine = TrainEngine(model, groups.mesh, self._engine_config(hosted.setup, call), load_weights=init_buffers)
        self._copies[(hosted.setup.name, layout)] = engine
        return engine.stage

    def _rollout_engine(self, hosted: HostedModel, layout: Layout, groups: CallGroups) -> RolloutEngine:
        """The rollout engine of ``layout`` on this rank: a ``per_process`` engine already built is
        reused, otherwise one is built (empty; the manager writes the home weights next)."""
        key = (hosted.setup.name, layout)
        engine = self._copies.get(key)
        if engine is not None:
            return engine
        cls = self.rollout_engine_cls
        if not cls.available() or not cls.supports_device(self.device.type):
            raise RuntimeError(
                f"rollout engine {self.setup.rollout_engine!r} ({cls.__qualname__}) cannot run on rank {self.rank}: "
                f"available={cls.available()}, supports device {self.device.type!r}="
                f"{cls.supports_device(self.device.type)}"
            )
        gens = [
            m
            for m in self._mfcs_on(hosted.setup.name, CallLayout(layout.ranks, layout.strategy))
            if m.interface_type == "generate"
        ]
        spec = RolloutBuild(
            config=hosted.config,
            device_mesh=groups.mesh,
            device=self.device,
            # The copy is held in the compute dtype (its KV cache too); the reshard casts the fp32 wire into it.
            dtype=hosted.setup.compute_dtype,
            pad_token_id=hosted.config.pad_token_id,
            seed=self.setup.seed,
            memory_fraction=self.setup.rollout_memory_fraction,
            num_micro_batches=gens[0].n_mbs if gens else None,
        )
        engine = cls.build(spec)
        self._copies[key] = engine
        return engine

    # ------------------------------------------------------------------ lookup
    def call_groups(self, layout: CallLayout) -> CallGroups | None:
        """This rank's groups of ``layout`` (``None`` when the rank is not in it)."""
        return self._groups[layout]

    @property
    def rollout_engine_cls(self) -> type[RolloutEngine]:
        """The class registered as ``WorkerSetup.rollout_engine``; its declarations decide what happens here."""
        return get_rollout_engine(self.setup.rollout_engine)

    def layout(self, hosted: HostedModel, call: CallLayout, fsdp: bool, style: str = "hf") -> Layout:
        """The parameter layout of ``hosted`` on ``call`` (cached); ``style``: the rollout engine's
        ``layout_style`` on a generate call."""
        key = (hosted.setup.name, call, fsdp, style)
        if key not in self._layouts:
            self._layouts[key] = build_layout(
                hosted.config, call.strategy, call.ranks, fsdp=fsdp, head=hosted.head, style=style
            )
        return self._layouts[key]

    def _call_layout(self, mfc: MFCDef) -> Layout:
        hosted = self.models[mfc.model_name]
        generate = mfc.interface_type == "generate"
        style = self.rollout_engine_cls.layout_style if generate else "hf"
        return self.layout(hosted, self.setup.layouts[mfc.name], fsdp=not generate, style=style)

    def engine_for(self, mfc: MFCDef) -> Any:
        """The engine that runs ``mfc`` on this rank: home engine, copy, or ``None`` (rule-based reward)."""
        hosted = self.models[mfc.model_name]
        if hosted.setup.rule_based:
            return None
        if self.setup.uses_home(mfc.name):
            return hosted.engine
        engine = self._copies.get((mfc.model_name, self._call_layout(mfc)))
        if engine is None:
            raise RuntimeError(
                f"MFC {mfc.name!r}: model {mfc.model_name!r} has no copy on rank {self.rank}; run pre_call first"
            )
        return engine

    def weights_version(self, mfc: MFCDef) -> int:
        """The version (optimizer steps) of the weights ``mfc`` runs on here: its home's, or that of
        the copy its pre-hook made current; -1 for a model without weights."""
        hosted = self.models[mfc.model_name]
        if hosted.setup.rule_based:
            return -1
        if self.setup.uses_home(mfc.name):
            return self.manager.version(mfc.model_name)
        version = self.manager.copy_version(mfc.model_name, self._call_layout(mfc))
        if version is None:
            raise RuntimeError(
                f"MFC {mfc.name!r}: no copy of {mfc.model_name!r} on rank {self.rank}; run pre_call first"
            )
        return version

    def step_done(self, model_name: str) -> None:
        """Record an optimizer step of ``model_name`` (its home ranks, after ``train_step``)."""
        self.manager.bump_version(model_name)

    # ------------------------------------------------------------------ hooks
    def prepare(self, mfc: MFCDef) -> None:
        """Pre-hook: ``mfc.pre_hooks`` (EMA blends), then bring the weights for ``mfc`` current on its layout."""
        if self.rank not in self.setup.hook_ranks(mfc.name):
            return
        self._blend(mfc, mfc.pre_hooks)
        hosted = self.models[mfc.model_name]
        layout = self.setup.layouts[mfc.name]
        if self.rank in set(hosted.home.ranks) | set(layout.ranks):
            if self._wakes_engine(mfc) and self.device.type == "cuda":
                # A sleeping engine wakes into memory PyTorch may be caching (vLLM: its own pool):
                # hand the cached blocks back first.
                gc.collect()
                torch.cuda.empty_cache()
            self.manager.pre_call(mfc.model_name, self._call_layout(mfc))

    def release(self, mfc: MFCDef) -> None:
        """Post-hook: ``mfc.post_hooks``, then free the call's copy (unless kept) or offload the home.

        A kept forward copy gives back the parameters FSDP gathered (the root keeps them after
        a forward): the next reshard writes the shards, which the next forward gathers anew.
        """
        if self.rank not in self.setup.hook_ranks(mfc.name):
            return
        self._blend(mfc, mfc.post_hooks)
        hosted = self.models[mfc.model_name]
        if self.rank not in self.setup.layouts[mfc.name].ranks:
            return
        if self.setup.uses_home(mfc.name) and hosted.engine is not None and self.setup.offloads_home(hosted.setup.name):
            _reshard_fsdp(hosted.engine.stage)
        layout = self._call_layout(mfc)
        key = (mfc.model_name, layout)
        self.manager.post_call(mfc.model_name, layout)
        if self._keeps_engine(mfc):
            # Kept; the manager re-pushes when stale. A sleeper keeps its weights on the host.
            if self.rollout_engine_cls.can_sleep:
                self._copies[key].sleep()
        elif self.manager.holds_copy(mfc.model_name, layout):
            if isinstance(self._copies.get(key), TrainEngine):
                _reshard_fsdp(self._copies[key].stage)
        elif self._copies.pop(key, None) is not None:
            if self.device.type == "cuda":
                # HF modules hold reference cycles: collect them so the cache can hand memory back.
                # On CPU refcounting frees the tensors; a full collection per call would be time for nothing.
                gc.collect()
                torch.cuda.empty_cache()

    def _keeps_engine(self, mfc: MFCDef) -> bool:
        """The call's rollout engine is built once per process and kept between calls."""
        return mfc.interface_type == "generate" and self.rollout_engine_cls.persistence == PER_PROCESS

    def _wakes_engine(self, mfc: MFCDef) -> bool:
        """The call may wake a kept engine that slept since its last call."""
        return self._keeps_engine(mfc) and self.rollout_engine_cls.can_sleep

    def _blend(self, mfc: MFCDef, hooks) -> None:
        """``ParamReallocHook``: the target (this call's model) moves toward the source by ``eta``, at home."""
        target = self.models[mfc.model_name]
        for hook in hooks:
            source = self.models[hook.source]
            if self.rank in set(source.home.ranks) | set(target.home.ranks):
                self.manager.ema_update(mfc.model_name, hook.source, hook.eta)

    def copy_weights(self, target: str, source: str) -> tuple[str, ...]:
        """``target`` takes ``source``'s current weights, home to home (``init: copy`` at RL start).

        Parameters both models have are copied; the target keeps the rest (a critic's value
        head). A trainable target starts a fresh optimizer and schedule, as if its weights had
        been loaded. Every pool rank may call it; ranks outside both homes return at once.

        Returns:
            The target's parameters left as they were, sorted (empty off both homes).
        """
        t, s = self.models[target], self.models[source]
        for hosted in (t, s):
            if hosted.home is None:
                raise ValueError(f"cannot copy {source!r} into {target!r}: {hosted.setup.name!r} has no weights")
        if t.setup.lora is not None:
            raise ValueError(f"cannot copy {source!r} into {target!r}: a LoRA model's base weights stay as loaded")
        if self.rank not in set(t.home.ranks) | set(s.home.ranks):
            return ()
        kept = self.manager.copy_weights(target, source)
        engine = t.engine
        if engine is not None and engine.optimizer is not None:
            engine.optimizer = build_optimizer(engine.stage.parameters(), engine.config.optim)
            engine.scheduler = build_lr_scheduler(engine.optimizer, engine.config.optim)
        return kept

    @contextlib.contextmanager
    def home_loaded(self, model_name: str) -> Iterator[TrainEngine | None]:
        """The home engine of ``model_name`` on this rank (``None`` off home), reloaded if it rests offloaded.

        Local: loading the home layout needs no collective.
        """
        hosted = self.models[model_name]
        if hosted.engine is None:
            yield None
            return
        layout = self.layout(hosted, hosted.home, fsdp=True)
        self.manager.pre_call(model_name, layout)
        try:
            yield hosted.engine
        finally:
            if self.setup.offloads_home(model_name):
                _reshard_fsdp(hosted.engine.stage)
            self.manager.post_call(model_name, layout)

    @contextlib.contextmanager
    def optimizer_for(self, model_name: str, mfc_name: str, lr: float | None) -> Iterator[None]:
        """Train ``model_name`` with its own optimizer, or with a separate constant-``lr`` AdamW.

        ``lr=None`` is the model's optimizer, and drops any separate one (a warm-up is over).
        With ``lr``, the steps of ``mfc_name`` use an AdamW of their own (moments kept across its
        calls, gradient clipping as configured) and leave the model's optimizer and schedule
        untouched — the SFT warm-up before RL, after which RL starts with a fresh optimizer.
        """
        engine = self.models[model_name].engine
        if lr is None:
            self._side_optimizers.pop(model_name, None)
            yield
            return
        key = (mfc_name, lr)
        side = self._side_optimizers.get(model_name)
        if side is None or side[0] != key:
            optim = replace(engine.config.optim, lr=lr, warmup_steps=0, total_steps=None)
            optimizer = build_optimizer(engine.stage.parameters(), optim)
            side = (key, optimizer, build_lr_scheduler(optimizer, optim), replace(engine.config, optim=optim))
            self._side_optimizers[model_name] = side
        own = engine.optimizer, engine.scheduler, engine.config
        engine.optimizer, engine.scheduler, engine.config = side[1:]
        try:
            yield
        finally:
            engine.optimizer, engine.scheduler, engine.config = own

    # ------------------------------------------------------------------ reporting
    def held_models(self) -> list[str]:
        """Names of the models whose home engine lives on this rank."""
        return [name for name, hosted in self.models.items() if hosted.engine is not None]

    def memory_bytes(self) -> int:
        """Bytes of this rank's home parameters and optimizer states (host-offloaded ones included)."""
        return sum(_engine_bytes(h.engine) for h in self.models.values() if h.engine is not None)


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _engine_bytes(engine: TrainEngine) -> int:
    total = sum(_local_bytes(p) for p in engine.stage.parameters())
    if engine.optimizer is not None:
        for state in engine.optimizer.state.values():
            total += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total
