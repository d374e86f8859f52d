"""``rlflow plan`` at 64 to 512 GPUs: building the planning problem, the search, wall time and memory.

Each record runs the command line of the paper's setting — PPO, LLaMA-2-7B actor, critic,
reference and reward, batch 512, prompt 128, generation 896, A100-80GB hosts of 8 — in its own
process, for a 10 s search budget, and reports the whole command's wall time and peak resident
memory (``ru_maxrss`` of the child, from ``os.wait4``), the problem's options and build time (wall
and CPU, as the command prints them), how the search stopped and the plan's estimate. Clusters of
256 and 512 GPUs run with ``--max-options 2000``: their full spaces (12.7k and 51k options per call)
need dense reallocation tables of 0.15 and 1.9 billion cells.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

# (hosts of 8 GPUs, --max-options or None)
CASES = [(8, None), (16, None), (32, 2000), (64, 2000)]
COMMAND = (
    "plan --algo ppo --actor llama2-7b --critic llama2-7b --devices-per-node 8 --batch 512 --prompt-len 128 "
    "--gen-len 896 --search-seconds 10 --seed 0 --no-progress"
)


def _run(nodes: int, max_options: int | None) -> dict:
    argv = [sys.executable, "-m", "rlflow.cli", *COMMAND.split(), "--nodes", str(nodes)]
    if max_options is not None:
        argv += ["--max-options", str(max_options)]
    wall = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - wall
    if status != 0:
        raise RuntimeError(f"rlflow plan --nodes {nodes} failed with status {status}:\n{out[-2000:]}")
    built = re.search(r"problem: \d+ calls, (\d+) options, built in ([\d.]+) s \(([\d.]+) CPU s\)", out)
    found = re.search(r"plan search: .*?(\d+) proposals, best at proposal (\d+) per chain, (\w[\w ]*), ([\d.]+) s", out)
    estimate = re.search(r"^search\s+([\d.]+) s", out, re.MULTILINE)
    busy = re.search(r"the search uses (\d+) of (\d+) devices", out)
    return {
        "name": f"planner_scale/ppo/7b+7b/{nodes}x8" + (f"/max_options={max_options}" if max_options else ""),
        "command": f"rlflow {COMMAND} --nodes {nodes}" + (f" --max-options {max_options}" if max_options else ""),
        "wall_seconds": round(wall, 2),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
        "user_cpu_seconds": round(usage.ru_utime, 2),
        "options": int(built.group(1)) if built else None,
        "build_wall_seconds": float(built.group(2)) if built else None,
        "build_cpu_seconds": float(built.group(3)) if built else None,
        "search_proposals": int(found.group(1)) if found else None,
        "search_best_at": int(found.group(2)) if found else None,
        "search_stop": found.group(3) if found else None,
        "estimate_seconds_per_iteration": float(estimate.group(1)) if estimate else None,
        "devices_used": f"{busy.group(1)}/{busy.group(2)}" if busy else None,
        "load_average_1min": round(os.getloadavg()[0], 2),
    }


def run() -> list[dict]:
    return [_run(nodes, max_options) for nodes, max_options in CASES]


if __name__ == "__main__":
    import json

    for record in run():
        print(json.dumps(record))
