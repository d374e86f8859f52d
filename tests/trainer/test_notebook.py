"""``recipes/quickstart.ipynb`` runs top to bottom in a Jupyter kernel and draws its pictures.

The kernel is this interpreter (a kernelspec written for the test, so that no ``python3``
kernel installed elsewhere — or ``python`` resolved on PATH — can stand in for it), started in
``recipes/`` like a notebook opened there. ``RLFLOW_NOTEBOOK_SMOKE=1`` shrinks the run to a
tiny model and two steps, and ``RAY_ADDRESS`` points the notebook at this session's Ray.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.ipynb"
KERNEL = "rlflow-test-kernel"


def write_kernelspec(root: Path, env: dict[str, str]) -> None:
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "rlflow test kernel",
        "language": "python",
        "env": env,
    }
    (root / "kernels" / KERNEL).mkdir(parents=True)
    (root / "kernels" / KERNEL / "kernel.json").write_text(json.dumps(spec))


def outputs_of(cell) -> tuple[str, list[str]]:
    """A code cell's printed text and the MIME types of its rich outputs."""
    text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
    mimes = [m for o in cell.outputs if o.output_type in ("display_data", "execute_result") for m in o.data]
    return text, mimes


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quickstart_notebook_runs_and_draws_the_learning_curve_and_timelines(ray_session, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    env = {
        "RLFLOW_NOTEBOOK_SMOKE": "1",
        "RLFLOW_NOTEBOOK_RUN_DIR": str(run_dir),
        "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    write_kernelspec(tmp_path / "jupyter", env)
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name=KERNEL, timeout=300, resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error

    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code)
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    printed = {i: outputs_of(c)[0] for i, c in enumerate(code)}
    assert any("held-out accuracy:" in t and "after GRPO" in t for t in printed.values())
    # The learning curve is drawn inline, and the planned and measured timelines are shown.
    images = [m for c in code for m in outputs_of(c)[1] if m == "image/png"]
    assert len(images) >= 3
    curve = next(c for c in code if "plt.show()" in c.source)
    assert "image/png" in outputs_of(curve)[1]
    assert (run_dir / "planned_timeline.png").is_file() and (run_dir / "timeline.png").is_file()
    # The smoke version ran as asked: two GRPO steps, evaluated after each.
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in records if "reward_inf/score_mean" in r}) == [1, 2]
    assert [r["step"] for r in records if "eval/score" in r] == [0, 0, 1, 2]
