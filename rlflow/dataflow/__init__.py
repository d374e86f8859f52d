"""Dataflow graphs of model function calls (MFCs): declaration, validation, unrolling, drawing."""

from rlflow.dataflow.algorithms import (
    Algorithm,
    GraphOptions,
    algorithm_graph,
    algorithm_mfcs,
    get_algorithm,
    list_algorithms,
    register_algorithm,
)
from rlflow.dataflow.draw import draw
from rlflow.dataflow.graph import build_graph, mfcs_of, model_calls, rollout_calls, unroll_graph, version_edges
from rlflow.dataflow.mfc import INTERFACE_TYPES, OBJECTIVES, PAIR_OBJECTIVES, MFCDef, ParamReallocHook

__all__ = [
    "INTERFACE_TYPES",
    "OBJECTIVES",
    "PAIR_OBJECTIVES",
    "Algorithm",
    "GraphOptions",
    "MFCDef",
    "ParamReallocHook",
    "algorithm_graph",
    "algorithm_mfcs",
    "build_graph",
    "draw",
    "get_algorithm",
    "list_algorithms",
    "mfcs_of",
    "model_calls",
    "register_algorithm",
    "rollout_calls",
    "unroll_graph",
    "version_edges",
]
