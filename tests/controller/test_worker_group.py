"""Worker group life cycle: torch.distributed, failures, resource checks, and a two-node cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import ray
from conftest import ActorWorker, BrokenWorker

from rlflow.controller import (
    RayClassWithInitArgs,
    RayWorkerGroup,
    ResourceError,
    ResourcePool,
    WorkerDiedError,
    WorkerError,
)


@pytest.mark.distributed
def test_torch_distributed_all_reduce_across_four_workers(fused):
    fused.actor_init_process_group(timeout_s=60)
    fused.critic_init_process_group(timeout_s=60)  # colocated role: same process, no second group
    assert fused.actor_all_reduce_ranks() == [sum(r + 1 for r in range(4))] * 4


def test_worker_exception_names_role_rank_node_and_traceback(actor):
    with pytest.raises(WorkerError) as info:
        actor.fail_on(2)
    err = info.value
    assert (err.role, err.rank, err.method, err.node_id) == ("actor", 2, "fail_on", actor.node_ids[2])
    assert "actor.fail_on failed on worker rank 2" in str(err)
    assert "ValueError: bad value on purpose at rank 2" in err.remote_traceback
    assert "in fail_on" in err.remote_traceback
    assert actor.fail_on(-1) == [0, 1, 2, 3]  # the group stays usable


def test_failing_constructor_names_role_and_rank(ray_session):
    with ResourcePool([1]) as pool, pytest.raises(WorkerError, match="reward.__init__ failed on worker rank 0") as info:
        RayWorkerGroup(pool, RayClassWithInitArgs(BrokenWorker), role="reward")
    assert "RuntimeError: cannot build on rank 0" in info.value.remote_traceback


def test_oversized_pools_fail_at_once_saying_what_was_asked(ray_session):
    cases = [
        (dict(process_on_nodes=[1000]), r"process_on_nodes=\[1000\].*CPU.*the Ray cluster has 1 alive node"),
        (dict(process_on_nodes=[2], use_gpu=True), r"'GPU': 1.0.*0 GPU"),
        (dict(process_on_nodes=[1, 1]), r"on distinct nodes, but the Ray cluster has 1 alive node"),
    ]
    for kwargs, message in cases:
        start = time.monotonic()
        with pytest.raises(ResourceError, match=message):
            ResourcePool(**kwargs)
        assert time.monotonic() - start < 5
    with pytest.raises(ValueError, match="process_on_nodes=\\[0\\]"):
        ResourcePool([0])


def test_second_group_on_full_bundles_fails_instead_of_waiting(ray_session):
    with ResourcePool([1], max_colocate_count=1) as pool:
        pool.claim()  # as a first worker group does
        with pytest.raises(ResourceError, match="max_colocate_count=1"):
            RayWorkerGroup(pool, RayClassWithInitArgs(ActorWorker))


def test_pool_that_fits_but_cannot_be_placed_times_out(ray_session):
    free_cpus = ray.available_resources().get("CPU", 0)
    hog = ResourcePool([1], cpus_per_worker=free_cpus - 0.5, ready_timeout_s=30)
    try:
        with pytest.raises(ResourceError, match="not placed within 2 s"):
            # 2 CPUs: room for the lag of Ray's free-resource view after earlier pools were released.
            ResourcePool([1], cpus_per_worker=2.0, ready_timeout_s=2)
    finally:
        hog.release()


@pytest.fixture(scope="module")
def doomed(ray_session):
    """Two workers that the tests below break on purpose."""
    with ResourcePool([2], cpus_per_worker=0.25) as pool:
        group = RayWorkerGroup(pool, RayClassWithInitArgs(ActorWorker), role="actor")
        group.init_process_group(timeout_s=3)
        yield group


@pytest.mark.distributed
def test_hung_collective_raises_after_the_timeout(doomed):
    start = time.monotonic()
    with pytest.raises(WorkerError, match="(?s)rank 0.*Timed out"):
        doomed.all_reduce_ranks(only_rank=0)  # rank 1 never joins the all_reduce
    assert time.monotonic() - start < 30


def test_dead_worker_is_named_within_30s(doomed):
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(roles actor") as info:
        doomed.exit_on(1)
    assert info.value.rank == 1 and time.monotonic() - start < 30
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"worker rank 1"):
        doomed.whoami()  # later calls fail fast too
    # SIGKILL, as the OOM killer would. (ray.kill is asynchronous: a call sent right after it
    # could still run on the live actor.) Wait until the process is gone before calling.
    pid = doomed.view([0]).whoami()[0]["pid"]
    os.kill(pid, signal.SIGKILL)
    while _alive(pid):
        assert time.monotonic() - start < 30, f"worker process {pid} outlived SIGKILL"
        time.sleep(0.05)
    with pytest.raises(WorkerDiedError, match=r"worker rank 0"):
        doomed.view([0]).whoami()
    assert time.monotonic() - start < 30


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie (state Z) waits for its parent, but is dead
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


_TWO_NODES = textwrap.dedent(
    """
    import json, ray
    from ray.cluster_utils import Cluster
    from rlflow.controller import Dispatch, RayClassWithInitArgs, RayWorkerGroup, ResourceError, ResourcePool, Worker, register

    class Probe(Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def where(self):
            import torch, torch.distributed as dist
            t = torch.tensor([self.rank + 1])
            dist.all_reduce(t)
            return {"rank": self.rank, "node_id": self.node_id, "ray_node": ray.get_runtime_context().get_node_id(),
                    "sum": int(t)}

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        ResourcePool([1, 1, 1])
    except ResourceError as err:
        too_many = str(err)
    pool = ResourcePool([1, 1], cpus_per_worker=0.5)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(Probe))
    group.init_process_group(timeout_s=60)
    print("RESULT" + json.dumps({"workers": group.where(), "pool_nodes": pool.node_ids, "too_many": too_many}))
    ray.shutdown()
    cluster.shutdown()
    """
)


@pytest.mark.distributed
def test_two_node_cluster_places_one_worker_per_node():
    proc = subprocess.run([sys.executable, "-c", _TWO_NODES], capture_output=True, text=True, timeout=240)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[0][len("RESULT") :])
    workers = result["workers"]
    assert [w["rank"] for w in workers] == [0, 1]
    assert workers[0]["node_id"] != workers[1]["node_id"]
    assert [w["node_id"] for w in workers] == [w["ray_node"] for w in workers] == result["pool_nodes"]
    assert [w["sum"] for w in workers] == [3, 3]  # gloo all_reduce across the two nodes
    assert "the Ray cluster has 2 alive node(s)" in result["too_many"]
