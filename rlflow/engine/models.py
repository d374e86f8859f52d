"""Loading and saving the models of RL post-training: actors (causal LMs) and critics/rewards.

Every model is a plain Hugging Face ``PreTrainedModel`` so that checkpoints stay portable:
whatever rlflow writes, ``AutoModelFor*.from_pretrained`` reads, and vice versa.

- **Actor / reference**: any causal LM, loaded with ``AutoModelForCausalLM``.
- **Critic / reward model**: a decoder backbone with a scalar head on every token — HF's
  ``AutoModelForTokenClassification`` with ``num_labels=1`` (``LlamaForTokenClassification``,
  ``Qwen2ForTokenClassification``...). Its ``logits`` of shape ``(B, T, 1)`` are the values;
  a reward model's score of a sequence is the value at its last real token
  (:func:`sequence_scores`). Using the stock HF class means ``save_pretrained`` /
  ``from_pretrained`` work unchanged and the checkpoint records its architecture.
  Classifier dropout is forced to 0: HF's default of 0.1 would make values noisy in training.
  A ``*ForSequenceClassification`` checkpoint with one label (a TRL reward model) loads as this
  form too: its ``score`` is the same linear map of the last hidden state, without a bias (a
  zero one here), and HF scores it at the last non-pad token, which :func:`sequence_scores` picks.

Saving always goes through ``save_pretrained`` (safetensors) into a temporary directory
next to the target that is then renamed into place, so a crash never leaves a half-written
checkpoint under the final name.
"""

from __future__ import annotations

import copy
import inspect
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, PretrainedConfig
from transformers.utils import logging as hf_logging

from rlflow.engine.packing import position_ids_from_mask

if TYPE_CHECKING:  # HF's modeling_utils (and torch._dynamo under it) loads with the first model, not here
    from transformers import PreTrainedModel

__all__ = [
    "cache_kwarg",
    "build_value_model",
    "is_sequence_classification",
    "compute_values",
    "init_value_model_from_lm",
    "load_causal_lm",
    "resolve_dtype",
    "save_model",
    "sequence_scores",
]

_VALUE_HEAD_KEYS = ("score.weight", "score.bias")
# The head entry a sequence-classification checkpoint lacks (its ``score`` has no bias).
SEQUENCE_HEAD_BIAS = "score.bias"


def is_sequence_classification(config: PretrainedConfig) -> bool:
    """Whether ``config.architectures`` names a ``*ForSequenceClassification`` (a TRL-style reward model)."""
    return any(arch.endswith("ForSequenceClassification") for arch in (getattr(config, "architectures", None) or []))


