"""MetricsLogger sinks, progress bars and timing summaries."""

from __future__ import annotations

import io
import json
import math
import sys
import types

import numpy as np
import pytest
import torch

from rlflow.trainer.config import LoggingConfig
from rlflow.trainer.metrics import (
    MetricsLogger,
    Timings,
    mean_metrics,
    progress,
    summarise,
    timing_rows,
    timing_table,
)


def test_log_reaches_console_jsonl_and_tensorboard(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = LoggingConfig(console=True, jsonl=True, tensorboard=True)
    with MetricsLogger(cfg, tmp_path / "run") as logger:
        logger.log(1, {"reward": 0.5, "eval/acc": np.float32(0.25), "loss": torch.tensor(2.0), "done": True})
        logger.log(2, {"reward": 0.75})
    assert capsys.readouterr().out.splitlines() == [
        "step 1 | reward 0.5 | eval/acc 0.25 | loss 2 | done 1",
        "step 2 | reward 0.75",
    ]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward"]) for r in records] == [(1, 0.5), (2, 0.75)]
    assert records[0]["eval/acc"] == 0.25 and records[0]["loss"] == 2.0 and "time" in records[0]
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [(1, 0.5), (2, 0.75)]


def test_jsonl_appends_across_loggers_and_disabled_sinks_write_nothing(tmp_path):
    cfg = LoggingConfig(console=False, tensorboard=False)
    for step in (1, 2):  # a resumed run appends to the same file
        with MetricsLogger(cfg, tmp_path) as logger:
            logger.log(step, {"x": step})
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert not (tmp_path / "tensorboard").exists()


def test_bad_input_is_rejected_with_the_key(tmp_path):
    logger = MetricsLogger(LoggingConfig(console=False, tensorboard=False), tmp_path)
    with pytest.raises(ValueError, match="metric 'acc'"):
        logger.log(1, {"acc": "high"})
    with pytest.raises(ValueError, match="metric 'v'"):
        logger.log(1, {"v": torch.ones(3)})
    with pytest.raises(ValueError, match="step=-1"):
        logger.log(-1, {"x": 1.0})
    logger.close()
    logger.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        logger.log(2, {"x": 1.0})


@pytest.mark.parametrize("sink", ["wandb", "mlflow"])
def test_enabled_but_missing_package_is_a_clear_error(tmp_path, monkeypatch, sink):
    monkeypatch.setitem(sys.modules, sink, None)  # makes `import <sink>` raise ImportError
    cfg = LoggingConfig(console=False, jsonl=False, tensorboard=False, **{sink: True})
    with pytest.raises(ImportError, match=rf"logging\.{sink} is true but the '{sink}' package is not installed"):
        MetricsLogger(cfg, tmp_path)


def test_wandb_and_mlflow_receive_the_metrics(tmp_path, monkeypatch):
    calls: list[tuple] = []
    run = types.SimpleNamespace(
        log=lambda m, step: calls.append(("wandb.log", step, m)), finish=lambda: calls.append(("wandb.finish",))
    )
    wandb = types.SimpleNamespace(init=lambda **kw: calls.append(("wandb.init", kw["project"], kw["config"])) or run)
    mlflow = types.SimpleNamespace(
        set_experiment=lambda name: calls.append(("mlflow.experiment", name)),
        start_run=lambda run_name: calls.append(("mlflow.start", run_name)),
        log_params=lambda p: calls.append(("mlflow.params", p)),
        log_metrics=lambda m, step: calls.append(("mlflow.log", step, m)),
        end_run=lambda: calls.append(("mlflow.end",)),
    )
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    cfg = LoggingConfig(console=False, jsonl=False, tensorboard=False, wandb=True, mlflow=True, project="p")
    with MetricsLogger(cfg, tmp_path / "r1", run_config={"algorithm": {"name": "grpo"}}) as logger:
        logger.log(3, {"a": 1.0, "b": math.nan})
    assert calls == [
        ("wandb.init", "p", {"algorithm": {"name": "grpo"}}),
        ("mlflow.experiment", "p"),
        ("mlflow.start", "r1"),
        ("mlflow.params", {"algorithm.name": "grpo"}),
        ("wandb.log", 3, {"a": 1.0, "b": calls[4][2]["b"]}),
        ("mlflow.log", 3, {"a": 1.0}),  # MLflow rejects NaN
        ("wandb.finish",),
        ("mlflow.end",),
    ]
    assert math.isnan(calls[4][2]["b"])


def test_summarise_matches_numpy():
    values = [0.5, 1.5, 2.0, 10.0, 3.0]
    stats = summarise(values)
    assert stats["count"] == 5 and stats["mean"] == pytest.approx(np.mean(values))
    assert stats["std"] == pytest.approx(np.std(values, ddof=1))
    assert (stats["min"], stats["max"]) == (0.5, 10.0)
    assert stats["p50"] == 2.0 and stats["p90"] == pytest.approx(np.percentile(values, 90))
    assert summarise([4.0])["std"] == 0.0
    with pytest.raises(ValueError, match="at least one"):
        summarise([])


def test_timing_rows_and_table_compare_estimate_with_measurement():
    measured = {"actor_gen": [2.0, 2.0], "actor_train": [1.0, 3.0], "ref_inf": [0.5]}
    rows = timing_rows(measured, {"actor_gen": 2.5, "actor_train": 1.0})
    assert [r["rel_err"] for r in rows] == [pytest.approx(0.25), pytest.approx(-0.5), None]
    table = timing_table(measured, {"actor_gen": 2.5, "actor_train": 1.0})
    lines = table.splitlines()
    assert lines[0].split() == ["mfc", "calls", "mean", "s", "p90", "s", "est", "s", "rel", "err"]
    assert lines[1].split() == ["actor_gen", "2", "2.000", "2.000", "2.500", "+25.0%"]
    assert lines[3].split() == ["ref_inf", "1", "0.500", "0.500", "-", "-"]
    assert lines[4].split() == ["TOTAL", "4.500", "-", "-"]  # one estimate missing: no total estimate


def test_timings_collect_durations_by_name():
    timings = Timings()
    with timings.measure("gen"):
        torch.ones(10).sum()
    timings.add("gen", 0.25)
    timings.add("train", 1.0)
    assert timings.names() == ["gen", "train"]
    assert len(timings.durations("gen")) == 2 and timings.durations("gen")[0] >= 0
    assert timings.last() == {"time/gen": 0.25, "time/train": 1.0}
    with pytest.raises(ValueError, match="'train'"):
        timings.add("train", -1.0)


def test_mean_metrics_and_progress():
    assert mean_metrics([{"a": 1, "b": 2.0}, {"a": torch.tensor(3.0)}]) == {"a": 2.0, "b": 2.0}
    out = io.StringIO()
    with progress(5, "steps", disable=False, file=out) as bar:
        bar.update(2)
        assert bar.total == 5 and bar.n == 2
    assert "steps" in out.getvalue() and "2/5" in out.getvalue()
    assert progress(5, "hidden", disable=True).disable
