"""Single controller: round trip of an echo call on a 4-worker group, and payload bytes through the driver.

For a DataProto of ``rows x cols`` int64 it times (median of ``CALLS`` rounds after warm-up; the
cases alternate call by call so that the load of a shared machine hits all of them alike):

* ``dp_compute_proto``: the batch split over 4 ranks, each echoes its part, parts concatenated;
* ``one_to_all``: every rank gets (and echoes) the whole batch; the driver receives 4 copies;
* ``chained_future``: a non-blocking DP_COMPUTE_PROTO call fed with the previous call's future,
  waited for without fetching (the payload stays in the object store);
* baselines on 4 plain Ray actors: ``plain_ray_full`` calls each with the full DataProto as
  argument; ``plain_ray_split`` is the hand-written dp call (split, one part per actor, concat).

Bytes through the driver are counted by the controller (:data:`rlflow.controller.transfer_stats`:
tensor bytes it puts or sends inline, and fetches); for the plain-Ray baselines Ray serialises
each call's argument once and the driver fetches every output.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import ray
import ray.cloudpickle
import torch

from rlflow.controller import (
    Dispatch,
    RayClassWithInitArgs,
    RayWorkerGroup,
    ResourcePool,
    Worker,
    register,
    transfer_stats,
)
from rlflow.controller.data_plane import payload_nbytes
from rlflow.protocol import DataProto

SHAPES = [(8, 128), (1024, 512)]
NUM_WORKERS = 4
WARMUP = 3
CALLS = 25

# Ray workers cannot import the benchmarks package; ship these classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class EchoWorker(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def echo_dp(self, data: DataProto) -> DataProto:
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def echo_all(self, data: DataProto) -> DataProto:
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def echo_async(self, data: DataProto) -> DataProto:
        return data


class PlainEcho:
    def echo(self, data: DataProto) -> DataProto:
        return data


def _interleaved_medians(cases: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Median seconds per case; cases alternate call by call so that load drift hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(WARMUP + CALLS):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            if i >= WARMUP:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _bytes_per_call(fn: Callable[[], object], calls: int = 5) -> tuple[float, float]:
    transfer_stats.reset()
    for _ in range(calls):
        fn()
    return transfer_stats.sent_bytes / calls, transfer_stats.received_bytes / calls


def _cases(group: RayWorkerGroup, plain: list, data: DataProto) -> tuple[dict[str, Callable[[], object]], dict]:
    """The timed calls by name, and the state of the future chain."""
    state = {"future": group.echo_async(data)}

    def chained_hop() -> None:
        # The next call consumes the previous future; wait for it without fetching anything.
        state["future"] = group.echo_async(state["future"])
        ray.wait(state["future"].refs, num_returns=len(state["future"].refs), fetch_local=False)

    def plain_split() -> DataProto:
        # What a hand-written Ray program does for a dp call: split, one call per actor, concatenate.
        parts = data.split_even(len(plain))
        return DataProto.concat(ray.get([a.echo.remote(p) for a, p in zip(plain, parts)]))

    return {
        "dp_compute_proto": lambda: group.echo_dp(data),
        "one_to_all": lambda: group.echo_all(data),
        "chained_future": chained_hop,
        "plain_ray_split": plain_split,
        "plain_ray_full": lambda: ray.get([a.echo.remote(data) for a in plain]),
    }, state


#: Which plain-Ray program does the same work as each controller call.
BASELINE = {
    "dp_compute_proto": "plain_ray_split",
    "chained_future": "plain_ray_split",
    "one_to_all": "plain_ray_full",
    "plain_ray_split": "plain_ray_split",
    "plain_ray_full": "plain_ray_full",
}


def _records(group: RayWorkerGroup, plain: list, rows: int, cols: int) -> list[dict]:
    data = DataProto.from_dict({"input_ids": torch.randint(0, 32000, (rows, cols), dtype=torch.int64)})
    payload = payload_nbytes(data)
    cases, state = _cases(group, plain, data)
    seconds = _interleaved_medians(cases)
    # Ray serialises a plain call's argument once per call and the driver fetches every output.
    known = {"plain_ray_split": (payload, payload), "plain_ray_full": (len(plain) * payload,) * 2}
    if not torch.equal(state["future"].get().batch["input_ids"], data.batch["input_ids"]):
        raise AssertionError("the chained echo returned different rows")
    records = []
    for name, fn in cases.items():
        sent, received = known.get(name) or _bytes_per_call(fn)
        records.append(
            {
                "name": f"controller/{name}/{rows}x{cols}",
                "workers": NUM_WORKERS,
                "payload_bytes": payload,
                "median_ms": round(seconds[name] * 1e3, 3),
                "calls": CALLS,
                "driver_sent_bytes_per_call": int(sent),
                "driver_received_bytes_per_call": int(received),
                "driver_bytes_over_payload": round((sent + received) / payload, 3),
                "baseline": BASELINE[name],
                "time_vs_baseline": round(seconds[name] / seconds[BASELINE[name]], 3),
                "time_vs_plain_ray_full": round(seconds[name] / seconds["plain_ray_full"], 3),
            }
        )
    return records


def run() -> list[dict]:
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    pool = ResourcePool([NUM_WORKERS], cpus_per_worker=0.25)
    try:
        group = RayWorkerGroup(pool, RayClassWithInitArgs(EchoWorker))
        plain_cls = ray.remote(num_cpus=0.25)(PlainEcho)
        plain = [plain_cls.remote() for _ in range(NUM_WORKERS)]
        # Start every process (imports of torch and tensordict) before timing anything.
        warm = DataProto.from_dict({"input_ids": torch.zeros(1, 1, dtype=torch.int64)})
        ray.get([a.echo.remote(warm) for a in plain])
        group.echo_dp(warm)
        records = [r for rows, cols in SHAPES for r in _records(group, plain, rows, cols)]
        for actor in plain:
            ray.kill(actor)
        return records
    finally:
        pool.release()
        if started:
            ray.shutdown()


if __name__ == "__main__":
    import json

    for record in run():
        print(json.dumps(record))
