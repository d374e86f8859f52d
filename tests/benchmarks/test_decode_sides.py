"""benchmarks/decode_sides.py (bench_sampler's decode records) runs end to end at a tiny size."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import decode_sides

TINY = {
    **decode_sides.DECODE,
    "model": {**decode_sides.DECODE["model"], "hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2},
    "prompts": 2,
    "samples": 2,
    "new_tokens": 4,
    "threads": (1,),
    "repeats": 1,
    "copy_bytes": 1 << 20,
}


def test_decode_records_time_every_side_and_say_why_vllm_is_skipped(tmp_path):
    records = decode_sides.run_decode({**TINY, "model": {**TINY["model"], "intermediate_size": 128}}, tmp_path)
    assert [(r["precision"], r["threads"]) for r in records] == [("bf16", 1), ("fp32", 1)]
    for record in records:
        assert record["rows"] == 4 and record["new_tokens"] == 4 and record["prompt_len"] == 8
        itemsize = 2 if record["precision"] == "bf16" else 4
        assert record["decode_bytes_per_step"] == decode_sides.decode_bytes_per_step(
            _config(), rows=4, prompt_len=8, new_tokens=4, itemsize=itemsize
        )
        assert record["copy_gb_per_s"] > 0
        assert "vLLM venv" in record["sides"]["vllm"]["skipped"]  # tmp_path holds no venv
        for side in ("rlflow", "generate"):
            figures = record["sides"][side]
            assert figures["seconds"] > 0 and figures["prefill_seconds"] > 0 and figures["cpu_seconds"] > 0
            assert figures["ms_per_token"] == pytest.approx(figures["seconds"] / 4 * 1e3, rel=0.02)
            assert set(figures) >= {"decode_step_ms", "decode_gb_per_s", "share_of_copy_bandwidth"}
        assert "ratio_to_rlflow" in record["sides"]["generate"] and "ratio_to_rlflow" not in record["sides"]["rlflow"]
    assert records[1]["rlflow_decoder"].startswith("native C++")  # fp32 and small: the C++ step
    assert records[0]["rlflow_decoder"].startswith("lean torch")  # bf16: the torch twin


def _config(tied: bool = True) -> SimpleNamespace:
    """The tiny model's config fields that decode_bytes_per_step reads."""
    return SimpleNamespace(
        hidden_size=64, num_hidden_layers=2, intermediate_size=128, vocab_size=100, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip


def test_bytes_per_step_count_an_untied_head_twice():
    tied = decode_sides.decode_bytes_per_step(_config(), rows=1, prompt_len=2, new_tokens=2, itemsize=4)
    untied = decode_sides.decode_bytes_per_step(_config(tied=False), rows=1, prompt_len=2, new_tokens=2, itemsize=4)
    assert untied - tied == 100 * 64 * 4
