"""The verifiers as a run's reward through ``Trainer.fit()``: ``math_verify`` and ``code_tests`` score
the rollouts a model sampled, read back from the rollouts the run wrote (``logging.rollouts_every``).

The policy is built to answer ``77777`` to every prompt (every weight of its decoder layer zero,
every token embedded alike, an LM head that picks ``7``), so each row's reward is known in advance:
``math_verify`` takes ``\\frac{155554}{2}`` for it and not ``77776``; ``77777`` run as a program
passes ``assert True`` and fails ``assert False``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_fit import DRIVER_FIT, GRPO

from rlflow.data.tiny_models import build_tiny_model
from rlflow.data.tokenizer import build_char_tokenizer
from rlflow.trainer import Trainer

pytest.importorskip("math_verify")


@pytest.fixture(scope="module")
def sevens(tmp_path_factory) -> Path:
    """A model directory whose policy samples ``7`` after any context, with the char tokenizer."""
    path = tmp_path_factory.mktemp("sevens")
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2)
    with torch.no_grad():
        for param in model.model.layers.parameters():
            param.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[tokenizer.convert_tokens_to_ids("7")] = 10.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _fit(model: Path, rows: list[dict], reward: str, run_dir: Path) -> tuple[list[dict], list[dict]]:
    train = run_dir.parent / f"{run_dir.name}.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [
        *DRIVER_FIT, "data.task=null", f"data.train_file={train}", "data.eval_size=0", f"algorithm.reward_fn={reward}",
        "data.batch_size=4", "trainer.total_steps=2", "logging.rollouts_every=1", f"logging.dir={run_dir}",
    ]  # fmt: skip
    with Trainer(GRPO, overrides=overrides, model=str(model)) as trainer:
        trainer.fit()
    rollouts = [json.loads(line) for line in (run_dir / "rollouts" / "step_2.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rollouts, [m for m in metrics if "reward_inf/score_mean" in m]


def test_math_verify_scores_the_sampled_answer_by_its_value(sevens, tmp_path):
    rows = [{"prompt": f"{i}?", "answer": "\\frac{155554}{2}" if i % 2 else "77776"} for i in range(8)]
    rollouts, steps = _fit(sevens, rows, "math_verify", tmp_path / "math")
    assert {r["response"] for r in rollouts} == {"77777"}
    assert len(rollouts) == 4 * 2  # 4 prompts a step, 2 samples each
    for r in rollouts:
        assert r["reward"] == (1.0 if r["answer"] == "\\frac{155554}{2}" else 0.0)
    last = steps[-1]["reward_inf/score_mean"]
    assert last == pytest.approx(sum(r["reward"] for r in rollouts) / len(rollouts))


def test_code_tests_runs_the_sampled_program_against_the_rows_tests(sevens, tmp_path):
    cases = [["assert True"], ["assert False"], ["assert True", "assert False"], ["assert 77777 == 77777"]]
    rows = [{"prompt": f"{i}?", "answer": cases[i % 4]} for i in range(8)]
    rollouts, _ = _fit(sevens, rows, "code_tests", tmp_path / "code")
    expected = {"assert True": 1.0, "assert False": 0.0, "assert True|assert False": 0.5}
    for r in rollouts:
        assert r["reward"] == expected.get("|".join(r["answer"]), 1.0)
