"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


@pytest.fixture(scope="module")
def single_mesh() -> DeviceMesh:
    """A one-process gloo world and its ``("pp", "dp", "tp")`` mesh of one rank, for a module's tests."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", torch.zeros(1, 1, 1, dtype=torch.long), mesh_dim_names=("pp", "dp", "tp"))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def one_rank_world(tmp_path):
    """A one-process gloo world, a tiny Llama (tied embeddings) and the char tokenizer on disk."""
    from rlflow.data.tiny_models import build_tiny_model
    from rlflow.data.tokenizer import build_char_tokenizer
    from rlflow.parallel.groups import clear_group_cache
    from rlflow.rendezvous import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(
        "llama", vocab_size=len(tokenizer), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
        tie_word_embeddings=True, seed=0,
    )  # fmt: skip
    with torch.no_grad():  # decisive logits: sampling differences would show
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    yield str(tmp_path)
    clear_group_cache()
    dist.destroy_process_group()
