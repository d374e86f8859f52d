"""Dataflow graphs of model function calls (MFCs): declaration, validation, unrolling, drawing."""

from rlflow.dataflow.algorithms import ALGORITHMS, algorithm_graph, algorithm_mfcs
from rlflow.dataflow.draw import draw
from rlflow.dataflow.graph import build_graph, mfcs_of, model_calls, unroll_graph, version_edges
from rlflow.dataflow.mfc import INTERFACE_TYPES, MFCDef, ParamReallocHook

__all__ = [
    "ALGORITHMS",
    "INTERFACE_TYPES",
    "MFCDef",
    "ParamReallocHook",
    "algorithm_graph",
    "algorithm_mfcs",
    "build_graph",
    "draw",
    "mfcs_of",
    "model_calls",
    "unroll_graph",
    "version_edges",
]
