"""The training engine: one class for actor, critic and reward-model training and inference.

A :class:`TrainEngine` owns this rank's part of an HF model under a ``(pp, dp, tp)``
strategy on a torch ``DeviceMesh`` with axes ``("pp", "dp", "tp")``. It is built in the
order documented in :mod:`rlflow.engine.parallelize` — pipeline split, tensor parallel,
activation checkpointing, FSDP2. A model built on the ``meta`` device is parallelized there,
then only this rank's shards are allocated and filled by a ``load_weights`` callback
(:mod:`rlflow.engine.loading` reads them straight from the safetensors files). It runs:

* :meth:`TrainEngine.train_step` — several PPO mini-batches, one AdamW step each;
* :meth:`TrainEngine.forward` — log-probs and entropies of given sequences (LM head), or
  per-token values and per-sequence rewards (scalar head).

**Loss scaling.** The loss callable returns the *mean* of its loss over the loss units of
one micro-batch (tokens where ``batch[loss_mask_key]`` is non-zero, or rows when
``loss_mask_key is None``). The engine multiplies it by ``units(micro-batch) /
units(global mini-batch)``, where the global count is all-reduced over the dp ranks, and by
``dp`` (FSDP averages gradients over dp). The gradient is then the gradient of the mean
over the whole global mini-batch, whatever the split into dp ranks and micro-batches — the
property the equivalence tests check against a single process.

**Which ranks return what.** Every rank of the mesh calls every method with its dp-local
rows (tp and pp peers of one dp rank pass the same rows). ``train_step`` returns the same
metrics on every rank. ``forward`` returns full tensors for the dp-local rows on the ranks
of the last pipeline stage (every tp rank: logits are gathered) and ``None`` elsewhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rlflow.engine import engine_state
from rlflow.engine.attention import VARLEN_SDPA, flash_attn_available, varlen_implementation
from rlflow.engine.fused_ops import fuse_cpu_ops
from rlflow.engine.lora import LoraSpec, apply_lora, init_lora_weights, lora_strategy_error
from rlflow.engine.micro_batch import MicroBatch, select, split_micro_batches
from rlflow.engine.optim import OptimConfig, build_lr_scheduler, build_optimizer, clip_grad_norm_
from rlflow.engine.packing import max_seqlen, pack, position_ids_from_mask, unpack
from rlflow.engine.parallelize import ParallelDims, apply_ac, apply_fsdp, layer_matmul_params, mixed_precision_dtype
from rlflow.engine.pipeline import DecoderStage, build_stage, tied_embedding_group
from rlflow.engine.pipeline_runner import PipelineRunner
from rlflow.engine.router_loss import RouterLogitsRecorder, resolve_router_aux_loss_coef, router_aux_loss
from rlflow.engine.shared_prefix import SharedPrefix, prompt_groups, shared_prefix_layout
from rlflow.parallel.tensor_parallel import apply_tp

__all__ = ["ENGINE_CAPABILITIES", "EngineConfig", "LossFn", "TrainEngine", "strategy_error"]

# (outputs, micro_batch) -> (loss: mean over the micro-batch's loss units, metrics)
LossFn = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]

# Which parallel axes each call type supports, for the planner's RuntimeCapabilities.
# Generation is the rollout engine's (it reuses apply_tp for tp; no pp).
ENGINE_CAPABILITIES: dict[str, dict[str, bool]] = {
    "train_step": {"dp": True, "tp": True, "pp": True},
    "inference": {"dp": True, "tp": True, "pp": True},
}


def strategy_error(call_type: str, config, dp: int, tp: int, pp: int) -> str | None:
    """Why the engine cannot run ``call_type`` for ``config`` under ``(dp, tp, pp)``, or ``None``."""
    caps = ENGINE_CAPABILITIES.get(call_type)
    if caps is None:
        return f"call_type={call_type!r} is not run by the training engine; expected one of {list(ENGINE_CAPABILITIES)}"
    for axis, degree in (("dp", dp), ("tp", tp), ("pp", pp)):
        if degree > 1 and not caps[axis]:
            return f"{call_type} does not support {axis}={degree}"
    try:
        ParallelDims(dp=dp, tp=tp, pp=pp).check_model(config)
    except ValueError as err:
        return str(err)
    return None


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How an engine runs (the strategy comes from the mesh).

    Args:
        optim: optimizer settings; ``None`` builds an inference-only engine (ref, reward).
        num_micro_batches: micro-batches per mini-batch (per dp rank), token-balanced.
        max_tokens_per_micro_batch: alternatively, a token budget per micro-batch.
            With neither, each mini-batch is one micro-batch.
        gradient_checkpointing: recompute layer activations in backward.
        mixed_precision: ``"auto"`` (bf16 compute on CUDA, fp32 on CPU), ``"bf16"``, ``"fp32"``.
            Master weights, gradients' reduction and optimizer state are fp32 either way.
        packing: ``"auto"`` (on with CUDA and flash-attn, without pipelining), ``"on"``, ``"off"``:
            run each micro-batch as one packed row of valid tokens (padding-free) through a
            varlen attention kernel — flash-attn's on CUDA when installed, else PyTorch SDPA
            (:mod:`rlflow.engine.attention`). Not with ``pp > 1``.
        pp_schedule: ``"1f1b"`` or ``"gpipe"``.
        compute_entropy: return per-token entropies from LM forwards.
        lora: train low-rank adapters on these linear modules instead of every weight
            (:mod:`rlflow.engine.lora`; ``tp = pp = 1``); ``None`` trains every parameter.
        shared_prefix: run the rows that share a prompt as one sequence per prompt (the prompt
            once; :mod:`rlflow.engine.shared_prefix`) where that is estimated cheaper: micro-batches
            with a ``response_mask``, unpacked, ``pp = 1``, full attention through SDPA or eager
            attention, no router loss. ``False``: always the padded rows.
        fused_cpu_ops: on a CPU, the model's Llama-style RMSNorms, SwiGLU MLPs and RoPE run
            forward and backward as one fused C++ pass each, and its causal attention over whole
            sequences as one C++ kernel (:mod:`rlflow.engine.fused_ops`; float32 outside autocast,
            call by call; RoPE's function for the whole process); ``False``: the modules' own
            forward and HF's SDPA.
        router_aux_loss_coef: a mixture-of-experts model's training loss adds this times the
            router's load-balancing loss (:mod:`rlflow.engine.router_loss`; ``pp = 1``); ``None``:
            the model config's ``router_aux_loss_coef`` (0 for a dense model); 0: off.
        device: ``"cpu"``, ``"cuda"`` (the current CUDA device) or ``None`` for CUDA when available.
    """

    optim: OptimConfig | None = field(default_factory=OptimConfig)
    num_micro_batches: int | None = None
    max_tokens_per_micro_batch: int | None = None
    gradient_checkpointing: bool = False
    mixed_precision: str = "auto"
    packing: str = "auto"
    pp_schedule: str = "1f1b"
    compute_entropy: bool = True
    lora: LoraSpec | None = None
    shared_prefix: bool = True
    fused_cpu_ops: bool = True
    router_aux_loss_coef: float | None = None
    device: str | None = None

    def __post_init__(self) -> None:
        if self.num_micro_batches is not None and self.max_tokens_per_micro_batch is not None:
            raise ValueError("give num_micro_batches or max_tokens_per_micro_batch, not both")
        if self.num_micro_batches is not None and self.num_micro_batches < 1:
            raise ValueError(f"num_micro_batches={self.num_micro_batches} must be >= 1")
        if self.packing not in ("auto", "on", "off"):
            raise ValueError(f"packing={self.packing!r}; expected 'auto', 'on' or 'off'")
        if self.pp_schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"pp_schedule={self.pp_schedule!r}; expected '1f1b' or 'gpipe'")
        mixed_precision_dtype(torch.device("cpu"), self.mixed_precision)  # validates the name

    def split_kwargs(self) -> dict:
        if self.max_tokens_per_micro_batch is not None:
            return {"max_tokens": self.max_tokens_per_micro_batch}
        return {"num_micro_batches": self.num_micro_batches or 1}


