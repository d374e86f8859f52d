"""Metrics of a run: one ``log(step, metrics)`` call fans out to every enabled sink.

Sinks (chosen by :class:`~rlflow.trainer.config.LoggingConfig`):

- **console**: one compact line per step (``step 12 | reward 0.53 | eval/acc 0.41``), written
  with ``tqdm.write`` so that it does not tear a progress bar;
- **JSONL**: ``<run dir>/metrics.jsonl``, one ``{"step", "time", **metrics}`` object per line,
  flushed at once (the file is complete up to the last step even after a crash);
- **TensorBoard**: ``<run dir>/tensorboard``;
- **wandb**: a run under ``<run dir>/wandb`` (``WANDB_MODE=offline`` keeps it on disk for a
  later ``wandb sync``);
- **MLflow**: a run of its own through an ``MlflowClient`` (not the process-wide active run, so
  that several loggers may be open at once) in the store ``MLFLOW_TRACKING_URI`` names, or
  MLflow's default (``sqlite:///mlflow.db`` in the working directory since MLflow 3).

A resumed run calls :meth:`MetricsLogger.rewind` with its checkpoint's step: the JSONL file and
TensorBoard then hold each step once, from the run that finished it.

wandb and MLflow are imported only when enabled; enabling one that is not installed is an
error at construction, not a silent no-op.

Also here: :func:`call_metrics` (the logged metrics of one step's worker records),
:func:`progress` (a tqdm bar, shown as ``logging.progress`` says: :func:`show_progress`),
:func:`summarise` (statistics of a list of timings), :class:`Timings` (per-MFC wall-clock
collection) and :func:`timing_table`, which sets the planner's estimated time of each MFC next
to the measured one.
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from rlflow.files import write_atomic
from rlflow.trainer.config import PROGRESS_MODES, LoggingConfig

if TYPE_CHECKING:
    from rlflow.workers.records import CallRecord

__all__ = [
    "MetricsLogger",
    "Timings",
    "call_metrics",
    "mean_metrics",
    "progress",
    "show_progress",
    "summarise",
    "timing_rows",
    "timing_table",
]


class MetricsLogger:
    """Send scalar metrics to the console, a JSONL file, TensorBoard, wandb and MLflow.

    Args:
        cfg: which sinks are enabled, and the wandb project / MLflow experiment name.
        run_dir: directory of the run (created); files go inside it.
        run_name: name of the run in wandb/MLflow; default: the run directory's name.
        run_config: flat or nested settings recorded with the run (wandb config, MLflow params).

    Raises:
        ImportError: wandb or mlflow is enabled but not installed.

    >>> import tempfile
    >>> cfg = LoggingConfig(console=False, tensorboard=False)
    >>> with MetricsLogger(cfg, tempfile.mkdtemp()) as logger:
    ...     logger.log(1, {"reward": 0.5})
    """

    def __init__(
        self,
        cfg: LoggingConfig,
        run_dir: str | Path,
        *,
        run_name: str | None = None,
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        run_name = run_name or self.run_dir.name
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8") if cfg.jsonl else None  # noqa: SIM115
        self._tb = _tensorboard_writer(self.run_dir / "tensorboard") if cfg.tensorboard else None
        self._wandb = _start_wandb(cfg.project, run_name, self.run_dir, run_config) if cfg.wandb else None
        self._mlflow = _start_mlflow(cfg.project, run_name, run_config) if cfg.mlflow else None
        self._closed = False

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` at ``step`` in every enabled sink.

        Args:
            step: training step (>= 0); the x-axis of every plot.
            metrics: name → number (Python, numpy or 0-d torch scalars; bools count as 0/1).
                Names may be grouped with ``/`` (``"eval/acc"``, ``"time/actor_gen"``).

        Raises:
            ValueError: a negative step, or a value that is not a scalar number (naming its key).
            RuntimeError: the logger is closed.
        """
        if self._closed:
            raise RuntimeError("MetricsLogger.log() after close()")
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int")
        values = {str(k): _to_float(k, v) for k, v in metrics.items()}
        if self.cfg.console:
            tqdm.write(format_metrics(int(step), values))
        if self._jsonl is not None:
            record = {"step": int(step), "time": round(time.time(), 3), **values}
            self._jsonl.write(json.dumps(record, allow_nan=True) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, int(step))
        if self._wandb is not None:
            self._wandb.log(values, step=int(step))
        if self._mlflow is not None:
            self._mlflow.log(int(step), values)

    def rewind(self, step: int) -> None:
        """Forget what was logged after ``step``, so that each step appears once.

        A run resumed from the checkpoint of ``step`` (or restarted there after a failure) logs
        the steps after it again; ``step = -1`` forgets everything (a run restarted from its very
        start, before any checkpoint, logs step 0 again too). What was logged after it is dropped:
        ``metrics.jsonl`` keeps its records up to ``step`` (rewritten atomically; a torn last
        line of a killed run goes too), and TensorBoard reopens with ``purge_step=step + 1``,
        which makes its readers hide the older events from that step on. wandb and MLflow keep
        theirs (wandb refuses steps below its last; MLflow stores both values).

        Raises:
            ValueError: a step below -1.
            RuntimeError: the logger is closed.
        """
        if self._closed:
            raise RuntimeError("MetricsLogger.rewind() after close()")
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < -1:
            raise ValueError(f"step={step!r} must be an int >= -1 (-1: forget every step)")
        if self._jsonl is not None:
            self._jsonl.close()
            path = self.run_dir / "metrics.jsonl"
            write_atomic(path, "".join(_records_up_to(path.read_text(encoding="utf-8"), int(step))))
            self._jsonl = open(path, "a", encoding="utf-8")  # noqa: SIM115
        if self._tb is not None:
            self._tb.close()
            self._tb = _tensorboard_writer(self.run_dir / "tensorboard", purge_step=int(step) + 1)

    def close(self) -> None:
        """Flush and close every sink (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Bookkeeping metrics every call reports; they go to the files, not to the one-line console summary.
CONSOLE_HIDDEN = (
    "/time_s",
    "/tokens",
    "/rows",
    "/peak_memory_bytes",
    "/pre_call",
    "/post_call",
    "/lr",
    "/bytes_intra_host",
    "/bytes_inter_host",
)


def format_metrics(step: int, values: Mapping[str, float]) -> str:
    """The console line: ``step 12 | reward 0.531 | time/step 1.02``, 4 significant digits.

    Per-call bookkeeping (``CONSOLE_HIDDEN``) is left out of the line; every sink but the
    console records it.

    >>> format_metrics(3, {"reward": 0.53125, "n": 256.0, "actor_gen/rows": 64.0})
    'step 3 | reward 0.5312 | n 256'
    """
    shown = ((k, v) for k, v in values.items() if not k.endswith(CONSOLE_HIDDEN))
    return " | ".join([f"step {step}", *(f"{k} {v:.4g}" for k, v in shown)])


def _to_float(key: Any, value: Any) -> float:
    if hasattr(value, "item") and getattr(value, "ndim", getattr(value, "dim", lambda: 0)) in (0, ()):
        value = value.item()  # 0-d torch tensor or numpy scalar
    if isinstance(value, (bool, int, float, np.integer, np.floating)):
        return float(value)
    raise ValueError(f"metric {key!r}={value!r} is not a scalar number")


def _records_up_to(text: str, step: int) -> list[str]:
    """The lines of a metrics.jsonl text whose record's step is at most ``step``; a line that
    does not parse (the torn last line of a killed run) is left out."""
    kept = []
    for line in text.splitlines(keepends=True):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("step", step + 1) <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    return kept


def _tensorboard_writer(path: Path, purge_step: int | None = None) -> Any:
    from torch.utils.tensorboard import SummaryWriter  # slow import, only when enabled

    return SummaryWriter(log_dir=str(path), purge_step=purge_step)


def _require(package: str, flag: str) -> Any:
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        raise ImportError(
            f"{flag} is true but the {package!r} package is not installed; "
            f"`pip install 'rlflow[{package}]'` or set {flag}=false"
        ) from None


def _start_wandb(project: str, run_name: str, run_dir: Path, run_config: Mapping[str, Any] | None) -> Any:
    wandb = _require("wandb", "logging.wandb")
    return wandb.init(project=project, name=run_name, dir=str(run_dir), config=dict(run_config or {}))


def _start_mlflow(project: str, run_name: str, run_config: Mapping[str, Any] | None) -> _MlflowRun:
    mlflow = _require("mlflow", "logging.mlflow")
    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name(project)
    experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(project)
    run = _MlflowRun(mlflow, client, client.create_run(experiment_id, run_name=run_name).info.run_id)
    if run_config:
        run.log_params(_flatten(run_config))
    return run


class _MlflowRun:
    """One MLflow run written through a client of its own (the fluent API allows one active run per process)."""

    def __init__(self, mlflow: Any, client: Any, run_id: str) -> None:
        self._entities, self.client, self.run_id = mlflow.entities, client, run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        entries = [self._entities.Param(k, str(v)) for k, v in params.items()]
        for i in range(0, len(entries), _MLFLOW_BATCH):  # MLflow takes at most 100 params per request
            self.client.log_batch(self.run_id, params=entries[i : i + _MLFLOW_BATCH])

    def log(self, step: int, values: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        # MLflow rejects NaN/inf values; they stay in the other sinks.
        metrics = [self._entities.Metric(k, v, now, step) for k, v in values.items() if math.isfinite(v)]
        for i in range(0, len(metrics), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + _MLFLOW_BATCH])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


_MLFLOW_BATCH = 100


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def progress(total: int, desc: str, *, show: bool | None = None, **kwargs: Any) -> tqdm:
    """A tqdm progress bar over ``total`` steps.

    Args:
        total: number of updates expected.
        desc: label in front of the bar.
        show: True shows it, False hides it; None (default) shows it only when stderr is a
            terminal, so log files (``ray job submit``'s) get no carriage-return noise.
        **kwargs: passed to ``tqdm``.
    """
    disable = None if show is None else not show  # tqdm's None: hidden when its file is no terminal
    return tqdm(total=total, desc=desc, disable=disable, dynamic_ncols=True, **kwargs)


def show_progress(mode: str) -> bool | None:
    """``show`` of :func:`progress` for ``logging.progress``: always True, never False, auto None.

    >>> show_progress("auto") is None, show_progress("never")
    (True, False)
    """
    if mode not in PROGRESS_MODES:
        raise ValueError(f"logging.progress={mode!r}; expected one of {list(PROGRESS_MODES)}")
    return {"always": True, "never": False, "auto": None}[mode]


def mean_metrics(records: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Key-wise mean over ``records`` (e.g. the metrics of every dp rank); a key missing from
    some records is averaged over the records that have it.

    >>> mean_metrics([{"loss": 1.0, "kl": 0.5}, {"loss": 3.0}])
    {'loss': 2.0, 'kl': 0.5}
    """
    sums: dict[str, list[float]] = defaultdict(list)
    for record in records:
        for key, value in record.items():
            sums[key].append(_to_float(key, value))
    return {key: sum(values) / len(values) for key, values in sums.items()}


# What a hook's weights moved over, and the CallRecord metric that counts it.
LINK_BYTES = {
    "intra_host": "realloc_sent_intra_host_bytes",
    "inter_host": "realloc_sent_inter_host_bytes",
    "local": "realloc_copied_bytes",
}


def call_metrics(records: Sequence[CallRecord]) -> dict[str, float]:
    """The metrics of the calls and hooks of ``records`` (every rank's records of one step).

    Returns:
        Per call ``time/<mfc>`` (seconds of the slowest rank) and ``<mfc>/<metric>`` (mean over
        its ranks' metrics); per hook ``time/<mfc>/pre_call`` or ``time/<mfc>/post_call``
        (slowest rank). A call issued twice within ``records`` is timed by its slowest record.
        A call whose hooks moved weights also gets ``realloc/<mfc>/bytes_intra_host`` and
        ``realloc/<mfc>/bytes_inter_host``: the wire bytes its hooks sent within a host and
        between hosts, summed over ranks (a byte sent to ``k`` ranks counts ``k`` times); and
        ``realloc/<mfc>/bytes_local``: what they copied within a rank (home and copy on one device).

    >>> from rlflow.workers.records import CallRecord
    >>> records = [CallRecord("ref_inf", "ref", "call", "call", r, 3, 0.0, 1.0 + r, {"tokens": 8.0 * r})
    ...            for r in (0, 1)]
    >>> call_metrics(records)
    {'time/ref_inf': 2.0, 'ref_inf/tokens': 4.0}
    """
    grouped: dict[tuple[str, str], list[CallRecord]] = defaultdict(list)
    for record in records:
        grouped[(record.mfc, record.kind)].append(record)
    metrics: dict[str, float] = {}
    for (mfc, kind), group in grouped.items():
        seconds = max(r.seconds for r in group)
        if kind != "call":
            metrics[f"time/{mfc}/{kind}"] = seconds
            if sum(r.metrics.get("realloc_reshards", 0.0) for r in group) > 0:
                for link, moved in LINK_BYTES.items():
                    key = f"realloc/{mfc}/bytes_{link}"
                    metrics[key] = metrics.get(key, 0.0) + sum(r.metrics.get(moved, 0.0) for r in group)
            continue
        metrics[f"time/{mfc}"] = seconds
        metrics.update({f"{mfc}/{k}": v for k, v in mean_metrics([r.metrics for r in group]).items()})
    return metrics


def summarise(values: Sequence[float]) -> dict[str, float]:
    """Count, mean, standard deviation, min, median, 90th percentile and max of ``values``.

    Raises:
        ValueError: ``values`` is empty.

    >>> summarise([1.0, 2.0, 3.0, 4.0])["p50"]
    2.5
    """
    if len(values) == 0:
        raise ValueError("summarise() needs at least one value")
    data = np.asarray(values, dtype=np.float64)
    return {
        "count": float(data.size),
        "mean": float(data.mean()),
        "std": float(data.std(ddof=1)) if data.size > 1 else 0.0,
        "min": float(data.min()),
        "p50": float(np.percentile(data, 50)),
        "p90": float(np.percentile(data, 90)),
        "max": float(data.max()),
    }


class Timings:
    """Wall-clock durations collected by name (one list per MFC or stage).

    >>> timings = Timings()
    >>> with timings.measure("actor_gen"):
    ...     pass
    >>> timings.names()
    ['actor_gen']
    """

    def __init__(self) -> None:
        self._durations: dict[str, list[float]] = defaultdict(list)

    @contextmanager
    def measure(self, name: str) -> Iterator[None]:
        """Time the body of a ``with`` block (seconds, ``time.perf_counter``) under ``name``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._durations[name].append(time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        """Record a duration measured elsewhere (e.g. inside a worker)."""
        if not seconds >= 0:
            raise ValueError(f"duration of {name!r} is {seconds}; expected >= 0 seconds")
        self._durations[name].append(float(seconds))

    def names(self) -> list[str]:
        return list(self._durations)

    def durations(self, name: str) -> list[float]:
        return list(self._durations[name])

    def last(self) -> dict[str, float]:
        """The most recent duration of every name, as ``{"time/<name>": seconds}`` metrics."""
        return {f"time/{name}": values[-1] for name, values in self._durations.items() if values}

    def as_dict(self) -> dict[str, list[float]]:
        return {name: list(values) for name, values in self._durations.items()}


def timing_rows(
    measured: Mapping[str, Sequence[float]], estimated: Mapping[str, float] | None = None
) -> list[dict[str, float | str | None]]:
    """Per-name timing statistics next to an estimate (seconds), as JSON-able rows.

    Args:
        measured: name → measured durations (seconds).
        estimated: name → the cost model's estimate of one call (seconds); names without one
            get ``None`` in ``est_s`` and ``rel_err``.

    Returns:
        One row per name of ``measured``: ``name, calls, mean_s, p50_s, p90_s, est_s,
        rel_err`` with ``rel_err = (est - mean) / mean``.
    """
    rows = []
    for name, values in measured.items():
        stats = summarise(values)
        est = None if estimated is None else estimated.get(name)
        rel = None if est is None or stats["mean"] == 0 else (est - stats["mean"]) / stats["mean"]
        rows.append(
            {"name": name, "calls": int(stats["count"]), "mean_s": stats["mean"], "p50_s": stats["p50"],
             "p90_s": stats["p90"], "est_s": est, "rel_err": rel}
        )  # fmt: skip
    return rows


def timing_table(measured: Mapping[str, Sequence[float]], estimated: Mapping[str, float] | None = None) -> str:
    """:func:`timing_rows` as an aligned text table (a TOTAL row sums the means and estimates).

    >>> print(timing_table({"actor_gen": [1.0, 1.2]}, {"actor_gen": 0.99}))
    mfc        calls  mean s  p90 s  est s  rel err
    actor_gen      2   1.100  1.180  0.990   -10.0%
    """
    rows = timing_rows(measured, estimated)
    header = ("mfc", "calls", "mean s", "p90 s", "est s", "rel err")
    body = [(r["name"], str(r["calls"]), f"{r['mean_s']:.3f}", f"{r['p90_s']:.3f}", _opt(r["est_s"], "{:.3f}"),
             _opt(r["rel_err"], "{:+.1%}")) for r in rows]  # fmt: skip
    if len(rows) > 1:
        total_est = [r["est_s"] for r in rows]
        est = None if any(e is None for e in total_est) else sum(total_est)
        mean = sum(r["mean_s"] for r in rows)
        rel = None if est is None or mean == 0 else (est - mean) / mean
        body.append(("TOTAL", "", f"{mean:.3f}", "", _opt(est, "{:.3f}"), _opt(rel, "{:+.1%}")))
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = []
    for row in [header, *body]:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _opt(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)
