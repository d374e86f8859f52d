"""A step's rollouts as JSON lines (``logging.rollouts_every``): what the policy was asked, what it
answered and how it was scored, one line a row, in ``{run dir}/rollouts/step_{N}.jsonl``.

The trainer fetches the rows of the step's first generate call and of the call that scores them
(the producer of ``rewards``) to the driver on the steps it writes, and only then.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlflow.engine.rollout.given import GIVEN_RESPONSE
from rlflow.protocol import DataProto
from rlflow.workers.interfaces.reward import decode_rollout

__all__ = ["ROLLOUTS_DIR", "rollout_records", "write_rollouts"]

ROLLOUTS_DIR = "rollouts"


def _plain(value: Any) -> Any:
    """A JSON value of a row's column entry (numpy scalars and arrays as Python ones)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def rollout_records(tokenizer: Any, generated: DataProto, scored: DataProto | None) -> list[dict[str, Any]]:
    """One record a row of ``generated``: ``prompt`` (the real tokens before the first sampled one),
    ``response`` (every real token after the prompt: a multi-turn row's observations included),
    ``response_tokens`` (sampled tokens), ``reward`` from ``scored`` when given, ``answer`` and
    ``group`` (the row's ``answers`` and ``uid`` columns) and ``given`` (true where the response was the
    row's completion, not a sample: GKD's mixed rollouts) when the rows hold them.

    Raises:
        ValueError: ``scored`` has another number of rows than ``generated``.
    """
    ids, real = generated.batch["input_ids"], generated.batch["attention_mask"].bool()
    sampled = generated.batch["response_mask"].bool()
    after = sampled.long().cumsum(dim=1) > 0  # from the first sampled token on
    prompts, _ = decode_rollout(tokenizer, ids, real, sampled)
    responses = [tokenizer.decode(row[m].tolist(), skip_special_tokens=True) for row, m in zip(ids, real & after)]
    records = [
        {"prompt": p, "response": r, "response_tokens": int(n)}
        for p, r, n in zip(prompts, responses, sampled.sum(dim=1).tolist())
    ]
    if scored is not None:
        rewards = scored.batch["rewards"]
        if len(rewards) != len(records):
            raise ValueError(f"{len(rewards)} rewards for {len(records)} rollouts")
        for record, reward in zip(records, torch.as_tensor(rewards).float().tolist()):
            record["reward"] = reward
    for column, key in (("answers", "answer"), ("uid", "group"), (GIVEN_RESPONSE, "given")):
        if column in generated.non_tensor_keys:
            for record, value in zip(records, generated.non_tensor_batch[column]):
                record[key] = _plain(value)
    return records


def write_rollouts(run_dir: Path, step: int, records: list[dict[str, Any]]) -> Path:
    """Writes ``records`` to ``{run_dir}/rollouts/step_{step}.jsonl`` whole (a temporary file
    renamed: a reader never sees half of it); returns the path."""
    directory = Path(run_dir) / ROLLOUTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step}.jsonl"
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps({"step": step, **r}, default=str) + "\n" for r in records))
    os.replace(tmp, path)
    return path
