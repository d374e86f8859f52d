"""Devices × time picture of a schedule (like Figure 13 of the ReaLHF paper), simulated or measured.

One row per device, one colour per MFC; reallocations, reloads and data transfers are drawn
hatched in the colour of the call they prepare; dashed vertical lines mark iteration ends.
The trainer passes measured intervals through the same function as the simulator's.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

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


def _colours(labels: list[str]) -> dict[str, tuple]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if len(labels) <= 10 else "tab20"]
    return {label: cmap(i % cmap.N) for i, label in enumerate(labels)}
