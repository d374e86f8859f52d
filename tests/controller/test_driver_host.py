"""A worker hosted by the driver (``RayWorkerGroup.in_driver``): the group's methods, futures and
errors as with a Ray actor, its calls one at a time in order on a thread of this process, no Ray
object store, and nothing left behind in the process after ``shutdown``."""

from __future__ import annotations

import os
import threading
import time
import types

import pytest
import torch
from conftest import ActorWorker, BrokenWorker, CriticWorker, make_batch

from rlflow.controller import RayClassWithInitArgs, RayWorkerGroup, WorkerError, driver_host, transfer_stats
from rlflow.controller.driver_host import DRIVER_NODE_ID, DriverHost, wait


@pytest.fixture
def driver_actor():
    group = RayWorkerGroup.in_driver(RayClassWithInitArgs(ActorWorker, scale=3), role="actor")
    yield group
    group.shutdown()


def test_a_driver_hosted_group_calls_its_worker_in_this_process(driver_actor):
    who = driver_actor.whoami()
    assert who == [
        {"rank": 0, "world_size": 1, "local_rank": 0, "node_id": DRIVER_NODE_ID, "role": "actor",
         "threads": 1, "pid": os.getpid()}
    ]  # fmt: skip
    assert driver_actor.driver_hosted and driver_actor.node_ids == [DRIVER_NODE_ID]
    assert driver_actor.add([2], [5]) == [7]
    assert driver_actor.on_rank_zero(4) == (0, 4)
    assert driver_actor.execute_all("double", 21) == [(0, 42)]


def test_futures_chain_as_objects_and_nothing_goes_through_an_object_store(driver_actor):
    puts = transfer_stats.num_puts
    big = make_batch(20_000, seq_len=8)  # 1.3 MiB: a Ray group would put it into the object store
    sampled = driver_actor.async_sample(big, 2)
    tagged = driver_actor.async_tag(sampled)  # a future passed on unmaterialized
    out = tagged.get()
    assert out.batch["id"].tolist() == [i for i in range(20_000) for _ in range(2)]
    assert out.batch["y"].tolist() == [3 * i for i in range(20_000) for _ in range(2)]
    assert transfer_stats.num_puts == puts
    # A method that reads only gets the driver's own tensor; one that writes gets a copy.
    assert driver_actor.input_address(big) == [big.batch["id"].data_ptr()]
    before = big.batch["id"].clone()
    driver_actor.bump_in_place(big)
    assert torch.equal(big.batch["id"], before)


def test_a_failing_call_names_role_rank_and_method_and_the_group_goes_on(driver_actor):
    with pytest.raises(WorkerError) as info:
        driver_actor.fail_on(0)
    err = info.value
    assert (err.role, err.rank, err.method, err.node_id) == ("actor", 0, "fail_on", DRIVER_NODE_ID)
    assert "ValueError: bad value on purpose at rank 0" in err.remote_traceback
    assert driver_actor.fail_on(-1) == [0]


def _driver_threads() -> int:
    return sum(t.name == "rlflow-driver-worker" for t in threading.enumerate())


def test_a_failing_constructor_names_role_and_rank_and_leaves_no_thread():
    before = _driver_threads()
    with pytest.raises(WorkerError, match="reward.__init__ failed on worker rank 0") as info:
        RayWorkerGroup.in_driver(RayClassWithInitArgs(BrokenWorker), role="reward")
    assert "RuntimeError: cannot build on rank 0" in info.value.remote_traceback
    assert _driver_threads() == before


def test_colocated_roles_share_the_driver_hosted_worker():
    group = RayWorkerGroup.in_driver(
        {"actor": RayClassWithInitArgs(ActorWorker), "critic": RayClassWithInitArgs(CriticWorker)}
    )
    try:
        roles = group.spawn()
        assert roles["critic"].whoami() == [{"rank": 0, "role": "critic", "pid": os.getpid()}]
        values = roles["critic"].values(make_batch(4))
        assert values.batch["value"].tolist() == [0.0, 0.5, 1.0, 1.5]
    finally:
        group.shutdown()


def test_torch_distributed_and_the_thread_count_are_given_back_on_shutdown():
    import torch.distributed as dist

    threads = torch.get_num_threads()
    group = RayWorkerGroup.in_driver(RayClassWithInitArgs(ActorWorker), role="actor")
    group.init_process_group(timeout_s=30)
    assert dist.is_initialized() and group.all_reduce_ranks() == [1]
    assert torch.get_num_threads() == 1
    group.shutdown()
    assert not dist.is_initialized()
    assert torch.get_num_threads() == threads
    with pytest.raises(RuntimeError, match="was shut down"):
        group.whoami()
    # a plan of one worker may give it every core of the host (Placement.threads)
    group = RayWorkerGroup.in_driver(RayClassWithInitArgs(ActorWorker), role="actor", threads=2)
    assert group.whoami()[0]["threads"] == 2 and os.environ["OMP_NUM_THREADS"] == "2"
    group.shutdown()
    assert torch.get_num_threads() == threads


def test_driver_host_runs_calls_in_order_and_hands_errors_to_the_waiter():
    class Slow:
        def __init__(self):
            self.log, self.closed = [], False

        def step(self, i, pause=0.0):
            time.sleep(pause)
            self.log.append(i)
            return i

        def pair(self, i):
            return i, -i

        def boom(self):
            raise KeyError("boom")

        def close(self):
            self.closed = True

    host = DriverHost(Slow)
    obj = host.obj
    two, _ = host.pair.options(num_returns=2).remote(2)
    # A ref among the arguments is resolved before the call, as Ray resolves top-level refs.
    refs = [host.step.remote(0, pause=0.05), host.step.remote(1), host.step.remote(two)]
    first, second = host.pair.options(num_returns=2).remote(7)
    failed = host.boom.remote()
    wait(refs)
    assert [r.result() for r in refs] == [0, 1, 2] and obj.log == [0, 1, 2]
    assert [first.result(), second.result()] == [7, -7]
    with pytest.raises(KeyError, match="boom"):
        failed.result()
    with pytest.raises(AttributeError, match="no method 'missing'"):
        host.missing  # noqa: B018
    host.kill()
    assert obj.closed
    host.kill()  # a second kill does nothing


def _tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def test_queuing_a_call_ends_the_openmp_threads_the_queuing_thread_kept():
    # GNU OpenMP stops spinning in every team once a process keeps more pool threads than it has
    # cores: a driver's own pool would slow its worker's parallel calls for the whole run.
    if driver_host._openmp_pause() is None:
        pytest.skip("this process's OpenMP runtime has no omp_pause_resource_all")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    host = None
    try:
        before = _tasks()
        torch.ones(1 << 22).exp_()  # a parallel region on two threads: this thread's pool starts one
        pool = _tasks() - before
        assert pool, "the parallel region started no OpenMP thread"
        host = DriverHost(lambda: types.SimpleNamespace(ping=lambda: "pong"))
        assert host.ping.remote().result() == "pong"
        assert not pool & _tasks()
        torch.ones(1 << 22).exp_()  # the runtime starts the pool again at this thread's next region
        assert _tasks() - before - {str(host._thread.native_id)}
    finally:
        torch.set_num_threads(threads)
        if host is not None:
            host.kill()
