"""vLLM rollout engine (GPU only; ``vllm`` is imported when the engine is built, never before).

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

**Weights.** :meth:`VLLMRolloutEngine.update_weights` hands HF-named *full* tensors to the
model's own ``load_weights`` (through ``LLM.collective_rpc``), whose weight loaders cut this
rank's tensor-parallel slice and fuse q/k/v and gate/up into vLLM's merged parameters — the
layout translation stays inside vLLM. DTensors are gathered first. Nothing is re-read from
disk: built from an ``nn.Module``, the engine starts from dummy weights and receives the
module's state dict.

**Log-probs.** vLLM is asked for ``processed_logprobs`` of the sampled token: after temperature
and after top-k/top-p. Without top-k/top-p this is exactly ``old_logp`` as defined in
:mod:`rlflow.engine.rollout.base`; with them it is the log-prob under the *filtered*
distribution, and the result's ``meta_info["old_logp_filtered"]`` is True so the trainer can
recompute ``old_logp`` with an actor inference call.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rlflow.engine.rollout.base import (
    Prompts,
    RolloutCapabilities,
    SamplingParams,
    assemble_rollout,
    register_rollout_engine,
    split_prompts,
)
from rlflow.protocol import DataProto

__all__ = ["VLLMRolloutEngine", "to_vllm_sampling_params"]


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise ImportError("the 'vllm' rollout engine needs vLLM on a CUDA machine: pip install 'rlflow[vllm]'") from exc
    return vllm


def to_vllm_sampling_params(params: SamplingParams, *, seed: int | None) -> Any:
    """The ``vllm.SamplingParams`` of one request.

    Stop tokens are ours only (``ignore_eos=True``): vLLM would otherwise also stop at the
    model's EOS. Greedy is vLLM's ``temperature=0``.
    """
    vllm = _import_vllm()
    return vllm.SamplingParams(
        n=params.n,
        temperature=0.0 if params.greedy else params.temperature,
        top_p=1.0 if params.greedy else params.top_p,
        top_k=-1 if params.greedy or params.top_k == 0 else params.top_k,
        max_tokens=params.max_new_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=True,
        logprobs=0,  # only the sampled token's log-prob
        seed=seed,
        detokenize=False,
    )


def _set_launcher_env(device_mesh: DeviceMesh | None) -> tuple[int, int]:
    """``(dp, tp)`` of the mesh, after checking it spans the world; sets the env vLLM reads."""
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
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device()))
    # The engine core must live in this process so that collective_rpc reaches the model directly.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return dp, tp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _full_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    from torch.distributed.tensor import DTensor

    for name, tensor in weights:
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _model_of(worker: Any) -> nn.Module:
    return worker.model_runner.model


def _load_weights(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside vLLM's worker (same process): the model's own loaders shard and fuse."""
    worker.model_runner.model.load_weights(weights=weights)


@register_rollout_engine("vllm", RolloutCapabilities(dp=True, tp=True, pp=False, requires_gpu=True))
class VLLMRolloutEngine:
    """Rollout engine backed by ``vllm.LLM`` (module docstring for the parallel and weight contracts).

    Args:
        model: a local HF model directory, or an HF ``nn.Module`` (its config is written to a
            temporary directory, vLLM starts from dummy weights and receives the module's
            state dict).
        device_mesh: the call's ``("pp", "dp", "tp")`` mesh spanning the world; None for one GPU.
        pad_token_id: written after a row's stop token; defaults to the config's, else 0.
        dtype: vLLM's ``dtype``.
        gpu_memory_utilization: fraction of GPU memory vLLM may take (weights + KV cache).
        max_model_len: longest prompt + response; None uses the model's maximum.
        enable_sleep_mode: lets :meth:`sleep` release the KV cache and weights between calls.
        **llm_kwargs: passed to ``vllm.LLM``.
    """

    def __init__(
        self,
        model: str | os.PathLike | nn.Module,
        device_mesh: DeviceMesh | None = None,
        *,
        pad_token_id: int | None = None,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        enable_sleep_mode: bool = True,
        **llm_kwargs: Any,
    ):
        vllm = _import_vllm()
        dp, tp = _set_launcher_env(device_mesh)
        self._dp_rank = device_mesh["dp"].get_local_rank() if device_mesh is not None else 0
        module = model if isinstance(model, nn.Module) else None
        self._config_dir = None
        if module is not None:
            self._config_dir = tempfile.TemporaryDirectory(prefix="rlflow-vllm-")
            module.config.save_pretrained(self._config_dir.name)
            model_path, llm_kwargs = self._config_dir.name, {"load_format": "dummy", **llm_kwargs}
        else:
            model_path = os.fspath(model)
        self._llm = vllm.LLM(
            model=model_path,
            tensor_parallel_size=tp,
            data_parallel_size=dp,
            distributed_executor_backend="external_launcher",
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enable_sleep_mode=enable_sleep_mode,
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
            **llm_kwargs,
        )
        config = self._llm.llm_engine.model_config.hf_config
        default_pad = getattr(config, "pad_token_id", None)
        self._pad_token_id = int(pad_token_id if pad_token_id is not None else (default_pad or 0))
        if module is not None:
            self.update_weights(module.state_dict())

    @property
    def module(self) -> nn.Module:
        """vLLM's model on this rank (vLLM's own tp layout and fused parameter names)."""
        return self._llm.collective_rpc(_model_of)[0]

    def generate(self, prompts: Prompts, params: SamplingParams) -> DataProto | dict[str, torch.Tensor]:
        """See :meth:`rlflow.engine.rollout.base.RolloutEngine.generate`."""
        input_ids, attention_mask, source = split_prompts(prompts)
        requests = [{"prompt_token_ids": row[mask.bool()].tolist()} for row, mask in zip(input_ids, attention_mask)]
        base_seed = None if params.seed is None else params.seed * 1_000_003 + self._dp_rank * 65_537
        sampling = [
            to_vllm_sampling_params(params, seed=None if base_seed is None else base_seed + i)
            for i in range(len(requests))
        ]
        outputs = self._llm.generate(requests, sampling_params=sampling, use_tqdm=False)
        responses, response_mask, old_logp = self._collect(outputs, params)
        out = assemble_rollout(input_ids, attention_mask, responses, response_mask, old_logp, params.n, source)
        filtered = not params.greedy and (params.top_k > 0 or params.top_p < 1.0)
        if isinstance(out, DataProto):
            out.meta_info["old_logp_filtered"] = filtered
        return out

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

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        """Load HF-named full tensors (or DTensors, gathered here) into vLLM's model in place."""
        items = weights.items() if isinstance(weights, Mapping) else weights
        self._llm.collective_rpc(_load_weights, args=(list(_full_tensors(items)),))
        # Cached prefixes were computed with the old weights.
        self._llm.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1: weights offloaded to host; level 2: weights discarded)."""
        self._llm.sleep(level=level)

    def wake_up(self) -> None:
        self._llm.wake_up()
