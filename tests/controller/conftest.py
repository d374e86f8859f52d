"""Worker classes and a shared colocated group for the controller tests.

Spawning a group costs seconds (every worker process imports torch), so one colocated group of
four workers — roles ``actor`` and ``critic`` in one process per device — serves most tests.
"""

from __future__ import annotations

import os
import sys

import pytest
import ray.cloudpickle
import torch

from rlflow.controller import (
    Dispatch,
    Execute,
    RayClassWithInitArgs,
    RayWorkerGroup,
    ResourcePool,
    Worker,
    register,
)
from rlflow.protocol import DataProto

# Ray workers cannot import test modules; ship these classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def shift_dispatch(group, x):
    """User-defined dispatch: rank r gets x + r."""
    return ([x + r for r in range(group.world_size)],), {}


def sum_collect(group, outputs):
    return sum(outputs)


class ActorWorker(Worker):
    """Records which rows each rank saw; every output row carries the rank that produced it."""

    def __init__(self, scale: int = 1) -> None:
        self.scale = scale
        self.seen: list[list[int]] = []

    def _tagged(self, data: DataProto) -> DataProto:
        self.seen.append(data.batch["id"].tolist())
        extra = {"y": data.batch["id"] * self.scale, "rank": torch.full((len(data),), self.rank)}
        inputs = data.select(batch_keys=[k for k in data.batch_keys if k not in extra])
        return inputs.union(DataProto.from_dict(extra))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self) -> dict:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "node_id": self.node_id,
            "role": self.role,
            "threads": torch.get_num_threads(),
            "pid": os.getpid(),
        }

    def double(self, x: int) -> tuple[int, int]:
        """Not registered: reachable only through execute_all / execute_rank_zero."""
        return self.rank, 2 * x

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def take_seen(self) -> list[list[int]]:
        seen, self.seen = self.seen, []
        return seen

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def add(self, x: int, y: int) -> int:
        return x + y

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def shard_sum(self, values: list[int]) -> tuple[int, int]:
        return self.rank, sum(values)

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def on_rank_zero(self, x: int) -> tuple[int, int]:
        return self.rank, x

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def broadcast_run_zero(self, x: int) -> tuple[int, int]:
        return self.rank, x

    @register(dispatch_mode=(shift_dispatch, sum_collect))
    def custom(self, x: int) -> int:
        return x * 10

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def tag(self, data: DataProto, offset: int = 0) -> DataProto:
        out = self._tagged(data)
        out.batch["y"] += offset
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def sample(self, data: DataProto, n: int) -> DataProto:
        """``n`` rows per input row, like sampling several responses per prompt."""
        return self._tagged(data).repeat(n, interleave=True)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply(self, fn, data: DataProto) -> DataProto:
        return fn(self._tagged(data))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def metric(self, data: DataProto) -> dict:
        self.seen.append(data.batch["id"].tolist())
        return {"rank": self.rank, "rows": len(data), "tokens": int(data.batch["attention_mask"].sum())}

    @register(dispatch_mode=Dispatch.MESH_PROTO)
    def mesh_tag(self, data: DataProto) -> DataProto:
        return self._tagged(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def async_tag(self, data: DataProto) -> DataProto:
        return self._tagged(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def async_sample(self, data: DataProto, n: int) -> DataProto:
        return self._tagged(data).repeat(n, interleave=True)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False, materialize_futures=False)
    def arg_type(self, data) -> DataProto:
        return DataProto.from_dict(non_tensors={"type": [type(data).__name__]})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def bump_in_place(self, data: DataProto) -> int:
        """Writes into its input in place, then sums it (allowed: inputs arrive as private copies)."""
        data.batch["id"].add_(1000)
        return int(data.batch["id"].sum())

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC, writable_inputs=False)
    def input_address(self, data: DataProto) -> int:
        """Where the input's ``id`` tensor lives in this process (reads only: a view of the object store)."""
        return data.batch["id"].data_ptr()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def local_reads(self) -> int:
        """How many future parts this process read from its own outputs (no fetch through Ray)."""
        from rlflow.controller.data_plane import local_outputs

        return local_outputs.hits

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def num_rows(self, data: DataProto) -> list[int]:
        return data.batch["id"].tolist()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"bad value on purpose at rank {rank}")
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_ranks(self, only_rank: int | None = None) -> int:
        import torch.distributed as dist

        t = torch.tensor([self.rank + 1])
        if only_rank is None or only_rank == self.rank:
            dist.all_reduce(t)
        return int(t)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def exit_on(self, rank: int) -> int:
        if self.rank == rank:
            os._exit(1)
        return self.rank


class BrokenWorker(Worker):
    def __init__(self) -> None:
        raise RuntimeError(f"cannot build on rank {self.rank}")


class CriticWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self) -> dict:
        return {"rank": self.rank, "role": self.role, "pid": os.getpid()}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def values(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"value": data.batch["id"].float() / 2})


def make_batch(num_rows: int, lengths: list[int] | None = None, seq_len: int = 16) -> DataProto:
    """Rows with ids 0..num_rows-1 and an attention mask of the given lengths (tokens)."""
    lengths = lengths or [seq_len] * num_rows
    mask = (torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None]).long()
    return DataProto.from_dict({"id": torch.arange(num_rows), "attention_mask": mask})


@pytest.fixture(scope="session")
def fused(ray_session):
    """Four workers, each one process hosting an ``actor`` and a ``critic``."""
    pool = ResourcePool([4], cpus_per_worker=0.25)
    group = RayWorkerGroup(
        pool, {"actor": RayClassWithInitArgs(ActorWorker, scale=3), "critic": RayClassWithInitArgs(CriticWorker)}
    )
    yield group
    pool.release()


@pytest.fixture(scope="session")
def actor(fused):
    return fused.spawn()["actor"]
