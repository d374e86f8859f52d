"""DataProto round trip through a worker group: rlflow against verl, same echo, same machine, interleaved.

The echo of issue 12: a DataProto holding one int64 tensor ``input_ids`` of ``ROWS x COLS``
(4 MiB) is split over 2 CPU worker actors (``DP_COMPUTE_PROTO``), each worker returns its part
unchanged, and the driver concatenates the parts. Timed from the driver-side call to the
concatenated result, for:

* ``rlflow``: :class:`rlflow.controller.RayWorkerGroup`, a method registered with the defaults
  (the worker receives a private, writable copy of its part);
* ``rlflow_read_only``: the same with ``writable_inputs=False`` (the worker's part stays a view of
  the object store's memory);
* ``verl``: verl's ``RayWorkerGroup`` and ``DataProto`` (``verl.single_controller``), run in a
  subprocess under its own virtual environment (``.venv-verl``, made on first use).

Each program runs its own Ray instance with 4 CPUs. The programs alternate in ``ROUNDS`` rounds
of ``CALLS`` calls each, so that the load of a shared machine hits all of them alike; a record
gives the median over all timed calls and its ratio to verl's median, and the load average.

Run as a script with ``--verl-side`` (under verl's Python) it is verl's half: it reads ``run N``
lines on stdin and answers each with one JSON list of ``N`` call times in seconds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROWS, COLS = 1024, 512
NUM_WORKERS = 2
WARMUP = 3
ROUNDS = 8
CALLS = 8
ROOT = Path(__file__).resolve().parents[1]
VERL_VENV = ROOT / ".venv-verl"
#: verl's single controller and DataProto need these (not its training stack); versions it accepts.
VERL_PACKAGES = [
    "codetiming",
    "hydra-core",
    "dill",
    "packaging",
    "tensordict==0.10.0",
    "transformers>=5.5.3,<5.11,!=5.6.0",  # verl.protocol imports verl.utils.torch_functional
]
VERL_VERSION = "0.9.1"


# --------------------------------------------------------------------- verl's side (its own venv)
def _verl_side() -> None:
    import ray
    import torch
    from verl.protocol import DataProto
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    class VerlEcho(Worker):
        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def echo(self, data: DataProto) -> DataProto:
            return data

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    pool = RayResourcePool([NUM_WORKERS], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ray.remote(num_cpus=0.25)(VerlEcho)), device_name="cpu")
    data = DataProto.from_dict({"input_ids": torch.randint(0, 32000, (ROWS, COLS), dtype=torch.int64)})
    if not torch.equal(group.echo(data).batch["input_ids"], data.batch["input_ids"]):
        raise AssertionError("verl's echo returned different rows")
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        print(json.dumps(_timed(lambda: group.echo(data), int(line.split()[1]))), flush=True)
    ray.shutdown()


def _timed(fn, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def verl_python() -> Path:
    """verl's virtual environment's Python; builds ``.venv-verl`` when it is missing."""
    python = VERL_VENV / "bin" / "python"
    if python.exists():
        return python
    import ray
    import torch

    subprocess.run([sys.executable, "-m", "venv", str(VERL_VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--no-deps", f"verl=={VERL_VERSION}"], check=True)
    # The same torch and Ray as rlflow's side, so that only the two controllers differ.
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    subprocess.run([*pip, torch_pin, f"ray=={ray.__version__}", *VERL_PACKAGES], check=True)
    return python


class _VerlProcess:
    def __init__(self, python: Path) -> None:
        env = {**os.environ, "PYTHONPATH": ""}  # verl's side must not import this checkout's packages
        self.proc = subprocess.Popen(
            [str(python), __file__, "--verl-side"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd="/tmp",
        )
        if self._line() != "ready":
            raise RuntimeError("verl's side did not start (see its stderr above)")

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"verl's side exited with {self.proc.wait()}")
        return line.strip()

    def run(self, calls: int) -> list[float]:
        self.proc.stdin.write(f"run {calls}\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)


# --------------------------------------------------------------------- rlflow's side (this process)
def _rlflow_cases():
    """``{name: echo call}`` on one rlflow worker group of ``NUM_WORKERS`` CPU workers."""
    import ray
    import ray.cloudpickle
    import torch

    from rlflow.controller import Dispatch, RayClassWithInitArgs, RayWorkerGroup, ResourcePool, Worker, register
    from rlflow.protocol import DataProto

    class RlflowEcho(Worker):
        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def echo(self, data: DataProto) -> DataProto:
            return data

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, writable_inputs=False)
        def echo_read_only(self, data: DataProto) -> DataProto:
            return data

    # Ray workers cannot import the benchmarks package; ship the class by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    pool = ResourcePool([NUM_WORKERS], cpus_per_worker=0.25)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(RlflowEcho))
    data = DataProto.from_dict({"input_ids": torch.randint(0, 32000, (ROWS, COLS), dtype=torch.int64)})
    for out in (group.echo(data), group.echo_read_only(data)):
        if not torch.equal(out.batch["input_ids"], data.batch["input_ids"]):
            raise AssertionError("rlflow's echo returned different rows")
    return {"rlflow": lambda: group.echo(data), "rlflow_read_only": lambda: group.echo_read_only(data)}, pool


def run() -> list[dict]:
    import ray

    verl = _VerlProcess(verl_python())
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        cases, pool = _rlflow_cases()
        times: dict[str, list[float]] = {"verl": [], **{name: [] for name in cases}}
        loads = [os.getloadavg()[0]]
        verl.run(WARMUP)
        for fn in cases.values():
            _timed(fn, WARMUP)
        for _ in range(ROUNDS):
            times["verl"] += verl.run(CALLS)
            for name, fn in cases.items():
                times[name] += _timed(fn, CALLS)
            loads.append(os.getloadavg()[0])
        pool.release()
    finally:
        verl.close()
        if started:
            ray.shutdown()
    medians = {name: statistics.median(t) for name, t in times.items()}
    return [
        {
            "name": f"dataproto_echo/{name}/{ROWS}x{COLS}",
            "workers": NUM_WORKERS,
            "payload_bytes": ROWS * COLS * 8,
            "median_ms": round(medians[name] * 1e3, 2),
            "calls": len(times[name]),
            "verl_over_this": round(medians["verl"] / medians[name], 2),
            "load_avg_1min": [round(min(loads), 2), round(max(loads), 2)],
        }
        for name in times
    ]


if __name__ == "__main__":
    if "--verl-side" in sys.argv:
        _verl_side()
    else:
        for record in run():
            print(json.dumps(record))
