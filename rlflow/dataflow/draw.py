"""Drawing dataflow graphs (``rlflow draw``): one box per MFC, coloured by model, keys on edges."""

from __future__ import annotations

from pathlib import Path

import networkx as nx

from rlflow.dataflow.mfc import MFCDef

_FORMATS = (".png", ".svg", ".pdf")
_SHAPES = {"generate": "s", "inference": "o", "train_step": "D"}


def _label(node, mfc: MFCDef) -> str:
    iteration = f"\nt={node[0]}" if isinstance(node, tuple) else ""
    return f"{mfc.name}\n[{mfc.interface_type}]{iteration}"


def _layout(graph: nx.DiGraph) -> tuple[dict, int, int]:
    """Left-to-right layers by topological generation, so data flows in reading order.

    Returns:
        Node positions, the number of layers and the size of the largest layer.
    """
    layered = nx.DiGraph(graph)
    generations = list(nx.topological_generations(layered))
    for layer, nodes in enumerate(generations):
        for n in nodes:
            layered.nodes[n]["layer"] = layer
    return nx.multipartite_layout(layered, subset_key="layer"), len(generations), max(map(len, generations))


def draw(graph: nx.DiGraph, path: str | Path, title: str | None = None) -> Path:
    """Write a picture of a dataflow graph (plain or unrolled) to ``path``.

    Nodes are coloured by model and shaped by interface (square: generate, circle: inference,
    diamond: train_step); data edges are labelled with their keys; version edges of an unrolled
    graph are dashed.

    Args:
        graph: from :func:`~rlflow.dataflow.graph.build_graph` or
            :func:`~rlflow.dataflow.graph.unroll_graph`.
        path: output file; the suffix (``.png``, ``.svg`` or ``.pdf``) picks the format.
        title: optional title; defaults to the graph's algorithm name when it has one.

    Returns:
        The path written.
    """
    # The object-oriented API, not pyplot: no backend is selected or switched (a notebook keeps its own).
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    path = Path(path)
    if path.suffix.lower() not in _FORMATS:
        raise ValueError(f"cannot draw to {path.name!r}: the suffix must be one of {_FORMATS}")
    pos, n_layers, height = _layout(graph)
    models = list(dict.fromkeys(graph.nodes[n]["mfc"].model_name for n in graph.nodes))
    cmap = matplotlib.colormaps["tab10"]
    colour = {m: cmap(i % 10) for i, m in enumerate(models)}
    fig = Figure(figsize=(max(6.0, 2.8 * n_layers), max(4.0, 1.5 * height)))
    ax = fig.subplots()
    for interface, marker in _SHAPES.items():
        nodes = [n for n in graph.nodes if graph.nodes[n]["mfc"].interface_type == interface]
        nx.draw_networkx_nodes(
            graph, pos, nodelist=nodes, node_shape=marker, node_size=2600, ax=ax,
            node_color=[colour[graph.nodes[n]["mfc"].model_name] for n in nodes], alpha=0.85,
        )  # fmt: skip
    nx.draw_networkx_labels(
        graph, pos, labels={n: _label(n, graph.nodes[n]["mfc"]) for n in graph.nodes}, font_size=7, ax=ax
    )
    data = [(u, v) for u, v, k in graph.edges(data="kind") if k != "version"]
    version = [(u, v) for u, v, k in graph.edges(data="kind") if k == "version"]
    nx.draw_networkx_edges(graph, pos, edgelist=data, node_size=2600, arrowsize=14, ax=ax)
    nx.draw_networkx_edges(graph, pos, edgelist=version, node_size=2600, style="dashed", edge_color="grey", ax=ax)
    keys = {(u, v): "\n".join(graph.edges[u, v].get("keys", ())) for u, v in data}
    nx.draw_networkx_edge_labels(graph, pos, edge_labels=keys, font_size=6, ax=ax, label_pos=0.5)
    handles = [Line2D([], [], marker="o", ls="", color=colour[m], label=m, markersize=9) for m in models]
    ax.legend(handles=handles, loc="upper left", fontsize=8, title="model", title_fontsize=8)
    ax.set_title(title or graph.graph.get("algorithm", "dataflow graph"))
    ax.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    return path
