"""The router's auxiliary (load-balancing) loss of a mixture-of-experts model, as HF computes it.

An HF MoE causal LM (Qwen3-MoE, Mixtral …) trained with ``output_router_logits=True`` adds
``router_aux_loss_coef * load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)``
to its loss. A training engine's stage runs the decoder layers itself, not the HF model's
forward, so :class:`RouterLogitsRecorder` collects the router logits with forward hooks on the
modules HF records them from (the model class's ``_can_record_outputs["router_logits"]``), and
:func:`router_aux_loss` calls the model's own ``load_balancing_loss_func`` over them.

Padding: the loss counts the real tokens of a micro-batch only (HF's ``attention_mask``); a packed
row holds real tokens only, so it needs no mask.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["RouterLogitsRecorder", "is_moe", "resolve_router_aux_loss_coef", "router_aux_loss"]

_NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts")


def _num_experts(config: Any) -> int | None:
    for key in _NUM_EXPERTS_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def is_moe(config: Any) -> bool:
    """Whether ``config`` is a mixture-of-experts model with a router auxiliary loss
    (``num_experts`` or ``num_local_experts``, and ``router_aux_loss_coef``)."""
    return _num_experts(config) is not None and getattr(config, "router_aux_loss_coef", None) is not None


def resolve_router_aux_loss_coef(config: Any, override: float | None, where: str = "router_aux_loss_coef") -> float:
    """The coefficient a model trains with: ``override`` where given, else the model config's; 0 for a dense model.

    Raises:
        ValueError: a negative ``override``, or a positive one for a model without a router (naming ``where``).
    """
    if override is not None and override < 0:
        raise ValueError(f"{where}={override} must be >= 0")
    if not is_moe(config):
        if override:
            raise ValueError(
                f"{where}={override}: model_type={getattr(config, 'model_type', None)!r} has no router "
                f"(no {' / '.join(_NUM_EXPERTS_KEYS)} and router_aux_loss_coef in its config); use 0 or null"
            )
        return 0.0
    return float(config.router_aux_loss_coef if override is None else override)


def _loss_function(causal_lm_class: type) -> Callable:
    fn = getattr(sys.modules[causal_lm_class.__module__], "load_balancing_loss_func", None)
    if fn is None:
        raise ValueError(f"{causal_lm_class.__name__}'s module defines no load_balancing_loss_func")
    return fn


class RouterLogitsRecorder:
    """Forward hooks that collect a stage's router logits while :meth:`recording` is active.

    Hooks stay registered but record nothing outside the block, so a forward without the loss
    (inference) and the recomputation of checkpointed layers in backward add nothing.

    Args:
        module: the stage (or model) whose router modules to hook.
        causal_lm_class: the HF model class; its ``_can_record_outputs["router_logits"]`` names the
            router module class and which output holds the logits.

    Raises:
        ValueError: the class records no router logits, or ``module`` holds none of its routers.
    """

    def __init__(self, module: nn.Module, causal_lm_class: type) -> None:
        recorder = (getattr(causal_lm_class, "_can_record_outputs", None) or {}).get("router_logits")
        target = getattr(recorder, "target_class", None)
        if target is None:
            raise ValueError(
                f"{causal_lm_class.__name__} records no router_logits (_can_record_outputs): its router "
                "auxiliary loss cannot be computed; set router_aux_loss_coef to 0"
            )
        self.index = recorder.index
        self.loss_fn = _loss_function(causal_lm_class)
        self.logits: list[torch.Tensor] | None = None
        routers = [m for m in module.modules() if isinstance(m, target)]
        if not routers:
            raise ValueError(f"the stage holds no {target.__name__} module to record router logits from")
        self.handles = [m.register_forward_hook(self._hook) for m in routers]

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.logits is not None:
            self.logits.append(output[self.index] if isinstance(output, tuple) else output)

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """Collect the router logits ``(tokens, num_experts)`` of every router run inside the block, in order."""
        self.logits = logits = []
        try:
            yield logits
        finally:
            self.logits = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def router_aux_loss(
    recorder: RouterLogitsRecorder,
    config: Any,
    logits: list[torch.Tensor],
    attention_mask: torch.Tensor | None,
) -> torch.Tensor:
    """HF's load-balancing loss over ``logits`` (one ``(tokens, num_experts)`` tensor per MoE layer).

    Args:
        recorder: what collected them (carries the model's ``load_balancing_loss_func``).
        config: the HF config (``num_experts`` / ``num_local_experts``, ``num_experts_per_tok``).
        logits: the collected router logits.
        attention_mask: ``(B, T)`` with 1 on real tokens, the rows ``logits`` flatten; ``None``
            when every row is a real token (a packed row).

    Returns:
        A float32 scalar.
    """
    if not logits:
        raise ValueError("no router logits were recorded: the forward ran no router")
    loss = recorder.loss_fn(tuple(logits), _num_experts(config), config.num_experts_per_tok, attention_mask)
    return loss.float()
