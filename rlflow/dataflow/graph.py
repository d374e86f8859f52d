"""Dataflow graphs: MFCs joined by the keys they exchange, unrolled over iterations.

``build_graph`` turns a list of :class:`MFCDef` into a ``networkx.DiGraph`` whose nodes are MFC
names (attribute ``"mfc"``) and whose edges carry the keys flowing along them (attribute
``"keys"``). Keys that no MFC produces come from the dataset (``graph.graph["dataset_keys"]``).

Across iterations, weights carry versions: the first call on model X in iteration t waits for
the last call on X in iteration t-1 (:func:`version_edges`). With bounded staleness
(``algorithm.policy_lag`` L) a generation of iteration t samples with the weights of t-1-L: its
version edges span 1+L iterations (:func:`version_spans`), so the rollout of t may run beside
the training of t-1. :func:`unroll_graph` materialises ``num_iterations`` copies of the graph
joined by those edges, the graph the planner's simulator schedules.
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx

from rlflow.dataflow.mfc import MFCDef


def build_graph(mfcs: Sequence[MFCDef]) -> nx.DiGraph:
    """Build and validate the dataflow graph of one iteration.

    Args:
        mfcs: the MFCs, in any order.

    Returns:
        A DAG with one node per MFC name (attribute ``"mfc"``), an edge ``producer -> consumer``
        per pair exchanging keys (attribute ``"keys"``: tuple, in the consumer's order), and
        ``graph.graph["dataset_keys"]`` (keys read but produced by no MFC, first-use order) and
        ``graph.graph["models"]`` (model names in first-use order).

    Raises:
        ValueError: no MFCs, a duplicate MFC name, a key produced by two MFCs, a cycle, or a
            hook reading a model no MFC of the graph runs on.

    >>> from rlflow.dataflow.mfc import MFCDef
    >>> g = build_graph([MFCDef("gen", "actor", "generate", ("prompts",), ("input_ids",)),
    ...                  MFCDef("train", "actor", "train_step", ("input_ids",), objective="sft")])
    >>> list(g.edges(data="keys")), g.graph["dataset_keys"]
    ([('gen', 'train', ('input_ids',))], ('prompts',))
    """
    if not mfcs:
        raise ValueError("a dataflow graph needs at least one MFC")
    graph = nx.DiGraph()
    producer: dict[str, str] = {}
    for mfc in mfcs:
        if not isinstance(mfc, MFCDef):
            raise TypeError(f"expected MFCDef, got {type(mfc).__name__}")
        if mfc.name in graph:
            raise ValueError(f"duplicate MFC name {mfc.name!r}")
        graph.add_node(mfc.name, mfc=mfc)
        for key in mfc.output_keys:
            if key in producer:
                raise ValueError(f"key {key!r} is produced by both {producer[key]!r} and {mfc.name!r}")
            producer[key] = mfc.name
    dataset_keys: list[str] = []
    for mfc in mfcs:
        for key in mfc.input_keys:
            src = producer.get(key)
            if src is None:
                if key not in dataset_keys:
                    dataset_keys.append(key)
            elif graph.has_edge(src, mfc.name):
                graph.edges[src, mfc.name]["keys"] += (key,)
            else:
                graph.add_edge(src, mfc.name, keys=(key,))
    if not nx.is_directed_acyclic_graph(graph):
        cycle = " -> ".join(u for u, _ in nx.find_cycle(graph))
        raise ValueError(f"the dataflow graph has a cycle: {cycle}")
    models = list(dict.fromkeys(m.model_name for m in mfcs))
    for mfc in mfcs:
        for source in mfc.hook_sources:
            if source not in models:
                raise ValueError(
                    f"MFC {mfc.name!r} has a hook reading model {source!r}; the graph's models are {models}"
                )
    graph.graph["dataset_keys"] = tuple(dataset_keys)
    graph.graph["models"] = tuple(models)
    return graph


def mfcs_of(graph: nx.DiGraph) -> list[MFCDef]:
    """The graph's MFCs in a deterministic topological order (ties by insertion order)."""
    order = {name: i for i, name in enumerate(graph.nodes)}
    return [graph.nodes[n]["mfc"] for n in nx.lexicographical_topological_sort(graph, key=order.__getitem__)]


def rollout_calls(graph: nx.DiGraph) -> list[str]:
    """The calls an iteration may issue ahead of the train steps of earlier iterations when
    rollouts may run behind training (``algorithm.policy_lag``), and that a step repeats for each
    generation round under dynamic sampling, in topological order.

    They are the generate calls with the calls they read from, and the calls downstream of them
    that read only those and run on weights no call of the graph trains, without weight hooks (a
    rule or a frozen reward model, a fixed reference): such a call gives the same rows whenever it
    runs, and issued with the rollout it never holds up a train step queued behind the next rollout
    on a shared worker. Empty for a graph that samples nothing.
    """
    mfcs = mfcs_of(graph)
    generate = [m.name for m in mfcs if m.interface_type == "generate"]
    if not generate:
        return []
    trained = {m.model_name for m in mfcs if m.is_train}
    ahead = set(generate).union(*(nx.ancestors(graph, n) for n in generate))
    for mfc in mfcs:
        producers = set(graph.predecessors(mfc.name))
        if mfc.name not in ahead and producers and producers <= ahead:
            if mfc.model_name not in trained and not mfc.hook_sources and not mfc.is_train:
                ahead.add(mfc.name)
    return [m.name for m in mfcs if m.name in ahead]


def model_calls(graph: nx.DiGraph) -> dict[str, list[str]]:
    """Model name -> names of the MFCs running on it, in topological order."""
    calls: dict[str, list[str]] = {}
    for mfc in mfcs_of(graph):
        calls.setdefault(mfc.model_name, []).append(mfc.name)
    return calls


def _first_and_last(graph: nx.DiGraph, calls: list[str]) -> tuple[list[str], list[str]]:
    """Calls with no earlier / no later call of the same set along the data edges."""
    members = set(calls)
    first = [c for c in calls if not (nx.ancestors(graph, c) & members)]
    last = [c for c in calls if not (nx.descendants(graph, c) & members)]
    return first, last


def version_edges(graph: nx.DiGraph) -> list[tuple[str, str]]:
    """Parameter-version edges ``(a, b)``: call ``b`` of iteration t waits for call ``a`` of t-1.

    For every model X, the calls on X (plus the calls whose hooks read X's weights) that have
    no earlier such call are its *first* calls, those with no later one its *last* calls; every
    last call links to every first call. A model with a single call links it to itself. A call
    after X's rollout whose earlier calls on X are all generate calls (the old-log-prob
    recompute) reads X's newest weights too: the last calls link to it as well, an edge implied
    on-policy and the one that holds it behind the previous train step when the rollout lags
    (:func:`version_spans`).

    >>> from rlflow.dataflow.algorithms import algorithm_graph
    >>> sorted(version_edges(algorithm_graph("ppo")))[:2]
    [('actor_train', 'actor_gen'), ('critic_train', 'critic_inf')]
    """
    readers: dict[str, list[str]] = {}
    for mfc in mfcs_of(graph):
        readers.setdefault(mfc.model_name, []).append(mfc.name)
        for source in mfc.hook_sources:
            readers.setdefault(source, []).append(mfc.name)
    generate = {n for n, mfc in graph.nodes(data="mfc") if mfc.interface_type == "generate"}
    edges: list[tuple[str, str]] = []
    for calls in readers.values():
        calls = list(dict.fromkeys(calls))
        first, last = _first_and_last(graph, calls)
        after_rollout = [
            c
            for c in calls
            if c not in first
            and c not in last
            and c not in generate
            and nx.ancestors(graph, c) & set(calls) <= generate
        ]
        edges += [(a, b) for a in last for b in first + after_rollout if (a, b) not in edges]
    return edges


def version_spans(graph: nx.DiGraph, policy_lag: int = 0) -> list[int]:
    """Iterations each of :func:`version_edges` spans: ``1 + policy_lag`` for an edge into a
    generation (its rollout of iteration t samples with the weights of t-1-``policy_lag``),
    1 for every other edge (a training or scoring call reads the newest weights).

    Raises:
        ValueError: ``policy_lag`` below 0.

    >>> from rlflow.dataflow.algorithms import algorithm_graph
    >>> g = algorithm_graph("grpo")
    >>> list(zip(version_edges(g), version_spans(g, policy_lag=1)))[0]
    (('actor_train', 'actor_gen'), 2)
    """
    if policy_lag < 0:
        raise ValueError(f"policy_lag={policy_lag} must be >= 0")
    generate = {n for n, mfc in graph.nodes(data="mfc") if mfc.interface_type == "generate"}
    return [1 + policy_lag if b in generate else 1 for _, b in version_edges(graph)]


def unroll_graph(graph: nx.DiGraph, num_iterations: int, policy_lag: int = 0) -> nx.DiGraph:
    """``num_iterations`` copies of ``graph`` joined by parameter-version edges.

    Args:
        graph: a graph from :func:`build_graph`.
        num_iterations: number of iterations, >= 1.
        policy_lag: iterations a rollout may lag the newest weights (:func:`version_spans`).

    Returns:
        A DAG with nodes ``(t, name)`` (attributes ``"mfc"``, ``"iteration"``). Edges have
        ``kind="data"`` (with ``"keys"``, inside one iteration), ``kind="version"`` (from
        iteration t-``span`` to t, attribute ``"span"``) or, for a lagged generation,
        ``kind="order"`` from its call of t-1 (rollouts are drawn in order). The first ``span``
        iterations' calls at the end of a version edge read the initial weights.
    """
    if num_iterations < 1:
        raise ValueError(f"num_iterations={num_iterations} must be >= 1")
    unrolled = nx.DiGraph(**graph.graph, num_iterations=num_iterations, policy_lag=policy_lag)
    versions = list(zip(version_edges(graph), version_spans(graph, policy_lag)))
    for t in range(num_iterations):
        for name, attrs in graph.nodes(data=True):
            unrolled.add_node((t, name), mfc=attrs["mfc"], iteration=t)
        for u, v, keys in graph.edges(data="keys"):
            unrolled.add_edge((t, u), (t, v), kind="data", keys=keys)
        for (u, v), span in versions:
            if t >= span:
                unrolled.add_edge((t - span, u), (t, v), kind="version", keys=(), span=span)
            if t >= 1 and span > 1:
                unrolled.add_edge((t - 1, v), (t, v), kind="order", keys=())
    return unrolled
