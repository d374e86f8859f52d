"""Model families as records: one module per HF architecture (see :mod:`rlflow.families.base`).

Importing the package registers every family below.
"""

from rlflow.families.base import (
    HEAD_KINDS,
    DecoderDims,
    LayerFeatures,
    ModelFamily,
    TPKind,
    config_value,
    decoder_layer_shapes,
    family_of,
    get_family,
    list_families,
    register_family,
)
from rlflow.families.llama import LLAMA
from rlflow.families.mistral import MISTRAL
from rlflow.families.qwen2 import QWEN2
from rlflow.families.qwen3 import QWEN3

__all__ = [
    "HEAD_KINDS",
    "LLAMA",
    "MISTRAL",
    "QWEN2",
    "QWEN3",
    "DecoderDims",
    "LayerFeatures",
    "ModelFamily",
    "TPKind",
    "config_value",
    "decoder_layer_shapes",
    "family_of",
    "get_family",
    "list_families",
    "register_family",
]
