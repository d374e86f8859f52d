"""Offloading a module's tensors to host memory and back, keeping every tensor object valid.

The module's tensors are not replaced: each underlying storage is copied to a host buffer
and then resized to zero bytes, which frees it (on CUDA, back to the caching allocator; on
CPU, to the system). Reloading resizes the storage back and copies the bytes in. Because
the tensor objects, their views and their wrappers stay the same, this works unchanged for
plain parameters, DTensor parameters (their local tensors), FSDP2's sharded parameters
(views of a padded flat storage), gradients and optimizer states — and the optimizer keeps
referring to the same tensors. (FSDP1 frees its flat parameters the same way.)

On CUDA the host buffers are pinned and :meth:`Offload.reload` can copy layer by layer on a
side stream, each layer's forward waiting (``wait_event``) only for its own weights, so the
reload of later layers overlaps the compute of the first ones. On CPU the copies run at
once; the round trip is still real (the module's storage is freed in between).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


@dataclass
class _Slot:
    """One storage and its host copy."""

    storage: torch.UntypedStorage
    nbytes: int
    device: torch.device
    host: torch.Tensor  # uint8 (nbytes,)


def _as_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))


def _layer_groups(module: nn.Module) -> list[tuple[nn.Module | None, list[torch.Tensor]]]:
    """Parameters grouped by the module whose forward first needs them: each decoder layer, and
    one group (``None``: before the forward) for the rest."""
    groups: list[tuple[nn.Module | None, list[torch.Tensor]]] = []
    seen: set[int] = set()
    for _, container in module.named_modules():
        if isinstance(container, (nn.ModuleList, nn.ModuleDict)):
            for layer in container.children() if isinstance(container, nn.ModuleList) else container.values():
                params = [p for p in layer.parameters() if id(p) not in seen]
                seen.update(id(p) for p in params)
                if params:
                    groups.append((layer, params))
    rest = [p for p in module.parameters() if id(p) not in seen]
    return [(None, rest), *groups] if rest else groups


class Offload:
    """Tensors of a module (and optionally its grads, buffers and optimizer state) moved to host.

    Build with :func:`offload_module`; bring back with :meth:`reload`.
    """

    def __init__(self, groups: list[tuple[nn.Module | None, list[torch.Tensor]]], pin: bool) -> None:
        self._groups: list[tuple[nn.Module | None, list[_Slot]]] = []
        self._hooks: list = []
        self._last_event = None
        self.offloaded = False
        seen: set[int] = set()
        for owner, tensors in groups:
            slots = []
            for t in tensors:
                storage = _local(t).untyped_storage()
                key = storage.data_ptr()
                if storage.nbytes() == 0 or key in seen:  # empty shards; storages shared by views or ties
                    continue
                seen.add(key)
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                slots.append(_Slot(storage, storage.nbytes(), _local(t).device, host))
            self._groups.append((owner, slots))

    @property
    def nbytes(self) -> int:
        """Bytes held on the host while offloaded."""
        return sum(s.nbytes for _, slots in self._groups for s in slots)

    def _slots(self) -> Iterable[_Slot]:
        return (s for _, slots in self._groups for s in slots)

    def offload(self) -> None:
        """Copy every storage to its host buffer and free it (synchronous)."""
        if self.offloaded:
            raise RuntimeError("the module is already offloaded")
        self._remove_hooks()
        self.wait_reloaded()
        for s in self._slots():
            s.host.copy_(_as_bytes(s.storage, s.device), non_blocking=s.device.type == "cuda")
        if any(s.device.type == "cuda" for s in self._slots()):
            torch.cuda.current_stream().synchronize()  # the host copies must land before the storage goes
        for s in self._slots():
            s.storage.resize_(0)
        self.offloaded = True

    def reload(self, overlap_forward: bool = False) -> None:
        """Give every storage its memory back and copy the host bytes in.

        Args:
            overlap_forward: CUDA only: copy on a side stream, group by group in forward
                order, and make each decoder layer's forward wait for its own weights only
                (a one-shot forward pre-hook), so the reload overlaps the first layers'
                compute. Without it (and always on CPU) the copies finish before returning.
        """
        if not self.offloaded:
            raise RuntimeError("the module is not offloaded")
        for s in self._slots():
            s.storage.resize_(s.nbytes)
        cuda = any(s.device.type == "cuda" for s in self._slots())
        if cuda and overlap_forward:
            self._reload_overlapped()
        else:
            for s in self._slots():
                _as_bytes(s.storage, s.device).copy_(s.host, non_blocking=cuda)
            if cuda:
                torch.cuda.current_stream().synchronize()
        self.offloaded = False

    def _reload_overlapped(self) -> None:
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        side.wait_stream(main)  # the storages were just re-allocated on the main stream
        self._last_event = None
        for owner, slots in self._groups:
            with torch.cuda.stream(side):
                for s in slots:
                    _as_bytes(s.storage, s.device).copy_(s.host, non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
            self._last_event = event
            if owner is None:  # weights used before the first layer (embedding, ...): wait now
                main.wait_event(event)
            else:  # a layer waits for its own weights when its forward starts
                self._hooks.append(owner.register_forward_pre_hook(_wait_for(event)))

    def wait_reloaded(self) -> None:
        """Make the current stream wait for every copy of an overlapped reload (before using the
        weights outside a layer forward, e.g. reading a state dict)."""
        if self._last_event is not None:
            torch.cuda.current_stream().wait_event(self._last_event)

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _wait_for(event):
    def hook(module: nn.Module, args) -> None:
        # Waiting again after the copies are done (later forwards) costs only the event query.
        torch.cuda.current_stream().wait_event(event)

    return hook


def offload_module(
    module: nn.Module,
    *,
    grads: bool = False,
    buffers: bool = False,
    optimizer: torch.optim.Optimizer | None = None,
) -> Offload:
    """Move ``module``'s parameters (and optionally more) to host memory, freeing their storage.

    Args:
        module: any module; DTensor / FSDP2 parameters are offloaded as their local shards
            (FSDP2 modules should be resharded, as they are between steps).
        grads: also offload the parameters' ``.grad`` tensors.
        buffers: also offload buffers (e.g. rotary tables).
        optimizer: also offload this optimizer's state tensors (moments).

    Returns:
        The :class:`Offload`; call ``reload()`` before the module is used again.

    >>> m = nn.Linear(4, 4); w = m.weight.detach().clone()
    >>> handle = offload_module(m); m.weight.untyped_storage().nbytes()
    0
    >>> handle.reload(); torch.equal(m.weight, w)
    True
    """
    groups = _layer_groups(module)
    extra: list[torch.Tensor] = []
    if grads:
        extra += [p.grad for p in module.parameters() if p.grad is not None]
    if buffers:
        extra += list(module.buffers())
    if optimizer is not None:
        extra += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    if extra:
        groups.insert(0, (None, extra))
    pin = torch.cuda.is_available() and any(_local(t).is_cuda for _, ts in groups for t in ts)
    handle = Offload(groups, pin)
    handle.offload()
    return handle
