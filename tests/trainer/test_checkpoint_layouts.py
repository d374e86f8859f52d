"""Elastic checkpoints without workers: engine files resharded between strategies, and the directory a
resumed run loads (the checkpoint itself when nothing changed, else resharded files and links).

The engine files here are written as ``rlflow.engine.engine_state.save_checkpoint`` writes them,
from full tensors cut by the layouts; tests/trainer/test_elastic_resume.py loads real ones into
live engines.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from rlflow.parallel.layout import build_layout
from rlflow.strategy import ParallelStrategy as S
from rlflow.trainer.checkpoint_layouts import (
    CheckpointLayouts,
    ModelLayout,
    checkpoint_for_layouts,
    read_layouts,
    reshard_engine_dir,
    stage_param_names,
    write_layouts,
)


def tiny_config(tied: bool) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )


def full_state(config) -> dict[str, dict[str, torch.Tensor]]:
    """Full weights and AdamW moments by layout name."""
    layout = build_layout(config, S(), [0], fsdp=True)
    gen = torch.Generator().manual_seed(1)
    return {
        kind: {p.name: torch.randn(p.shape, generator=gen) for p in layout.params}
        for kind in ("params", "exp_avg", "exp_avg_sq")
    }


def write_engine_files(directory: Path, config, strategy: S, full: dict) -> None:
    layout = build_layout(config, strategy, range(strategy.world_size), fsdp=True)
    directory.mkdir(parents=True)
    for rank in layout.ranks:
        names = stage_param_names(config, "lm", layout, layout.coords(rank).pp)
        slices = layout.slices(rank)
        optim = {
            i: {
                "step": torch.tensor(3.0),
                "exp_avg": full["exp_avg"][n][slices[n]],
                "exp_avg_sq": full["exp_avg_sq"][n][slices[n]],
            }
            for i, (_, n) in enumerate(names)
        }
        state = {
            "strategy": {"dp": strategy.dp, "tp": strategy.tp, "pp": strategy.pp},
            "global_step": 3,
            "params": {engine: full["params"][name][slices[name]].clone() for engine, name in names},
            "optim": {"state": optim, "param_groups": [{"lr": 1e-3, "params": list(range(len(names)))}]},
            "scheduler": {"last_epoch": 3},
        }
        torch.save(state, directory / f"rank{rank:05d}.pt")


def read_engine_files(directory: Path, config, strategy: S) -> dict[int, dict]:
    return {r: torch.load(directory / f"rank{r:05d}.pt", weights_only=True) for r in range(strategy.world_size)}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize(("before", "after"), [(S(), S(dp=2, pp=2)), (S(pp=2), S(tp=2)), (S(dp=2, tp=2), S(pp=4))])
def test_engine_files_reshard_weights_and_adamw_moments_exactly(tmp_path, tied, before, after):
    config, saved, new = tiny_config(tied), tmp_path / "saved", tmp_path / "new"
    full = full_state(config)
    write_engine_files(saved, config, before, full)
    reshard_engine_dir(saved, new, config, "lm", before, after)
    expected = tmp_path / "expected"
    write_engine_files(expected, config, after, full)
    got, want = read_engine_files(new, config, after), read_engine_files(expected, config, after)
    for rank in want:
        assert got[rank]["strategy"] == {"dp": after.dp, "tp": after.tp, "pp": after.pp}
        assert list(got[rank]["params"]) == list(want[rank]["params"])  # the stage's parameter order
        assert all(torch.equal(got[rank]["params"][n], t) for n, t in want[rank]["params"].items())
        for index, entry in want[rank]["optim"]["state"].items():
            assert sorted(got[rank]["optim"]["state"][index]) == sorted(entry)
            assert all(torch.equal(got[rank]["optim"]["state"][index][k], v) for k, v in entry.items())
        assert got[rank]["optim"]["param_groups"] == want[rank]["optim"]["param_groups"]
        assert (got[rank]["scheduler"], got[rank]["global_step"]) == ({"last_epoch": 3}, 3)


def test_files_of_another_model_are_refused_by_name(tmp_path):
    config = tiny_config(tied=False)
    write_engine_files(tmp_path / "saved", config, S(), full_state(config))
    with pytest.raises(ValueError, match=r"rank00000.pt: parameters .* are not the stage's"):
        reshard_engine_dir(tmp_path / "saved", tmp_path / "new", tiny_config(tied=True), "lm", S(), S(dp=2))
    with pytest.raises(FileNotFoundError, match="rank00001.pt is missing"):
        reshard_engine_dir(tmp_path / "saved", tmp_path / "new", config, "lm", S(dp=2), S())


def make_checkpoint(path: Path, config, layout: ModelLayout, worker_ranks: tuple[int, ...]) -> None:
    write_engine_files(path / "actor" / "engine", config, layout.strategy, full_state(config))
    (path / "actor" / "hf").mkdir()
    for rank in worker_ranks:
        (path / f"worker_rank{rank:05d}.pt").write_bytes(f"worker {rank}".encode())
    (path / "trainer_state.json").write_text("{}")
    write_layouts(path, CheckpointLayouts({"actor": layout}, worker_ranks), plan_json='{"plan": 1}')


def test_the_same_layouts_load_the_checkpoint_itself(tmp_path):
    config, ckpt = tiny_config(tied=True), tmp_path / "step_2"
    layout = ModelLayout(S(dp=2), (0, 1))
    make_checkpoint(ckpt, config, layout, (0, 1))
    assert read_layouts(ckpt) == CheckpointLayouts({"actor": layout}, (0, 1))
    assert (ckpt / "plan.json").read_text() == '{"plan": 1}'
    # Fewer workers, the same training layout: nothing to reshard.
    now = CheckpointLayouts({"actor": layout}, (0, 1))
    assert checkpoint_for_layouts(ckpt, now, {"actor": config}, tmp_path / "scratch") == ckpt
    assert not (tmp_path / "scratch").exists()


def test_other_layouts_load_a_scratch_directory_of_resharded_files_and_links(tmp_path, caplog):
    config, ckpt, scratch = tiny_config(tied=True), tmp_path / "step_2", tmp_path / "scratch"
    make_checkpoint(ckpt, config, ModelLayout(S(), (0,)), (0,))
    now = CheckpointLayouts({"actor": ModelLayout(S(tp=2), (0, 1))}, (0, 1))
    assert checkpoint_for_layouts(ckpt, now, {"actor": config}, scratch) == scratch
    assert sorted(p.name for p in (scratch / "actor" / "engine").iterdir()) == [
        "engine.json",
        "rank00000.pt",
        "rank00001.pt",
    ]
    assert (scratch / "actor" / "hf").is_symlink() and (scratch / "trainer_state.json").is_symlink()
    assert os.readlink(scratch / "worker_rank00001.pt") == str((ckpt / "worker_rank00000.pt").resolve())
    assert "worker ranks [1] are new" in caplog.text
    models = CheckpointLayouts({"actor": ModelLayout(S(), (0,)), "critic": ModelLayout(S(), (0,), "value")}, (0,))
    with pytest.raises(ValueError, match=r"trainable models \['actor'\], but this run trains \['actor', 'critic'\]"):
        checkpoint_for_layouts(ckpt, models, {"actor": config}, tmp_path / "other")


def test_a_lora_checkpoint_is_refused_in_other_layouts(tmp_path):
    config, ckpt = tiny_config(tied=True), tmp_path / "step_2"
    make_checkpoint(ckpt, config, ModelLayout(S(), (0,)), (0,))
    (ckpt / "actor" / "engine" / "adapter").mkdir()  # what a LoRA engine writes beside its files
    now = CheckpointLayouts({"actor": ModelLayout(S(dp=2), (0, 1))}, (0, 1))
    with pytest.raises(ValueError, match=r"LoRA model's checkpoint resumes only in the layout it was written in"):
        checkpoint_for_layouts(ckpt, now, {"actor": config}, tmp_path / "scratch")


def test_a_checkpoint_without_a_layout_record_loads_as_before(tmp_path):
    (tmp_path / "step_1").mkdir()
    now = CheckpointLayouts({"actor": ModelLayout(S(dp=2), (0, 1))}, (0, 1))
    assert checkpoint_for_layouts(tmp_path / "step_1", now, {}, tmp_path / "scratch") == tmp_path / "step_1"
