"""Start-up of rlflow's ``Trainer`` on the tiny task of ``benchmarks/bench_trl.py``: one JSON line.

    python benchmarks/launch_startup.py [WORKDIR]

Builds the task's model and tokenizer under WORKDIR (default a temporary directory), constructs
the ``Trainer`` the TRL benchmark's rlflow side uses (``benchmarks/grpo_tasks.py: rlflow_config``),
launches it (Ray, plan, workers) and closes it without training. Prints the seconds from this
process's first line to ``launch()`` returning (``to_launched_s``: imports included) and rlflow's
own ``startup/*`` stages. Timed as a whole process, alternating with another checkout's run of
the same script, it compares start-up changes (docs/benchmarks.md, section "rlflow against TRL's
`GRPOTrainer`").
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()

import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's rlflow, run from anywhere


def main(workdir: Path) -> dict[str, float]:
    from benchmarks.bench_trl import prepare
    from benchmarks.grpo_tasks import rlflow_config
    from rlflow.trainer import Trainer

    spec = prepare("tiny", 3, workdir)
    with Trainer(rlflow_config(spec, str(workdir / "out")), progress_bars=False) as trainer:
        trainer.launch()
        launched = time.perf_counter() - _STARTED
        stages = dict(trainer.startup or {})
    return {"to_launched_s": round(launched, 2), **{k: round(v, 3) for k, v in stages.items()}}


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps(main(Path(sys.argv[1]))))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(main(Path(tmp))))
