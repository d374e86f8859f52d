"""The sequence-level losses, the mismatch corrections and the KL options from the config to a real
``fit()``: two steps of the GRPO recipe on one worker in the driver, each option's metrics logged."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from tiny_fit import DRIVER_FIT, GRPO, TINY_ACTOR

from rlflow.trainer import ConfigError, Trainer, load_config

TINY = [*TINY_ACTOR, *DRIVER_FIT, "trainer.total_steps=2", "algorithm.entropy_coef=0.1"]
MISMATCH = [
    "algorithm.recompute_old_logp=true",
    "algorithm.tis_cap=2.0",
    "algorithm.seq_tis_cap=2.0",
    "algorithm.seq_is_ratio=product",
    "algorithm.seq_mask_low=0.5",
    "algorithm.seq_mask_high=2.0",
    "algorithm.token_mask_low=0.5",
    "algorithm.token_mask_high=2.0",
]
KL = [
    "models.ref.init=copy",
    "models.ref.init_from=actor",
    "algorithm.kl_coef=0.05",
    "algorithm.kl_in_reward=false",
    "algorithm.kl_estimator=k3+",
    "algorithm.kl_target=0.01",
    "algorithm.kl_horizon=10",
]
RUNS = {
    "gspo": (
        ["algorithm.policy_loss=gspo", "algorithm.loss_agg_mode=seq-mean-token-mean", "algorithm.clip_ratio_low=3e-4",
         "algorithm.clip_ratio_high=4e-4"],
        ["seq_ratio_mean", "seq_ratio_min", "seq_ratio_max", "seq_clip_fraction", "clip_fraction"],
    ),
    "cispo_adaptive_k3plus_kl": (
        ["algorithm.policy_loss=cispo", *KL],
        ["is_weight_mean", "clip_fraction", "kl_loss", "kl_coef"],
    ),
    "mismatch": (
        MISMATCH,
        ["mismatch_seq_ratio_mean", "mismatch_seq_truncated_fraction", "mismatch_seq_masked_fraction",
         "mismatch_token_masked_fraction", "is_weight_mean"],
    ),
}  # fmt: skip


def train_records(run_dir: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if any(k.startswith("actor_train/") for k in r)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(RUNS))
def test_fit_runs_the_option_and_logs_its_metrics(name, tmp_path):
    overrides, keys = RUNS[name]
    with Trainer(GRPO, overrides=[*TINY, *overrides, f"logging.dir={tmp_path}"], progress_bars=False) as trainer:
        result = trainer.fit()
    assert result.steps == 2
    steps = train_records(tmp_path)
    assert sorted(steps) == [1, 2]
    for record in steps.values():
        assert math.isfinite(record["actor_train/pg_loss"])
        for key in keys:
            assert math.isfinite(record[f"actor_train/{key}"]), key
    if name == "mismatch":
        # The built-in float32 sampler's log-probs are the trainer's: every ratio is 1, nothing dropped.
        for record in steps.values():
            assert record["actor_train/mismatch_seq_ratio_mean"] == pytest.approx(1.0, abs=1e-4)
            assert record["actor_train/mismatch_token_masked_fraction"] == 0.0
            assert record["actor_train/mismatch_seq_masked_fraction"] == 0.0
    if name.startswith("cispo"):
        # Step 1's KL is 0 (the reference is the actor): the coefficient shrinks by 0.2 * 4 rows / 10.
        assert steps[1]["actor_train/kl_coef"] == pytest.approx(0.05)
        assert steps[2]["actor_train/kl_coef"] == pytest.approx(0.05 * (1 - 0.2 * 4 / 10))


def test_the_config_refuses_a_correction_without_recomputed_log_probs():
    with pytest.raises(ConfigError, match="algorithm.token_mask_high: 2.0 weighs .* recomputes none here"):
        load_config(GRPO, ["placement.use_gpu=false", "algorithm.token_mask_high=2.0"])
    with pytest.raises(ConfigError, match="algorithm.seq_is_ratio"):
        load_config(GRPO, ["algorithm.seq_is_ratio=mean"])
    cfg = load_config(GRPO, ["algorithm.recompute_old_logp=true", "algorithm.seq_mask_high=3"])
    assert cfg.algorithm.mismatch_options() == {"seq_mask_high": 3.0}