def cache_kwarg(fn) -> str:
    """The name ``fn`` (a model's ``forward``, HF's mask builders) takes the KV cache under:
    ``cache`` in newer transformers, ``past_key_values`` before (``pyproject`` admits both)."""
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.bfloat16`` or ``"bfloat16"``/``"bf16"`` → ``torch.bfloat16`` (same for fp16/fp32/fp64)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "fp64": "float64"}
    resolved = getattr(torch, aliases.get(dtype, dtype), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not a floating-point torch dtype (e.g. 'bfloat16', 'float32')")
    return resolved


def _check_model_dir(path: str | Path) -> Path:
    """Fail early, naming the path, instead of deep inside ``from_pretrained`` (which may try the hub)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ValueError(f"model path {str(path)!r} is not a Hugging Face model directory (no config.json)")
    return path


def load_causal_lm(
    path: str | Path,
    *,
    dtype: torch.dtype | str = torch.float32,
    attn_implementation: str | None = None,
    device: torch.device | str | None = None,
) -> PreTrainedModel:
    """Load any local HF causal LM (actor, reference policy).

    Args:
        path: directory written by ``save_pretrained`` (config.json + safetensors).
        dtype: parameter dtype.
        attn_implementation: ``"sdpa"``, ``"eager"``, ``"flash_attention_2"``...; None lets HF pick.
        device: where to put the model; None leaves it on CPU.

    Returns:
        The model in eval mode.

    Raises:
        FileNotFoundError / ValueError: naming ``path`` when it is missing or not a model directory.
    """
    path = _check_model_dir(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=resolve_dtype(dtype), attn_implementation=attn_implementation, local_files_only=True
        )
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a causal LM from {str(path)!r}: {exc}") from exc
    return model.to(device).eval() if device is not None else model.eval()


def _value_config(config: PretrainedConfig) -> PretrainedConfig:
    config = copy.deepcopy(config)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    return config


def build_value_model(
    path_or_config: str | Path | PretrainedConfig,
    *,
    dtype: torch.dtype | str = torch.float32,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """Build a critic/reward model: decoder backbone + one scalar per token.

    Args:
        path_or_config: a saved value model directory (e.g. written by :func:`save_model`), or a
            config of the backbone (a causal-LM config works: it is copied and given
            ``num_labels=1``) for a freshly initialised model.
        dtype: parameter dtype.
        attn_implementation: as in :func:`load_causal_lm`.

    Returns:
        An ``AutoModelForTokenClassification`` instance whose ``logits`` are ``(B, T, 1)``.

    A ``*ForSequenceClassification`` directory with one label loads with a zero head bias.

    Raises:
        ValueError: when the directory holds a causal LM — use :func:`init_value_model_from_lm`,
            which says explicitly how the new head is initialised — or a sequence classifier of
            more than one label.
    """
    dtype = resolve_dtype(dtype)
    if isinstance(path_or_config, PretrainedConfig):
        config = _value_config(path_or_config)
        model = AutoModelForTokenClassification.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation
        )
        return model.eval()
    path = _check_model_dir(path_or_config)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if any(arch.endswith("ForCausalLM") for arch in (config.architectures or [])):
        raise ValueError(
            f"{str(path)!r} holds a causal LM ({config.architectures}), not a value model; "
            "use init_value_model_from_lm() to start a critic from it"
        )
    if not is_sequence_classification(config):
        model = AutoModelForTokenClassification.from_pretrained(
            path,
            config=_value_config(config),
            dtype=dtype,
            attn_implementation=attn_implementation,
            local_files_only=True,
        )
        return model.eval()
    if config.num_labels != 1:
        raise ValueError(
            f"{str(path)!r} is a sequence classifier of {config.num_labels} labels; a reward model has one"
        )
    # The head's bias is "missing" by design: silence HF's report, check the missing keys ourselves.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = AutoModelForTokenClassification.from_pretrained(
            path,
            config=_value_config(config),
            dtype=dtype,
            attn_implementation=attn_implementation,
            local_files_only=True,
            output_loading_info=True,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = sorted(set(info.get("missing_keys", ())) - {SEQUENCE_HEAD_BIAS})
    if missing:
        raise ValueError(f"weights missing from {str(path)!r}: {missing}")
    if model.score.bias is not None:
        with torch.no_grad():
            model.score.bias.zero_()
    return model.eval()


def init_value_model_from_lm(
    lm_path: str | Path,
    *,
    dtype: torch.dtype | str = torch.float32,
    attn_implementation: str | None = None,
    head_init_std: float = 0.0,
) -> PreTrainedModel:
    """A critic whose backbone is the actor's, with a fresh scalar head.

    Args:
        lm_path: directory of a causal LM (the actor's starting point).
        dtype, attn_implementation: as in :func:`load_causal_lm`.
        head_init_std: std of the head's normal init; 0 (the default) zero-initialises it so the
            critic starts by predicting 0 everywhere and the first PPO steps are not driven by
            random value estimates. The bias is always zero.

    Raises:
        ValueError: when a backbone weight is missing from the checkpoint (only the head may be).
    """
    path = _check_model_dir(lm_path)
    config = _value_config(AutoConfig.from_pretrained(path, local_files_only=True))
    # The LM head is "unexpected" and the value head "missing" by design: silence HF's report
    # and check the missing keys ourselves instead.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = AutoModelForTokenClassification.from_pretrained(
            path,
            config=config,
            dtype=resolve_dtype(dtype),
            attn_implementation=attn_implementation,
            local_files_only=True,
            output_loading_info=True,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = sorted(set(info.get("missing_keys", ())) - set(_VALUE_HEAD_KEYS))
    if missing:
        raise ValueError(f"backbone weights missing from {str(path)!r}: {missing}")
    with torch.no_grad():
        if head_init_std > 0:
            model.score.weight.normal_(mean=0.0, std=head_init_std)
        else:
            model.score.weight.zero_()
        if model.score.bias is not None:
            model.score.bias.zero_()
    return model.eval()


def compute_values(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token values of a value model.

    Args:
        model: a model built by :func:`build_value_model` / :func:`init_value_model_from_lm`.
        input_ids: ``(B, T)``.
        attention_mask: ``(B, T)``.
        position_ids: ``(B, T)``; defaults to positions counted over the valid tokens, which is
            what left-padded generation used.

    Returns:
        ``(B, T)`` float32 values (padding positions hold whatever the model computed there).
    """
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.logits.squeeze(-1).float()


def sequence_scores(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The value at the last real token of every row — a reward model's sequence score.

    Args:
        values: ``(B, T)`` per-token values.
        attention_mask: ``(B, T)``, 1 for real tokens; padding may be on either side.

    Returns:
        ``(B,)`` scores, same dtype as ``values``.

    >>> sequence_scores(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), torch.tensor([[0, 1, 1], [1, 1, 0]]))
    tensor([3., 5.])
    """
    if values.shape != attention_mask.shape or values.dim() != 2:
        raise ValueError(
            f"values {tuple(values.shape)} and attention_mask {tuple(attention_mask.shape)} must be (B, T)"
        )
    mask = attention_mask.bool()
    empty = ~mask.any(dim=1)
    if empty.any():
        raise ValueError(f"rows {empty.nonzero().flatten().tolist()} have no real token (all-zero attention_mask)")
    seq_len = mask.shape[1]
    # argmax returns the first maximum: on the flipped mask that is the last real token.
    last = seq_len - 1 - mask.flip(dims=[1]).int().argmax(dim=1)
    return values.gather(1, last.unsqueeze(1)).squeeze(1)


def save_model(model: PreTrainedModel, path: str | Path, *, tokenizer=None) -> Path:
    """Write ``model`` (and optionally its tokenizer) with ``save_pretrained``, atomically.

    The files go to a temporary directory beside ``path`` that is renamed to ``path`` once
    complete; an existing ``path`` is replaced only after the new checkpoint is whole.

    Args:
        model: a plain (unsharded) HF model; gather FSDP/TP shards into a full model first.
        path: target directory.
        tokenizer: anything with ``save_pretrained`` (optional).

    Returns:
        ``path`` as a ``Path``.
    """
    from torch.distributed.tensor import DTensor

    sharded = [name for name, p in model.named_parameters() if isinstance(p, DTensor)]
    if sharded:
        raise ValueError(f"save_model needs full tensors; {len(sharded)} parameters are DTensors, e.g. {sharded[0]!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if path.exists():
            old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
