"""Devices × time picture of a schedule (like Figure 13 of the ReaLHF paper), simulated or measured.

One row per device, one colour per MFC; reallocations, reloads and data transfers are drawn
hatched in the colour of the call they prepare; dashed vertical lines mark iteration ends.
The same intervals also go to a Chrome trace-event file (:func:`write_trace`) for Perfetto or
``chrome://tracing``. The trainer passes measured intervals through the same functions as the
simulator's.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from rlflow.files import write_atomic
from rlflow.strategy import ParallelStrategy

KINDS = ("call", "realloc", "reload", "ema", "data")
_HATCH = {"call": None, "realloc": "///", "reload": "xx", "ema": "\\\\", "data": "..."}
_KIND_LABEL = {
    "realloc": "weight reallocation",
    "reload": "reload from host",
    "ema": "EMA blend",
    "data": "data transfer",
}


@dataclass(frozen=True)
class Interval:
    """One busy interval of one device.

    Args:
        device: global device index (row of the picture).
        start, end: seconds since the start of the run.
        label: the MFC the interval belongs to (the colour).
        kind: ``"call"``, ``"realloc"``, ``"reload"``, ``"ema"`` or ``"data"`` (the hatching).
        iteration: iteration the interval belongs to, when known.
    """

    device: int
    start: float
    end: float
    label: str
    kind: str = "call"
    iteration: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"interval kind={self.kind!r}; expected one of {KINDS}")
        if self.end < self.start:
            raise ValueError(
                f"interval of {self.label!r} on device {self.device} ends ({self.end}) before it starts ({self.start})"
            )


def draw_timeline(
    intervals: Sequence[Interval],
    path: str | os.PathLike,
    title: str | None = None,
    boundaries: Sequence[float] = (),
    num_devices: int | None = None,
) -> str:
    """Draw ``intervals`` to ``path``; the format follows the suffix (``.png``, ``.svg``, ``.pdf``).

    Args:
        intervals: busy intervals (zero-length ones are skipped).
        path: output file.
        title: figure title.
        boundaries: times (s) of iteration ends, drawn as dashed lines.
        num_devices: rows to draw; default: up to the largest device index seen.

    Returns:
        The path written, as a string.
    """
    # The object-oriented API, not pyplot: no backend is selected or switched (a notebook keeps its own).
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = num_devices if num_devices is not None else 1 + max((iv.device for iv in intervals), default=0)
    colours = _colours(sorted({iv.label for iv in intervals}))
    fig = Figure(figsize=(12, max(2.5, 0.28 * rows + 1.6)))
    ax = fig.subplots()
    groups: dict[tuple[str, str], list[Interval]] = defaultdict(list)
    for iv in intervals:
        if iv.end > iv.start:
            groups[(iv.label, iv.kind)].append(iv)
    for (label, kind), ivs in groups.items():  # one bar container per colour and hatching: fast for many devices
        hatched = kind != "call"
        ax.barh(
            [iv.device for iv in ivs],
            [iv.end - iv.start for iv in ivs],
            left=[iv.start for iv in ivs],
            height=0.8,
            color=colours[label],
            alpha=0.55 if hatched else 1.0,
            hatch=_HATCH[kind],
            edgecolor="black" if hatched else colours[label],
            linewidth=0.3,
        )
    for t in boundaries:
        ax.axvline(t, color="black", linestyle="--", linewidth=0.8)
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_yticks(range(rows))
    ax.set_yticklabels([str(d) for d in range(rows)], fontsize=7 if rows > 16 else 9)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("device")
    if title:
        ax.set_title(title)
    handles = [Patch(facecolor=c, label=label) for label, c in colours.items()]
    kinds = sorted({iv.kind for iv in intervals} - {"call"})
    handles += [Patch(facecolor="white", edgecolor="black", hatch=_HATCH[k], label=_KIND_LABEL[k]) for k in kinds]
    if boundaries:
        handles.append(Line2D([], [], color="black", linestyle="--", label="iteration end"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    return str(path)


def save_timeline(
    intervals: Sequence[Interval],
    path: str | os.PathLike,
    title: str | None = None,
    boundaries: Sequence[float] = (),
    num_devices: int | None = None,
    strategies: Mapping[str, ParallelStrategy] | None = None,
) -> str:
    """A trace (:func:`write_trace`) for a ``.json`` path, else a picture (:func:`draw_timeline`)."""
    if Path(path).suffix == ".json":
        return write_trace(intervals, path, title, strategies)
    return draw_timeline(intervals, path, title, boundaries, num_devices)


# Trace threads of a device: calls, weight movements (reallocation, reload, EMA), data transfers.
_TRACE_THREADS = {
    "call": (0, "calls"),
    "realloc": (1, "weights"),
    "reload": (1, "weights"),
    "ema": (1, "weights"),
    "data": (2, "data transfers"),
}


def write_trace(
    intervals: Sequence[Interval],
    path: str | os.PathLike,
    title: str | None = None,
    strategies: Mapping[str, ParallelStrategy] | None = None,
) -> str:
    """Write ``intervals`` as a Chrome trace-event file that Perfetto and ``chrome://tracing`` open.

    One process per device (``pid`` = device index), one complete event (``"ph": "X"``, ``ts`` and
    ``dur`` in microseconds) per interval, named by its MFC (hooks: ``"actor_gen realloc"``), on
    the device's thread for its kind; ``args`` hold ``mfc``, ``kind``, ``step`` and the call's
    ``dp``/``tp``/``pp`` from ``strategies``.

    Args:
        intervals: busy intervals; their times (s) become ``ts`` relative to time 0.
        path: output file (``.json``).
        title: kept as the trace's ``otherData.title``.
        strategies: MFC name -> its parallel strategy.

    Returns:
        The path written, as a string.
    """
    strategies = strategies or {}
    events: list[dict] = []
    for device in sorted({iv.device for iv in intervals}):
        events.append(
            {"name": "process_name", "ph": "M", "pid": device, "tid": 0, "args": {"name": f"device {device}"}}
        )
        events.append(
            {"name": "process_sort_index", "ph": "M", "pid": device, "tid": 0, "args": {"sort_index": device}}
        )
        for tid, thread in sorted({_TRACE_THREADS[iv.kind] for iv in intervals if iv.device == device}):
            events.append({"name": "thread_name", "ph": "M", "pid": device, "tid": tid, "args": {"name": thread}})
    for iv in intervals:
        args: dict = {"mfc": iv.label, "kind": iv.kind, "step": iv.iteration}
        strategy = strategies.get(iv.label)
        if strategy is not None:
            args.update(dp=strategy.dp, tp=strategy.tp, pp=strategy.pp)
        events.append(
            {
                "name": iv.label if iv.kind == "call" else f"{iv.label} {iv.kind}",
                "cat": iv.kind,
                "ph": "X",
                "ts": iv.start * 1e6,
                "dur": (iv.end - iv.start) * 1e6,
                "pid": iv.device,
                "tid": _TRACE_THREADS[iv.kind][0],
                "args": args,
            }
        )
    trace = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"title": title or ""}}
    write_atomic(path, json.dumps(trace))
    return str(path)


def _colours(labels: list[str]) -> dict[str, tuple]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if len(labels) <= 10 else "tab20"]
    return {label: cmap(i % cmap.N) for i, label in enumerate(labels)}
