"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


@pytest.fixture(scope="module")
def single_mesh() -> DeviceMesh:
    """A one-process gloo world and its ``("pp", "dp", "tp")`` mesh of one rank, for a module's tests."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", torch.zeros(1, 1, 1, dtype=torch.long), mesh_dim_names=("pp", "dp", "tp"))
    finally:
        dist.destroy_process_group()
