"""The local Ray a run starts: its workers get the worker environment without a job runtime env,
so the first actors start in the Python workers Ray prestarted (Ray imported, no process to spawn)
and the driver's own environment is left as it was.

Runs in a subprocess: the test session's shared Ray (``ray_session``) must not be the one checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import json, os, time
    import psutil, ray
    from rlflow.trainer import build, load_config

    cfg = load_config(None, ["placement.devices_per_node=1"])
    before = {k: os.environ.get(k) for k in build.WORKER_ENV}
    started = build.ensure_ray(cfg)
    after = {k: os.environ.get(k) for k in build.WORKER_ENV}
    session = ray._private.worker._global_node.get_session_dir_path()
    raylet = next(p for p in psutil.process_iter(["cmdline"]) if any("raylet/raylet" in c for c in p.info["cmdline"] or ())
                  and any(session in c for c in p.info["cmdline"]))
    deadline, idle = time.time() + 60, set()
    while not idle and time.time() < deadline:  # Ray prestarts them as the driver connects
        idle = {c.pid for c in raylet.children() if "ray::IDLE" in " ".join(c.cmdline())}
        time.sleep(0.2)

    @ray.remote(num_cpus=1)
    class Probe:
        def look(self):
            return os.getpid(), {k: os.environ.get(k) for k in build.WORKER_ENV}

    pid, env = ray.get(Probe.remote().look.remote())
    print(json.dumps({"started": started, "before": before, "after": after, "idle": sorted(idle),
                      "actor_pid": pid, "actor_env": env}))
    ray.shutdown()
    """
)  # fmt: skip


@pytest.mark.timeout(180)
def test_a_local_ray_passes_the_worker_env_and_its_first_actor_takes_a_prestarted_worker():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAY_ADDRESS")}
    env["TOKENIZERS_PARALLELISM"] = "true"  # the driver's own value, which must survive
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=170, check=True
    )
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["started"]
    assert found["actor_env"] == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    assert found["before"] == found["after"] == {
        "OMP_NUM_THREADS": None, "MKL_NUM_THREADS": None, "TOKENIZERS_PARALLELISM": "true"
    }  # fmt: skip
    assert found["idle"], "Ray prestarted no worker"
    assert found["actor_pid"] in found["idle"], "the actor did not start in a prestarted worker"


EARLY = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    sys.path.insert(0, "tests/trainer")
    from recipe_helpers import TINY
    from rlflow.trainer import Trainer

    light = sorted(m for m in ("torch", "tensordict", "ray", "rlflow.trainer.build") if m in sys.modules)
    from rlflow.trainer import ConfigError
    import ray, torch
    threads = torch.get_num_threads()
    out, recipe = sys.argv[1], "recipes/grpo_arithmetic.yaml"
    found = {"light": light}
    try:
        Trainer(recipe, overrides=[*TINY, "trainer.total_steps=-1", f"logging.dir={out}/bad"])
    except ConfigError as err:
        found["bad"] = ("trainer.total_steps" in str(err), ray.is_initialized())
    too_big = Trainer(recipe, overrides=[*TINY, "placement.devices_per_node=64", f"logging.dir={out}/big"])
    try:
        too_big.launch()
    except Exception as err:
        found["too_big"] = (type(err).__name__, ray.is_initialized())
    auto = Trainer(recipe, overrides=[*TINY, f"logging.dir={out}/auto"], progress_bars=False)
    found["auto"] = (auto._ray_start is None, ray.is_initialized())  # a one-worker plan may run in the driver
    auto.close()
    ray_workers = [*TINY, "placement.worker_host=ray"]
    idle = Trainer(recipe, overrides=[*ray_workers, f"logging.dir={out}/idle"], progress_bars=False)
    found["idle"] = (idle._ray_start.wait(), ray.is_initialized())  # begun on construction
    idle.close()
    found["idle_closed"] = ray.is_initialized()
    with Trainer(recipe, overrides=[*ray_workers, "placement.devices_per_node=1", f"logging.dir={out}/run"],
                 progress_bars=False) as trainer:
        began = trainer._ray_start is not None
        result = trainer.fit()
        found["run"] = (began, trainer._started_ray, result.steps, sorted(trainer.startup or ()))
    found["closed"] = ray.is_initialized()
    found["threads"] = (threads, torch.get_num_threads())
    print(json.dumps(found))
    """
)  # fmt: skip


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_trainer_begins_its_local_ray_as_it_is_built_and_leaves_none_behind(tmp_path):
    # ``from rlflow.trainer import Trainer`` imports nothing heavy; ``Trainer(...)`` asking for Ray
    # workers begins a local Ray on a thread (torch loaded first: the driver keeps its thread
    # count), which the launch takes over; bad input, a cluster too small, or a trainer closed
    # unlaunched shut it down. With ``placement.worker_host: auto`` it begins none (the plan may
    # run its one worker in the driver: tests/trainer/test_driver_worker.py).
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAY_ADDRESS")}
    out = subprocess.run(
        [sys.executable, "-c", EARLY, str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=290
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["light"] == []
    assert found["bad"] == [True, False]
    assert found["too_big"] == ["ResourceError", False]
    assert found["auto"] == [True, False]
    assert found["idle"] == [True, True] and found["idle_closed"] is False
    began, started, steps, _ = found["run"]
    assert began and started and steps == 1 and found["closed"] is False
    assert found["threads"][0] == found["threads"][1] == len(os.sched_getaffinity(0))
