"""DAPO's overlong options in a run: an untrained tiny policy never stops before the limit, so every
response is truncated: its penalty is the full one and, masked out, no step changes the actor."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file
from test_run_dir import fit


def test_overlong_penalty_and_truncation_masking_in_a_run(tmp_path):
    run = tmp_path / "run"
    fit(
        run,
        "trainer.total_steps=2",
        "rollout.max_new_tokens=4",
        "data.max_response_len=4",
        "algorithm.overlong_buffer=3",
        "algorithm.overlong_penalty=0.5",
        "algorithm.mask_truncated=true",
        "algorithm.entropy_coef=0.01",  # a loss with a gradient on every token the mask leaves in
    )
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "actor_train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["actor_gen/response_length"] == 4.0  # every response at the limit, none ending on EOS
        assert r["actor_train/truncated_fraction"] == 1.0
        assert r["actor_train/overlong_penalty_mean"] == -0.5
        assert r["actor_train/empty_step_fraction"] == 1.0 and r["actor_train/grad_norm"] == 0.0
    initial = load_file(run / "models" / "actor" / "model.safetensors")
    final = load_file(run / "final" / "actor" / "model.safetensors")
    assert initial.keys() == final.keys() and all(torch.equal(initial[k], final[k]) for k in initial)
