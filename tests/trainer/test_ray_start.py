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
