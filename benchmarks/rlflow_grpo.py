"""rlflow's ``Trainer`` on one task of ``benchmarks/bench_trl.py``; runs in rlflow's venv.

    python benchmarks/rlflow_grpo.py SPEC.json EVENTS.jsonl

The twin of ``benchmarks/trl_grpo.py``: the same spec, the same event lines. The config is
:func:`benchmarks.grpo_tasks.rlflow_config` (default placement on two CPU worker processes,
``algorithm.policy_lag`` when the spec names it). ``train_begin`` is written when
``Trainer.launch()`` returns (Ray, planning and workers are up and the first step is issued
next); each ``step`` when rlflow logs that step, with the mean rule reward of its completions.
The ``startup`` event carries rlflow's own ``startup/*`` seconds; each ``step`` its calls' seconds
(``calls``); after the run, ``plan`` (each call's strategy) and ``precision`` (the actor's
compute dtype as resolved on this machine).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.grpo_tasks import rlflow_config  # noqa: E402

_REWARD_KEYS = ("reward_inf/score_mean", "actor_train/score_mean")


def _compute_dtype(trainer, role: str) -> str:
    """The precision ``models.<role>.dtype`` resolved to on this machine (``auto``: by CPU and a pass's work)."""
    from rlflow.engine.parallelize import layer_matmul_params, resolve_compute_dtype

    cfg = trainer.cfg
    layer = layer_matmul_params(json.loads((Path(cfg.models[role].path) / "config.json").read_text()))
    dtype = resolve_compute_dtype(cfg.models[role].dtype, "cpu", layer, cfg.pass_tokens(role))
    return str(dtype).removeprefix("torch.")


def main(spec_path: str, events_path: str) -> int:
    from importlib.metadata import version

    import torch
    import transformers

    from rlflow.trainer import Trainer

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    completions = spec["num_prompts"] * spec["n_samples"]
    with open(events_path, "w") as out:

        def write(event: str, **fields) -> None:
            out.write(json.dumps({"event": event, **fields}) + "\n")
            out.flush()

        def on_log(step: int, metrics: dict[str, float]) -> None:
            now = time.time()
            if any(k.startswith("startup/") for k in metrics):
                write("startup", **{k: round(v, 3) for k, v in metrics.items()})
            reward = next((metrics[k] for k in _REWARD_KEYS if k in metrics), None)
            if reward is not None:
                rows = metrics.get("actor_gen/rows", completions)
                calls = {k[5:]: round(v, 4) for k, v in metrics.items() if k.startswith("time/") and k.count("/") == 1}
                write("step", step=step, t_end=now, reward=float(reward), completions=int(rows), calls=calls)

        write(
            "versions",
            rlflow=version("rlflow"),
            transformers=transformers.__version__,
            torch=torch.__version__,
            threads=torch.get_num_threads(),
            omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
        )
        config = rlflow_config(spec, spec["output_dir"], spec.get("policy_lag"))
        with Trainer(config, callbacks=[on_log], progress_bars=False) as trainer:
            trainer.launch()
            write("train_begin", t=time.time())
            result = trainer.fit()
            plan = trainer.placement.plan
            if plan is not None:
                write("plan", calls={c.name: str(c.strategy) for c in plan.calls})
            write("precision", actor=_compute_dtype(trainer, "actor"))
        write("done", t=time.time(), steps=result.steps)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} SPEC.json EVENTS.jsonl")
    sys.exit(main(sys.argv[1], sys.argv[2]))
