"""A recipe submitted as a Ray job to a standalone cluster: ``ray start --head``, then ``ray job submit``.

This is how a recipe runs on a real cluster: the job ships the repository as its working
directory and the recipe joins the cluster with ``placement.ray_address=auto``.

The cluster here is a separate set of processes with its own temp dir, ports and auth token;
nothing in this module calls ``ray.init``, so it coexists with the in-process Ray of the
other tests (and of other programs on the machine): ``ray.init()`` without an address only
joins a cluster recorded in the *default* temp dir, and this one records itself in its own.
It is stopped by signalling the processes this test started, never by ``ray stop``, which
kills every Ray process of the user on the machine.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest
from recipe_helpers import TINY

from rlflow.rendezvous import free_port

REPO = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).with_name("ray")
# What the working-dir upload leaves out. The uploaded copy of rlflow comes first on the job's
# PYTHONPATH, so it must carry the built C++ extensions (rlflow/_C_*.so); they are git-ignored,
# hence RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1 and explicit excludes. (Without it the copy imports
# them here only through the editable install of this same checkout.)
EXCLUDES = [
    ".venv",
    ".venv-*",
    ".git",
    "runs",
    "build",
    "outputs",
    "*.egg-info",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
]
PORTS = (
    "port",
    "dashboard-port",
    "ray-client-server-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
    "metrics-export-port",
)


def cluster_env() -> dict[str, str]:
    """The environment of every command: no Ray settings of this process, a token of our own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        PATH=f"{RAY.parent}{os.pathsep}{env.get('PATH', '')}",
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(32),
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",  # SIGTERM stops the head at once
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def wait_for_dashboard(url: str, head: subprocess.Popen, log: Path, timeout_s: float = 180.0) -> None:
    """Until the dashboard answers HTTP (401 included: it wants the token, which the CLI sends)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.poll() is not None:
            pytest.fail(f"`ray start --head` exited with {head.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/api/version", timeout=5):
                return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(1.0)
    pytest.fail(f"the dashboard at {url} did not come up in {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")


def stop_cluster(head: subprocess.Popen, temp_dir: str) -> None:
    """SIGTERM to ``ray start --block`` (which stops its children), then SIGKILL to what is left.

    Only processes this test started are signalled: the head's process group, and processes
    whose command line names this cluster's private temp dir.
    """
    if head.poll() is None:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if head.poll() is None:
        head.wait(timeout=30)
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(temp_dir in part for part in proc.info["cmdline"] or ()):
                proc.kill()
        except psutil.Error:
            pass


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_recipe_runs_as_a_ray_job_on_a_standalone_cluster(tmp_path):
    if not RAY.is_file():
        pytest.skip(f"no ray command next to {sys.executable}")
    env = cluster_env()
    ports = {name: free_port() for name in PORTS}
    # Unix socket paths must stay under ~107 characters: a short private dir, not tmp_path.
    temp_dir = tempfile.mkdtemp(prefix="rlfj_")
    log = tmp_path / "head.log"
    head_cmd = [
        str(RAY), "start", "--head", "--block", "--num-cpus=8", "--include-dashboard=true",
        "--dashboard-host=127.0.0.1", "--node-ip-address=127.0.0.1", "--disable-usage-stats",
        f"--temp-dir={temp_dir}", *(f"--{name}={port}" for name, port in ports.items()),
    ]  # fmt: skip
    url = f"http://127.0.0.1:{ports['dashboard-port']}"
    with log.open("w") as out:
        head = subprocess.Popen(head_cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_dashboard(url, head, log)
        run_dir, job_id = tmp_path / "run", f"rlflow-test-{uuid.uuid4().hex[:8]}"
        entrypoint = [sys.executable, "recipes/grpo_arithmetic.py", "placement.ray_address=auto", *TINY]
        submit = [
            str(RAY), "job", "submit", "--address", url, "--submission-id", job_id,
            "--working-dir", str(REPO), "--runtime-env-json", json.dumps({"excludes": EXCLUDES}),
            "--", *entrypoint, f"logging.dir={run_dir}",
        ]  # fmt: skip
        try:
            job = subprocess.run(
                submit,
                env={**env, "RAY_RUNTIME_ENV_IGNORE_GITIGNORE": "1"},
                capture_output=True,
                text=True,
                timeout=600,
            )
        except subprocess.TimeoutExpired:
            subprocess.run([str(RAY), "job", "stop", "--address", url, job_id], env=env, timeout=60)
            raise
        logs = job.stdout + job.stderr
        status = subprocess.run(
            [str(RAY), "job", "status", "--address", url, job_id], env=env, capture_output=True, text=True, timeout=60
        )
        assert f"Job '{job_id}' succeeded" in status.stdout + status.stderr, logs[-4000:]
        assert job.returncode == 0
        assert "held-out score of grpo_arithmetic: before " in logs
        assert f"(1 steps; run directory {run_dir})" in logs
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert any(r["step"] == 1 and "actor_train/loss" in r for r in records)
        assert (run_dir / "plan.json").is_file() and (run_dir / "timeline.png").is_file()
    finally:
        stop_cluster(head, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