def _resolve_device(name: str | None) -> torch.device:
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


class TrainEngine:
    """This rank's part of a model under the mesh's ``(pp, dp, tp)`` strategy.

    Args:
        model: a full HF ``*ForCausalLM`` (actor, ref) or scalar-head
            ``*ForTokenClassification`` (critic, reward) model of the Llama family, identical
            on every rank (same weights), or built on the ``meta`` device (then ``load_weights``
            writes the weights); the engine takes its modules.
        mesh: a ``DeviceMesh`` of shape ``(pp, dp, tp)`` with ``mesh_dim_names=("pp", "dp", "tp")``.
        config: how to run; see :class:`EngineConfig`.
        load_weights: called with this rank's parallelized stage (local shards allocated on the
            engine's device) to write its weights, before the optimizer is built. Required when
            ``model`` is on the ``meta`` device — then nothing but this rank's shards is ever
            allocated (:func:`rlflow.engine.loading.sharded_model` builds both).
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        config: EngineConfig | None = None,
        *,
        load_weights: Callable[[nn.Module], None] | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.mesh = mesh
        self.dims = ParallelDims.from_mesh(mesh)
        self.dims.check_model(model.config)
        if self.config.lora is not None and (why := lora_strategy_error(self.dims.tp, self.dims.pp)):
            raise ValueError(why)
        self.pp_rank, self.dp_rank, self.tp_rank = mesh.get_coordinate()
        self.device = _resolve_device(self.config.device)
        self.compute_dtype = mixed_precision_dtype(self.device, self.config.mixed_precision)
        self.packing = self._resolve_packing()
        cpu = self.device.type == "cpu"
        widened = cpu and self.compute_dtype in (torch.bfloat16, torch.float16)
        # rlflow's SDPA (HF's for every call it does not take): packed rows, 16-bit attention on CPUs in
        # float32, and the fused causal attention of fused_cpu_ops
        fused = cpu and self.config.fused_cpu_ops and model.config._attn_implementation == "sdpa"
        if self.packing or widened or fused:
            model.set_attn_implementation(varlen_implementation(self.device))
        self.hf_class, self.hf_config = type(model), model.config
        self.stage = self._build_stage(model, load_weights)
        self.kind = self.stage.kind
        self.tied_group = tied_embedding_group(mesh) if self.stage.tied else None
        self.tied_param = self._tied_param()
        self.optimizer = self.scheduler = None
        if self.config.optim is not None:
            self.optimizer = build_optimizer(self.stage.parameters(), self.config.optim)
            self.scheduler = build_lr_scheduler(self.optimizer, self.config.optim)
        self.router_aux_loss_coef, self.router_recorder = self._router_aux_loss(model)
        self.shares_prefixes = self._shares_prefixes()
        self.runner = PipelineRunner(self) if self.dims.pp > 1 else None
        self.global_step = 0

    # ------------------------------------------------------------------ building
    def _resolve_packing(self) -> bool:
        # Pipelining keeps padded rows: torch's schedules cut every input and keyword tensor
        # along dim 0 into equal micro-batches and the stages exchange activation buffers of
        # one fixed shape, while a packed micro-batch is one row of a different length, with
        # its own cu_seqlens (of a different length too) that a dim-0 split cannot carry.
        if self.config.packing == "on" and self.dims.pp > 1:
            raise ValueError(
                f"packing='on' is not supported with pp={self.dims.pp}: pipeline stages exchange "
                "fixed-shape micro-batches, packed rows vary in length; use packing='off' or 'auto'"
            )
        if self.config.packing == "auto":
            return self.device.type == "cuda" and self.dims.pp == 1 and flash_attn_available()
        return self.config.packing == "on"

    def _build_stage(self, model: nn.Module, load_weights: Callable[[nn.Module], None] | None) -> DecoderStage:
        # Order and reasons: rlflow.engine.parallelize's module docstring.
        stage = build_stage(model, self.dims.pp, self.pp_rank)
        on_meta = any(p.is_meta for p in stage.parameters())
        if on_meta and load_weights is None:
            raise ValueError("the model is on the meta device: pass load_weights to fill its shards")
        if not on_meta:
            stage.to(self.device)
        if self.config.lora is not None:  # before FSDP, which must shard the adapters too
            apply_lora(stage, self.config.lora)
        if self.config.fused_cpu_ops and self.device.type == "cpu":
            fuse_cpu_ops(stage)
        apply_tp(stage, self.mesh["tp"])
        if self.config.gradient_checkpointing:
            apply_ac(stage)
        # FSDP over one rank shards nothing and syncs nothing, yet its hooks outweigh a tiny model's
        # step on CPU; it stays where it does work: dp > 1, or a compute dtype to cast to.
        master_dtype = next(stage.parameters()).dtype
        fsdp = self.mesh["dp"].size() > 1 or self.compute_dtype != master_dtype
        if fsdp:
            apply_fsdp(
                stage,
                self.mesh["dp"],
                param_dtype=self.compute_dtype,
                reshard_after_forward=self.dims.pp == 1,
            )
        if on_meta and fsdp:  # parallelized on meta: allocate only this rank's shards (FSDP2 re-points its params)
            stage.to_empty(device=self.device)
        elif on_meta:
            _to_empty_keeping_ties(stage, self.device)
        if load_weights is not None:
            load_weights(stage)
        if self.config.lora is not None:
            init_lora_weights(stage, self.config.lora)
        stage.compute_entropy = self.config.compute_entropy
        return stage

    def _shares_prefixes(self) -> tuple[int, int] | None:
        """``(layer_params, pair_cost)`` where rows may run with shared prefixes (see
        :class:`EngineConfig`), the per-token and per-pair multiply-adds that price the layout."""
        implementation = self.hf_config._attn_implementation
        full = set(self.stage.layer_types) <= {"full_attention"}
        if not self.config.shared_prefix or self.packing or self.dims.pp > 1 or not full:
            return None
        if implementation not in ("sdpa", "eager", VARLEN_SDPA):
            return None
        config = self.hf_config.to_dict()
        layer = layer_matmul_params(config)
        if layer is None:
            return None
        heads = config.get("num_attention_heads") or 1
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        return layer, 2 * heads * head_dim

    def _micro_batches(self, batch: Mapping[str, torch.Tensor]) -> list[MicroBatch]:
        """``batch`` cut into micro-batches; where rows may share prompts, the rows of a prompt in
        one micro-batch (unless a prompt's rows hold more tokens than the micro-batch budget)."""
        split = self.config.split_kwargs()
        found = None
        if self.shares_prefixes is not None and "response_mask" in batch:
            found = prompt_groups(batch["input_ids"], batch["attention_mask"], batch["response_mask"])
        if found is not None:
            group = found[0].to(batch["attention_mask"].device)
            tokens = torch.zeros(int(group.max()) + 1, dtype=torch.long, device=group.device)
            tokens.index_add_(0, group, batch["attention_mask"].sum(dim=1).long())
            if "max_tokens" not in split or int(tokens.max()) <= split["max_tokens"]:
                return split_micro_batches(batch, groups=group.cpu(), **split)
        return split_micro_batches(batch, **split)

    def _shared_prefix(self, data: Mapping[str, torch.Tensor], positions: torch.Tensor) -> SharedPrefix | None:
        """The shared-prefix layout of a micro-batch where it is taken (see :class:`EngineConfig`)."""
        if self.shares_prefixes is None or "response_mask" not in data:
            return None
        tensors = (data["input_ids"], data["attention_mask"], positions, data["response_mask"])
        layout = shared_prefix_layout(*(t.cpu() for t in tensors), *self.shares_prefixes)
        return None if layout is None else layout.to(self.device)

    def _router_aux_loss(self, model: nn.Module) -> tuple[float, RouterLogitsRecorder | None]:
        """The router auxiliary loss's coefficient and the hooks that collect its logits (a trained MoE model)."""
        if self.optimizer is None:
            return 0.0, None
        coef = resolve_router_aux_loss_coef(model.config, self.config.router_aux_loss_coef)
        if coef == 0:
            return 0.0, None
        # HF's loss pools the routing statistics of every layer of a forward: a pipeline stage
        # sees its own layers only, and its loss would be another one.
        if self.dims.pp > 1:
            raise ValueError(
                f"router_aux_loss_coef={coef}: the router auxiliary loss runs with pp=1 (got pp={self.dims.pp}); "
                "set it to 0 to train this mixture-of-experts model with pipeline parallelism"
            )
        return coef, RouterLogitsRecorder(self.stage, self.hf_class)

    def _tied_param(self) -> nn.Parameter | None:
        if self.tied_group is None:
            return None
        return self.stage.model.embed_tokens.weight if self.stage.is_first else self.stage.lm_head.weight

    # ------------------------------------------------------------------ running a micro-batch
    def to_device(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``data``'s tensors on this engine's device."""
        return {k: v.to(self.device) for k, v in data.items()}

    def stage_inputs(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Model inputs of one micro-batch on this device: ids, mask and positions."""
        mask = data["attention_mask"].to(self.device)
        ids = data["input_ids"].to(self.device)
        return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)}

    def run_micro_batch(self, data: Mapping[str, torch.Tensor], router_aux: bool = False) -> dict[str, torch.Tensor]:
        """Forward one micro-batch through the (single) stage: ``{log_probs, entropy, logits}`` or ``{values}``.

        Every output is ``(b, t[, V])`` aligned with ``data["attention_mask"]``; with packing
        the micro-batch runs as one packed row ``(1, total)`` with its ``cu_seqlens`` and
        ``max_seqlen`` given to the varlen attention, and the outputs are scattered back.
        ``router_aux`` (a trained MoE model) adds ``router_aux_loss``, a scalar: HF's
        load-balancing loss over the micro-batch's real tokens.
        """
        inp = self.stage_inputs(data)
        is_lm = self.kind == "lm"
        recording = self.router_recorder.recording() if router_aux else contextlib.nullcontext()
        with recording as router_logits:
            if not self.packing:
                ids, mask = inp["input_ids"], inp["attention_mask"]
                layout = None if router_aux else self._shared_prefix(data, inp["position_ids"])
                out = self.stage(
                    ids,
                    attention_mask=mask,
                    position_ids=inp["position_ids"],
                    labels=ids if is_lm else None,
                    shared_prefix=layout,
                )
                named = self.named_outputs(out)
            else:
                ids, cu_seqlens, pos = pack(inp["input_ids"], inp["attention_mask"])
                out = self.stage(
                    ids,
                    position_ids=pos,
                    labels=ids if is_lm else None,
                    cu_seqlens=cu_seqlens,
                    max_seqlen=max_seqlen(cu_seqlens),
                )
                named = {k: unpack(v, inp["attention_mask"]) for k, v in self.named_outputs(out).items()}
        if router_aux:  # a packed row holds real tokens only
            mask = None if self.packing else inp["attention_mask"]
            named["router_aux_loss"] = router_aux_loss(self.router_recorder, self.hf_config, router_logits, mask)
        return named

    def named_outputs(self, out) -> dict[str, torch.Tensor]:
        """Name the last stage's raw outputs."""
        if self.kind == "value":
            return {"values": out}
        names = ("log_probs", "entropy", "logits")
        return dict(zip(names, out))

    # ------------------------------------------------------------------ training
    def _loss_units(self, data: Mapping[str, torch.Tensor], key: str | None) -> float:
        if key is None:
            return float(data["attention_mask"].shape[0])
        if key not in data:
            raise KeyError(f"loss_mask_key={key!r} is not in the batch (keys: {sorted(data)})")
        return float((data[key] != 0).sum())

    def _global_units(self, data: Mapping[str, torch.Tensor], key: str | None, empty_ok: bool = False) -> float:
        units = torch.tensor([self._loss_units(data, key)], dtype=torch.float64, device=self.device)
        if self.dims.dp > 1:
            dist.all_reduce(units, group=self.mesh["dp"].get_group())
        if units.item() == 0 and not empty_ok:
            raise ValueError(f"the global mini-batch has no loss units under loss_mask_key={key!r}")
        return units.item()

    def train_step(
        self,
        batch: Mapping[str, torch.Tensor],
        loss_fn: LossFn,
        *,
        num_mini_batches: int = 1,
        loss_mask_key: str | None = "attention_mask",
        empty_ok: bool = False,
    ) -> dict[str, float]:
        """Split ``batch`` into mini-batches and take one optimizer step on each.

        Args:
            batch: dp-local rows: ``input_ids`` and ``attention_mask`` ``(B, T)``, plus whatever
                the loss reads (per-token tensors ``(B, T, ...)``, per-row tensors ``(B, ...)``).
            loss_fn: ``loss_fn(outputs, micro_batch) -> (loss, metrics)``; ``outputs`` holds
                ``log_probs``, ``entropy`` ``(b, t)`` and ``logits`` ``(b, t, V)`` for an LM, or
                ``values`` ``(b, t)`` for a value head, aligned with ``micro_batch``'s columns
                (``log_probs[:, i]`` is the log-prob of token ``i``; 0 at sequence starts and
                padding). ``loss`` must be the mean over the micro-batch's loss units.
            num_mini_batches: optimizer steps, each on one of that many contiguous mini-batches
                (``B / num_mini_batches`` rows, sizes differing by at most one); every dp rank must
                use the same count.
            loss_mask_key: batch key whose non-zero entries are the loss units (tokens), or
                ``None`` to count rows.
            empty_ok: a global mini-batch without loss units (every row masked out) takes a step
                that changes no weight (the lr schedule and ``global_step`` advance, as on every
                rank) instead of raising.

        Returns:
            Means over the mini-batches of ``loss`` (the global mini-batch mean), the loss's
            metrics (weighted like the loss), ``grad_norm`` (before clipping), and ``lr``; for a
            mixture-of-experts model trained with its router loss, ``router_aux_loss`` (HF's
            load-balancing loss, the token-weighted mean over micro-batches, before its
            coefficient; ``loss`` leaves it out, the gradient has it).
        """
        if self.optimizer is None:
            raise RuntimeError("this engine was built with optim=None (inference only)")
        rows = batch["attention_mask"].shape[0]
        if not 1 <= num_mini_batches <= rows:
            raise ValueError(f"num_mini_batches={num_mini_batches} must be in [1, {rows}] (the dp-local rows)")
        self.stage.train()
        totals: dict[str, float] = {}
        # tensor_split, not chunk: exactly num_mini_batches steps (sizes differ by at most a row), so
        # every dp rank takes the same count whatever its rows, as the lr schedule and metrics assume.
        for chunk in torch.arange(rows).tensor_split(num_mini_batches):
            mini = select(batch, chunk)
            metrics = self._train_mini_batch(mini, loss_fn, loss_mask_key, empty_ok)
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + v / num_mini_batches
        return totals

    def _train_mini_batch(self, mini, loss_fn: LossFn, loss_mask_key: str | None, empty_ok: bool) -> dict[str, float]:
        global_units = self._global_units(mini, loss_mask_key, empty_ok)
        if global_units == 0:  # every rank sees the same global count, so all of them skip together
            # No gradient: the optimizer skips parameters whose grad is None (no decay, no moment update).
            self.optimizer.zero_grad(set_to_none=True)
            self.optimizer.step()
            self.scheduler.step()
            self.global_step += 1
            return {"loss": 0.0, "grad_norm": 0.0, "lr": self.scheduler.get_last_lr()[0], "empty_step_fraction": 1.0}
        scale = self.dims.dp / global_units  # FSDP divides the reduced gradient by dp

        def weighted_loss(outputs, data) -> tuple[torch.Tensor, dict[str, float]]:
            loss, metrics = loss_fn(outputs, data)
            units = self._loss_units(data, loss_mask_key)
            if units == 0:
                # No loss units here (the mean is 0/0): contribute nothing, but keep a graph
                # so FSDP's and the pipeline's backward bookkeeping still runs.
                zero = sum(v.sum() for v in outputs.values() if v.requires_grad) * 0.0
                return zero, {"loss": 0.0, **{k: 0.0 for k in metrics}}
            weight = units / global_units
            sums = {"loss": float(loss.detach()) * weight, **{k: float(v) * weight for k, v in metrics.items()}}
            return loss * (units * scale), sums

        if self.runner is not None:
            sums = self.runner.train(mini, weighted_loss)
        else:
            sums = {}
            router_aux = self.router_recorder is not None
            # The router loss of each micro-batch is weighted by its share of the global mini-batch's
            # real tokens: over dp ranks and micro-batches, the token-weighted mean of HF's loss.
            tokens = self._global_units(mini, "attention_mask") if router_aux else 0.0
            for mb in self._micro_batches(mini):
                data = self.to_device(mb.data)
                outputs = self.run_micro_batch(data, router_aux=router_aux)
                aux = outputs.pop("router_aux_loss", None)
                loss, mb_sums = weighted_loss(outputs, data)
                if aux is not None:
                    share = self._loss_units(data, "attention_mask") / tokens
                    loss = loss + aux * (self.router_aux_loss_coef * share * self.dims.dp)
                    mb_sums["router_aux_loss"] = float(aux.detach()) * share
                loss.backward()
                for k, v in mb_sums.items():
                    sums[k] = sums.get(k, 0.0) + v
        metrics = self._reduce_metrics(sums)
        metrics["grad_norm"] = self._optimizer_step()
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def _optimizer_step(self) -> float:
        if self.tied_group is not None and self.tied_param.grad is not None:
            grad = self.tied_param.grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            dist.all_reduce(local, group=self.tied_group)
        exclude = [self.tied_param] if self.tied_param is not None and not self.stage.is_first else []
        pp_group = self.mesh["pp"].get_group() if self.dims.pp > 1 else None
        max_norm = self.config.optim.max_grad_norm
        norm = clip_grad_norm_(self.stage.parameters(), max_norm, pp_group=pp_group, exclude=exclude)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        return norm

    def _reduce_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Sum the last stage's per-dp-rank metric sums over dp and share them with every stage."""
        if self.stage.is_last and self.dims.dp > 1:
            keys = sorted(sums)
            vec = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
            dist.all_reduce(vec, group=self.mesh["dp"].get_group())
            sums = dict(zip(keys, vec.tolist()))
        if self.dims.pp > 1:
            box = [sums if self.stage.is_last else None]
            dist.broadcast_object_list(box, group=self.mesh["pp"].get_group(), group_src=self.dims.pp - 1)
            sums = box[0]
        return sums

    # ------------------------------------------------------------------ inference
    @torch.no_grad()
    def forward(self, batch: Mapping[str, torch.Tensor], logits: bool = False) -> dict[str, torch.Tensor] | None:
        """Outputs for the given sequences (no gradients).

        Args:
            batch: dp-local rows with ``input_ids`` and ``attention_mask`` ``(B, T)``.
            logits: an LM also returns its ``logits`` ``(B, T, V)`` (``logits[:, i]`` predicts
                token ``i + 1``; 0 at padding): ``B·T·V`` floats, for small vocabularies.

        Returns:
            On last-stage ranks, CPU tensors: ``log_probs`` and ``entropy`` ``(B, T)`` float32
            for an LM (``log_probs[:, i] = log p(token i | tokens < i)``; 0 at sequence starts
            and padding); ``values`` ``(B, T)`` (0 at padding) and ``rewards`` ``(B,)`` (the
            value at each row's last valid token) for a value head. ``None`` on other ranks.
        """
        self.stage.eval()
        self.stage.return_logits = logits
        try:
            if self.runner is not None:
                out = self.runner.forward(batch)
            else:
                out = self._forward_local(batch)
        finally:
            self.stage.return_logits = True
        if out is None:
            return None
        if self.kind == "value":
            mask = batch["attention_mask"].bool()
            out["values"] = out["values"] * mask
            last = (mask.long() * torch.arange(mask.shape[1])).argmax(dim=1)
            out["rewards"] = out["values"].gather(1, last.unsqueeze(1)).squeeze(1)
        return out

    def _forward_local(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        shape = batch["attention_mask"].shape
        out: dict[str, torch.Tensor] = {}
        for mb in self._micro_batches(batch):
            named = self.run_micro_batch(mb.data)
            if not self.stage.return_logits:
                named.pop("logits", None)
            self._scatter(out, named, mb, shape)
        return out

    @staticmethod
    def _scatter(out: dict[str, torch.Tensor], named: dict[str, torch.Tensor], mb: MicroBatch, shape) -> None:
        for key, value in named.items():
            if key not in out:
                out[key] = torch.zeros((*shape, *value.shape[2:]), dtype=torch.float32)  # (B, T[, V])
            out[key][mb.indices[:, None], torch.arange(mb.col_start, mb.col_stop)] = value.float().cpu()

    # ------------------------------------------------------------------ state
    def state_dict_full(self) -> dict[str, torch.Tensor] | None:
        """The full HF state dict (CPU tensors) on the mesh's rank 0; ``None`` elsewhere. Collective."""
        return engine_state.state_dict_full(self)

    def load_state_dict_full(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load full HF weights; every rank passes the full dict and keeps its own slices."""
        engine_state.load_state_dict_full(self, state_dict)

    def save_pretrained(self, path: str) -> None:
        """Write an HF checkpoint (safetensors) loadable by plain ``from_pretrained``. Collective."""
        engine_state.save_pretrained(self, path)

    def save_checkpoint(self, path: str) -> None:
        """Save this rank's weights, optimizer and scheduler state (same strategy to resume). Collective."""
        engine_state.save_checkpoint(self, path)

    def load_checkpoint(self, path: str) -> None:
        """Resume from :meth:`save_checkpoint` written under the same strategy. Collective."""
        engine_state.load_checkpoint(self, path)


def _to_empty_keeping_ties(module: nn.Module, device: torch.device) -> None:
    """``module.to_empty(device)``, then the parameters it shared (a tied LM head) shared again:
    ``to_empty`` allocates per module and would untie them (FSDP2 re-points shared ones itself)."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for attr, param in sub._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((sub, attr))
    module.to_empty(device=device)
    for shared in places.values():
        first = getattr(shared[0][0], shared[0][1])
        for sub, attr in shared[1:]:
            setattr(sub, attr, first)
