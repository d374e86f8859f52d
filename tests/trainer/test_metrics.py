"""MetricsLogger sinks, progress bars and timing summaries."""

from __future__ import annotations

import io
import json
import math
import struct
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rlflow.trainer.config import LoggingConfig
from rlflow.trainer.metrics import (
    MetricsLogger,
    Timings,
    call_metrics,
    mean_metrics,
    progress,
    summarise,
    timing_rows,
    timing_table,
)
from rlflow.workers.records import CallRecord


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
    message = rf"logging\.{sink} is true but the '{sink}' package is not installed; `pip install 'rlflow\[{sink}\]'`"
    with pytest.raises(ImportError, match=message):
        MetricsLogger(cfg, tmp_path)


def wandb_history(run_dir: Path) -> tuple[dict, list[dict]]:
    """The config and history rows of the one offline wandb run under ``run_dir``, from its ``.wandb`` file.

    The file is a LevelDB-style log (as wandb writes it): a 7-byte header, then 32 KiB blocks of
    chunks, each ``crc32 (4) | length (2) | type (1) | data``; FULL (1) or FIRST..LAST (2..4)
    chunks make up one protobuf ``Record``.
    """
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    # wandb-core writes the file from its own process: ``finish()`` can return before the records
    # reach it (1 run in 3 on this machine), so wait for the run's closing ``exit`` record.
    deadline = time.monotonic() + 60
    while True:
        config, history, kinds = _read_wandb_records(path.read_bytes())
        if "exit" in kinds or time.monotonic() > deadline:
            return config, history
        time.sleep(0.2)


def _read_wandb_records(data: bytes) -> tuple[dict, list[dict], list[str]]:
    from wandb.proto import wandb_internal_pb2

    if len(data) < 7:  # wandb-core has not written the file's header yet
        return {}, [], []
    assert data[:4] == b":W&B"
    config, history, kinds, chunks, pos = {}, [], [], [], 7
    while pos + 7 <= len(data):
        if WANDB_BLOCK - pos % WANDB_BLOCK < 7:  # a block's tail too short for a header is padding
            pos += WANDB_BLOCK - pos % WANDB_BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # a chunk wandb-core is still writing
            break
        chunks.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind not in (1, 4):
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(b"".join(chunks))
        chunks = []
        kind = record.WhichOneof("record_type")
        kinds.append(kind)
        if kind in ("run", "config"):  # the run's first record, then any config updates
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates})
        elif kind == "history":
            # A history item names its metric by ``key`` or by ``nested_key`` (wandb writes either).
            items = record.history.item
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    return config, history, kinds


WANDB_BLOCK = 32768


def test_wandb_offline_run_holds_the_config_and_every_step(tmp_path, monkeypatch):
    import wandb  # noqa: F401  (in the test extra: a missing package fails, it does not skip)

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LoggingConfig(console=False, jsonl=False, tensorboard=False, wandb=True, project="p")
    with MetricsLogger(cfg, tmp_path / "r1", run_config={"algorithm": {"name": "grpo"}}) as logger:
        logger.log(3, {"a": 1.0, "b": math.nan, "time/actor_gen": np.float32(0.5)})
        logger.log(4, {"a": 2.0})
    config, history = wandb_history(tmp_path / "r1")
    assert {k: v for k, v in config.items() if k != "_wandb"} == {"algorithm": {"name": "grpo"}}  # wandb's own
    rows = [{k: v for k, v in row.items() if not k.startswith("_")} | {"step": row["_step"]} for row in history]
    assert rows[1] == {"a": 2.0, "step": 4}
    assert rows[0]["step"] == 3 and rows[0]["a"] == 1.0 and rows[0]["time/actor_gen"] == 0.5
    assert math.isnan(rows[0]["b"])  # wandb keeps NaN


def test_mlflow_run_holds_the_params_and_every_finite_step(tmp_path, monkeypatch):
    import mlflow  # in the test extra: a missing package fails, it does not skip

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg = LoggingConfig(console=False, jsonl=False, tensorboard=False, mlflow=True, project="p")
    # The trainer's whole configuration as run parameters: more than one request's worth (100).
    run_config = {"algorithm": {"name": "grpo"}, "many": {f"k{i}": i for i in range(150)}}
    first = MetricsLogger(cfg, tmp_path / "r1", run_config=run_config)
    second = MetricsLogger(cfg, tmp_path / "r2")  # two open loggers: each writes its own run
    first.log(3, {"a": 1.0, "b": math.nan})
    first.log(4, {"a": 2.0, "b": 0.5})
    second.log(1, {"a": 7.0})
    first.close()
    second.close()
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("p")
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == ["r1", "r2"] and {r.info.status for r in runs.values()} == {"FINISHED"}
    r1 = runs["r1"]
    assert r1.data.params["algorithm.name"] == "grpo" and len(r1.data.params) == 151
    assert [(m.step, m.value) for m in client.get_metric_history(r1.info.run_id, "a")] == [(3, 1.0), (4, 2.0)]
    assert [(m.step, m.value) for m in client.get_metric_history(r1.info.run_id, "b")] == [(4, 0.5)]  # no NaN
    assert [(m.step, m.value) for m in client.get_metric_history(runs["r2"].info.run_id, "a")] == [(1, 7.0)]


def test_call_metrics_time_each_call_by_its_slowest_rank_and_average_its_numbers():
    records = [
        CallRecord("actor_gen", "actor", "pre_call", "realloc", 0, 2, 10.0, 10.5),
        CallRecord("actor_gen", "actor", "pre_call", "realloc", 1, 2, 10.0, 10.25),
        CallRecord("actor_gen", "actor", "call", "call", 0, 2, 10.5, 12.0, {"tokens": 8.0, "loss": 1.0}),
        CallRecord("actor_gen", "actor", "call", "call", 1, 2, 10.5, 11.0, {"tokens": 4.0}),
        CallRecord("ref_inf", "ref", "call", "call", 1, 2, 12.0, 12.5, {}),
    ]
    assert call_metrics(records) == {
        "time/actor_gen/pre_call": 0.5,
        "time/actor_gen": 1.5,
        "actor_gen/tokens": 6.0,
        "actor_gen/loss": 1.0,
        "time/ref_inf": 0.5,
    }
    assert call_metrics([]) == {}


def test_call_records_refuse_unknown_kinds_and_negative_steps():
    with pytest.raises(ValueError, match="kind='hook'"):
        CallRecord("a", "m", "hook", "call", 0, 1, 0.0, 1.0)
    with pytest.raises(ValueError, match="interval_kind='ema'"):
        CallRecord("a", "m", "call", "ema", 0, 1, 0.0, 1.0)
    with pytest.raises(ValueError, match="step=-1"):
        CallRecord("a", "m", "call", "call", 0, -1, 0.0, 1.0)
    with pytest.raises(ValueError, match="ends"):
        CallRecord("a", "m", "call", "call", 0, 1, 2.0, 1.0)


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
    with progress(5, "steps", show=True, file=out) as bar:
        bar.update(2)
        assert bar.total == 5 and bar.n == 2
    assert "steps" in out.getvalue() and "2/5" in out.getvalue()
    assert progress(5, "hidden", show=False).disable
