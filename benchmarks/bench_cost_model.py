"""Cost-model accuracy: per-MFC estimated vs measured seconds of a short real run.

For each recipe, a profile of this machine is measured with the actor's layer shape and the
pass shapes its calls run (:func:`rlflow.workers.profiling.run_profile`), then the recipe runs a
few RL steps of its tiny model on 2 CPU worker processes (a subprocess with its own Ray; no warm-up, no evaluation;
``placement.profile=true``, so the trainer plans with a profile of its own, which also times the
actor's whole calls with both workers busy and calibrates the estimates by them;
``placement.mode=colocated``: every call data-parallel over both workers, the same strategies in
every run). Every device MFC's (mesh, strategy) in the run's plan is priced by the
cost model calibrated by each profile — and by the analytic roofline on the measured hardware
rates, what the trainer uses without ``placement.profile`` — and compared with the measured call
times (the slowest rank of each call, median over the steps after the first); the trainer's
profile also without its calibration (``_uncalibrated``: the layer timings alone). Reallocation and EMA hooks (``pre_call``) are
compared with the plan's transfers into the same call.

    python -m benchmarks.bench_cost_model [--recipes grpo ppo_ema] [--steps 8]

On a machine shared with other jobs the measured times move with the load; the profile is taken
just before the run so that both see similar conditions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from transformers import AutoConfig

from rlflow.dataflow import mfcs_of
from rlflow.planner.cluster import cluster_preset
from rlflow.planner.cost import call_cost
from rlflow.planner.mesh import DeviceMesh
from rlflow.planner.model_spec import ModelSpec
from rlflow.planner.passes import Rates
from rlflow.planner.profile import MachineProfile, ProfiledRates, load_profile
from rlflow.strategy import ParallelStrategy
from rlflow.trainer.build import build_dataflow
from rlflow.trainer.config import load_config
from rlflow.trainer.placement import planning_workload, profile_shapes
from rlflow.workers.profiling import run_profile

ROOT = Path(__file__).resolve().parent.parent
# recipe name -> (script, extra overrides)
RECIPES = {
    "grpo": ("grpo_arithmetic", []),
    "ppo": ("ppo_arithmetic", []),
    "ppo_ema": ("ppo_arithmetic", ["algorithm.name=ppo_ema"]),
}
OVERRIDES = [
    "warmup.steps=0",
    "trainer.eval_every=0",
    "trainer.eval_before_train=false",
    "data.eval_size=0",
    "checkpoint.save_final=false",
    "logging.tensorboard=false",
    "placement.profile=true",
    "placement.mode=colocated",  # the same strategies in every run: every call dp over both workers
]


def _steady(values: list[float]) -> list[float]:
    """The calls after the first (which pays one-off warm-up), when there are enough."""
    return values[1:] if len(values) > 2 else values


def _estimates(run_dir: Path, profiles: dict[str, MachineProfile]) -> dict[str, dict[str, float]]:
    """Cost-model seconds of every planned call, per profile."""
    cfg = load_config(run_dir / "config.yaml")
    plan = json.loads((run_dir / "plan.json").read_text())
    mfcs = {m.name: m for m in mfcs_of(build_dataflow(cfg, "reward" not in cfg.models))}
    workload = planning_workload(cfg)
    out: dict[str, dict[str, float]] = {}
    for call in plan["calls"]:
        model_dir, model = run_dir / "models" / call["model"], cfg.models[call["model"]]
        if not model_dir.exists():  # loaded from a path, or a copy of another model (init: copy)
            model_dir = Path(model.path) if model.path else run_dir / "models" / model.init_from
        hf = AutoConfig.from_pretrained(model_dir)
        spec = ModelSpec.from_hf_config(hf, value_head=call["model"] in ("critic", "reward"))
        mesh = DeviceMesh(**call["mesh"])
        strategy = ParallelStrategy(**call["strategy"])
        out[call["name"]] = {}
        for label, profile in profiles.items():
            cluster = cluster_preset("cpu", mesh.num_nodes, mesh.devices_per_node, profile=profile)
            variants = (
                ("", ProfiledRates(profile, cluster)),
                ("_uncalibrated", ProfiledRates(profile, cluster, calibrate=False)),  # layer timings alone
                ("_roofline", Rates(cluster)),
            )
            for suffix, rates in variants:
                cost = call_cost(mfcs[call["name"]], spec, strategy, mesh, cluster, workload, rates)
                out[call["name"]][label + suffix] = cost.time_s
    return out


def measure(recipe: str, steps: int = 8, workdir: Path | None = None) -> list[dict]:
    """Profile, run ``recipe`` for ``steps`` steps, and compare per MFC (see the module docstring)."""
    script, extra = RECIPES[recipe]
    yaml = ROOT / "recipes" / f"{script}.yaml"
    overrides = [*OVERRIDES, *extra, f"trainer.total_steps={steps}"]
    cfg = load_config(yaml, overrides)
    workdir = Path(workdir or tempfile.mkdtemp(prefix=f"bench_cost_model_{recipe}_"))
    run_dir = workdir / "run"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    run_profile(workdir / "profile_actor.json", progress=False, **profile_shapes(cfg))
    cmd = [sys.executable, str(ROOT / "recipes" / f"{script}.py"), *overrides, f"logging.dir={run_dir}"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=1200)
    return compare(recipe, workdir)


def compare(recipe: str, workdir: Path) -> list[dict]:
    """The records of a finished :func:`measure` in ``workdir`` (its profiles and run directory)."""
    run_dir = workdir / "run"
    profiles = {
        "actor_profile": load_profile(workdir / "profile_actor.json"),
        "trainer_profile": load_profile(run_dir / "profile.json"),
    }
    estimates = _estimates(run_dir, profiles)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    plan = json.loads((run_dir / "plan.json").read_text())
    records = []
    for call in plan["calls"]:
        name = call["name"]
        measured = _steady([r[f"time/{name}"] for r in rows if f"time/{name}" in r])
        median = statistics.median(measured)
        est = estimates[name]
        records.append(
            {
                "name": f"cost_model/{recipe}/{name}",
                "strategy": call["strategy"],
                "calls": len(measured),
                "measured_s": round(median, 4),
                "estimated_s": round(est["actor_profile"], 4),
                "rel_err": round((est["actor_profile"] - median) / median, 3),
                "estimated_trainer_profile_s": round(est["trainer_profile"], 4),
                "rel_err_trainer_profile": round((est["trainer_profile"] - median) / median, 3),
                "estimated_trainer_profile_uncalibrated_s": round(est["trainer_profile_uncalibrated"], 4),
                "rel_err_trainer_profile_uncalibrated": round(
                    (est["trainer_profile_uncalibrated"] - median) / median, 3
                ),
                "estimated_roofline_s": round(est["actor_profile_roofline"], 4),
                "rel_err_roofline": round((est["actor_profile_roofline"] - median) / median, 3),
                "unit": "s",
            }
        )
        hooks = _steady([r[f"time/{name}/pre_call"] for r in rows if f"time/{name}/pre_call" in r])
        planned = [t for t in plan["transfers"] if t["target"] == name and t["kind"] != "data"]
        if hooks and planned:
            est_hook, median = sum(t["time_s"] for t in planned), statistics.median(hooks)
            records.append(
                {
                    "name": f"cost_model/{recipe}/{name}/pre_call",
                    "kinds": sorted({t["kind"] for t in planned}),
                    "calls": len(hooks),
                    "measured_s": round(median, 4),
                    "estimated_trainer_profile_s": round(est_hook, 4),
                    "rel_err_trainer_profile": round((est_hook - median) / median, 3),
                    "unit": "s",
                }
            )
    return records


def run() -> list[dict]:
    return measure("grpo") + measure("ppo_ema", steps=6)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["grpo", "ppo_ema"], choices=sorted(RECIPES))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    args = parser.parse_args()
    for recipe in args.recipes:
        workdir = args.workdir / recipe if args.workdir else None
        for record in measure(recipe, args.steps, workdir):
            print(json.dumps(record), flush=True)
