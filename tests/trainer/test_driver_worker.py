"""A plan of one CPU worker runs it in the driver (``placement.worker_host: auto``): no Ray starts,
the run learns exactly what a Ray worker learns, resumes bit for bit, and leaves the process as
it found it (no Ray, no torch.distributed group, its torch thread count).

Runs in a subprocess: the test session's shared Ray (``ray_session``) would make ``auto`` choose
Ray workers, as it does for a notebook that called ``ray.init()``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlflow.trainer import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
GRPO = REPO / "recipes" / "grpo_arithmetic.yaml"

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import ray, torch
    import torch.distributed as dist
    from rlflow.trainer import Trainer

    out, recipe = Path(sys.argv[1]), sys.argv[2]
    threads = torch.get_num_threads()
    base = [
        "models.actor.hidden_size=64", "models.actor.intermediate_size=128", "models.actor.num_layers=2",
        "models.actor.num_heads=4", "models.actor.num_kv_heads=2", "models.actor.lr=1e-2",
        "algorithm.n_samples=4", "algorithm.entropy_coef=0.1",  # rewards are 0 this early: the bonus moves weights
        "data.batch_size=4", "data.eval_size=8", "warmup.steps=0", "trainer.eval_every=2",
        "checkpoint.every_n_steps=2", "checkpoint.keep_last=0",
        "placement.mode=heuristic", "placement.devices_per_node=1", "placement.profile=false",
        "logging.console=false", "logging.tensorboard=false",
    ]
    found = {}

    def run(name, steps, *extra):
        with Trainer(recipe, overrides=[*base, f"trainer.total_steps={steps}", f"logging.dir={out / name}", *extra],
                     progress_bars=False) as trainer:
            began = trainer._ray_start is not None
            result = trainer.fit()
            found[name] = {"began_ray": began, "ray_during": ray.is_initialized(), "steps": result.steps,
                           "in_driver": trainer.workers.driver_hosted, "started_ray": trainer._started_ray,
                           "scores": result.eval_history}
        found[name]["ray_after"] = ray.is_initialized()

    run("driver", 4)
    run("driver_resumed", 4, f"checkpoint.resume={out / 'driver' / 'checkpoints' / 'step_2'}")
    run("ray", 4, "placement.worker_host=ray")
    found["dist_after"] = dist.is_initialized()
    found["threads"] = [threads, torch.get_num_threads()]
    print(json.dumps(found))
    """
)  # fmt: skip

# Timings and the process's memory differ between a worker in the driver and one in its own process.
UNCOMPARED = ("time", "startup/", "time/", "/time_s", "/peak_memory_bytes")


def _learned(run_dir: Path) -> dict[int, dict]:
    steps: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        kept = {k: v for k, v in record.items() if not any(k == u or u in k for u in UNCOMPARED)}
        steps.setdefault(record["step"], {}).update(kept)
    return steps


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_a_one_worker_plan_runs_in_the_driver_and_learns_what_a_ray_worker_learns(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAY_ADDRESS")}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), str(GRPO)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    for name in ("driver", "driver_resumed"):
        assert found[name] == {
            "began_ray": False, "ray_during": False, "steps": 4, "in_driver": True, "started_ray": False,
            "scores": found["driver"]["scores"], "ray_after": False,
        }, name  # fmt: skip
    assert found["ray"]["began_ray"] and found["ray"]["started_ray"] and not found["ray"]["in_driver"]
    assert found["ray"]["ray_after"] is False and found["ray"]["scores"] == found["driver"]["scores"]
    assert found["dist_after"] is False
    assert found["threads"][0] == found["threads"][1] == len(os.sched_getaffinity(0))

    driver, ray_run = _learned(tmp_path / "driver"), _learned(tmp_path / "ray")
    assert driver == ray_run  # every loss, gradient norm, reward and entropy of every step
    assert driver[4]["actor_train/grad_norm"] > 0  # the weights moved: the comparison means something
    # The resumed run's first step also logs the bytes of building its rollout copy (none sent: one worker).
    resumed = _learned(tmp_path / "driver_resumed")
    assert {k: v for k, v in resumed[3].items() if not k.startswith("realloc/")} == driver[3]
    assert resumed[4] == driver[4]
    records = [json.loads(line) for line in (tmp_path / "driver" / "metrics.jsonl").read_text().splitlines()]
    startup = [r for r in records if "startup/first_step_s" in r]
    assert len(startup) == 1 and startup[0]["startup/worker_in_driver"] == 1.0


def test_worker_host_driver_takes_one_device_and_refuses_a_cluster_or_a_per_process_engine():
    # The recipe places on two devices; hosted by the driver, the plan gets one.
    assert load_config(GRPO, ["placement.worker_host=driver"]).placement.devices_per_node == 1
    for given, named in [
        ("placement.num_nodes=2", "num_nodes=2"),
        ("placement.ray_address=auto", "ray_address='auto'"),
        ("rollout.engine=vllm", "rollout.engine='vllm'"),
    ]:
        with pytest.raises(ConfigError, match=rf"placement\.worker_host.*{named}"):
            load_config(None, ["placement.worker_host=driver", given])
    with pytest.raises(ConfigError, match="placement.worker_host"):
        load_config(GRPO, ["placement.worker_host=process"])


def test_a_worker_lost_while_the_first_launch_starts_it_is_started_again(tmp_path, monkeypatch):
    # trainer.max_restarts covers the launch too: a worker that dies as it starts (Ray could not
    # start its process) is started again, here as the driver-hosted one.
    from rlflow.controller import WorkerDiedError
    from rlflow.trainer import Trainer, build

    real, calls = build.start_workers, []

    def dies_once(*args, **kwargs):
        calls.append(kwargs.get("in_driver"))
        if len(calls) == 1:
            raise WorkerDiedError(("model",), 0, None, "the process exited as it started")
        return real(*args, **kwargs)

    monkeypatch.setattr(build, "start_workers", dies_once)
    overrides = [
        *(f"models.actor.{o}" for o in ("hidden_size=64", "intermediate_size=128", "num_layers=2")),
        "data.batch_size=4", "data.eval_size=4", "warmup.steps=0", "trainer.eval_before_train=false",
        "trainer.total_steps=1", "trainer.max_restarts=1", "placement.worker_host=driver",
        "placement.mode=heuristic", "placement.profile=false", "logging.console=false",
        "logging.tensorboard=false", f"logging.dir={tmp_path}",
    ]  # fmt: skip
    with Trainer(GRPO, overrides=overrides, progress_bars=False) as trainer:
        result = trainer.fit()
    assert result.steps == 1 and calls == [True, True]
