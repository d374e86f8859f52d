"""Given responses beside sampled ones: the mixed rollouts of GKD (``algorithm.distill_student_fraction``).

Agarwal et al. 2024 ("GKD") train a student on a mix of its own samples and fixed outputs: with
probability ``lambda`` a batch is the student's, otherwise the dataset's outputs (a teacher's samples
in sequence-level KD); TRL's ``GKDTrainer`` draws the choice per batch. Here it is drawn per prompt
within each generate call: :func:`choose_given` picks ``round((1 - lambda) * B)`` of its ``B`` prompts,
those take the ``completion`` of their training row, and the policy samples the others. The given rows
are laid out as sampled ones (:func:`given_rollout`: prompt, response, EOS after it, padding), the
two parts are brought to one width (:func:`pad_responses`) and back into prompt order
(:func:`merge_rollouts`), and each row says which it is in the non-tensor column ``given_response``.

A given row's ``old_logp`` is 0 here: no policy sampled it. The train call puts the student's own
log-probs there before it reads them (:meth:`rlflow.workers.interfaces.actor.ActorInterface.train_step`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rlflow.engine.packing import position_ids_from_mask
from rlflow.engine.rollout.base import assemble_rollout
from rlflow.protocol import DataProto

__all__ = [
    "COMPLETION",
    "GIVEN_RESPONSE",
    "choose_given",
    "completion_ids",
    "given_rollout",
    "given_count",
    "merge_rollouts",
    "pad_responses",
    "sampled_rows",
]

# The training row's field a given response comes from (TRL's prompt-completion format).
COMPLETION = "completion"
# Non-tensor column of rollout rows: True where the response was given, not sampled.
GIVEN_RESPONSE = "given_response"
# Tensors of a rollout that end with the response ((N, R)) or hold prompt and response ((N, P + R)),
# and what pads each; ``position_ids`` are derived from the attention mask.
_RESPONSE_PAD = {"responses": "pad", "response_mask": 0, "old_logp": 0.0}
_ROW_PAD = {"input_ids": "pad", "attention_mask": 0}


def choose_given(num_prompts: int, student_fraction: float, seed: Sequence[int] | int) -> np.ndarray:
    """``(num_prompts,)`` bool: which prompts take their given completion — ``round((1 - f) * B)`` of
    them (halves up), drawn without replacement from a generator seeded by ``seed``.

    >>> int(choose_given(4, 0.5, seed=0).sum()), bool(choose_given(4, 1.0, seed=0).any()), bool(choose_given(3, 0.0, seed=1).all())
    (2, False, True)
    """
    given = np.zeros(num_prompts, dtype=bool)
    count = given_count(num_prompts, student_fraction)
    given[np.random.default_rng(seed).choice(num_prompts, size=count, replace=False)] = True
    return given


def given_count(num_prompts: int, student_fraction: float) -> int:
    """How many of ``num_prompts`` prompts take their given completion: ``round((1 - f) * B)``, halves up.

    >>> given_count(7, 0.5), given_count(5, 0.25), given_count(3, 1.0)
    (4, 4, 0)
    """
    if not 0.0 <= student_fraction <= 1.0:
        raise ValueError(f"student_fraction={student_fraction!r}; expected 0 <= f <= 1")
    return int(np.floor((1.0 - student_fraction) * num_prompts + 0.5))


def sampled_rows(rows: DataProto) -> torch.Tensor | None:
    """``(N,)`` bool: True on the rows the policy sampled, False on given ones; None for rows without
    the ``given_response`` column (a rollout that mixes nothing in)."""
    given = rows.non_tensor_batch.get(GIVEN_RESPONSE)
    return None if given is None else torch.from_numpy(~np.asarray(given, dtype=bool))


def completion_ids(tokenizer, texts: Sequence[str], max_new_tokens: int) -> list[list[int]]:
    """Each completion's tokens (no special tokens) then EOS, as an SFT example ends a string
    completion, cut to ``max_new_tokens`` (a cut one, like a sample the limit stopped, has no EOS).

    Raises:
        ValueError: a completion that is not a string, or one with no token.
    """
    eos = tokenizer.eos_token_id
    out = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"row {i}: {COMPLETION!r} must be a string, got {type(text).__name__}")
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + ([] if eos is None else [eos])
        if not ids:
            raise ValueError(f"row {i}: {COMPLETION!r} {text!r} has no token")
        out.append(ids[:max_new_tokens])
    return out


def given_rollout(prompts: DataProto, responses: Sequence[Sequence[int]], n: int, pad_token_id: int) -> DataProto:
    """The rows of :func:`~rlflow.engine.rollout.base.assemble_rollout` for given responses: each
    prompt's response repeated for its ``n`` sample slots, ``R`` the longest, ``old_logp`` 0.

    Args:
        prompts: ``input_ids`` / ``attention_mask`` ``(B, P)`` (left-padded) and their columns.
        responses: ``B`` token lists.
        n: samples per prompt.
        pad_token_id: fills the response after its end.
    """
    if len(responses) != len(prompts):
        raise ValueError(f"{len(responses)} responses for {len(prompts)} prompts")
    width = max(len(r) for r in responses)
    ids = torch.full((len(responses), width), pad_token_id, dtype=prompts.batch["input_ids"].dtype)
    mask = torch.zeros(len(responses), width, dtype=torch.long)
    for i, r in enumerate(responses):
        ids[i, : len(r)] = torch.tensor(r, dtype=ids.dtype)
        mask[i, : len(r)] = 1
    ids, mask = ids.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0)
    logp = torch.zeros(ids.shape, dtype=torch.float32)
    p = prompts.batch
    return assemble_rollout(p["input_ids"], p["attention_mask"], ids, mask, logp, n, prompts)  # a DataProto


def pad_responses(rollout: DataProto, width: int, pad_token_id: int) -> DataProto:
    """``rollout`` with its responses padded on the right to ``width`` tokens (a no-op at that width)."""
    have = rollout.batch["responses"].shape[1]
    if width < have:
        raise ValueError(f"pad_responses: the responses are {have} tokens wide, more than {width}")
    if width == have:
        return rollout
    tensors = dict(rollout.batch.items())
    for keys in (_RESPONSE_PAD, _ROW_PAD):
        for key, value in keys.items():
            if key in tensors:
                t = tensors[key]
                fill = pad_token_id if value == "pad" else value
                tensors[key] = torch.nn.functional.pad(t, (0, width - have), value=fill)
    if "position_ids" in tensors:
        tensors["position_ids"] = position_ids_from_mask(tensors["attention_mask"])
    out = DataProto.from_dict(tensors, dict(rollout.non_tensor_batch))
    out.meta_info.update(rollout.meta_info)
    return out


def merge_rollouts(
    sampled: DataProto | None, given: DataProto | None, given_prompts: np.ndarray, n: int, pad_token_id: int
) -> DataProto:
    """The rows of both parts in prompt order (prompt ``i``'s ``n`` rows at ``i * n``...), one width,
    with the ``given_response`` column; the sampled part's ``meta_info`` is kept.

    Args:
        sampled: the rollout of the prompts where ``given_prompts`` is False (None when there are none).
        given: :func:`given_rollout` of the prompts where it is True (None when there are none).
        given_prompts: ``(B,)`` bool, :func:`choose_given`.
        n: rows per prompt in both parts.
        pad_token_id: pads the narrower part's responses.
    """
    parts = [(p, flag) for p, flag in ((sampled, False), (given, True)) if p is not None]
    if not parts:
        raise ValueError("merge_rollouts: neither a sampled nor a given part")
    width = max(p.batch["responses"].shape[1] for p, _ in parts)
    keys = parts[0][0].batch_keys  # the engine's tensors (a given part builds every one an engine returns)
    padded = []
    for part, flag in parts:
        part = pad_responses(part, width, pad_token_id).select(batch_keys=keys, meta_info_keys=[])
        part.non_tensor_batch[GIVEN_RESPONSE] = np.full(len(part), flag)
        padded.append(part)
    rows = DataProto.concat(padded)
    # Row order of the concatenation: the sampled prompts' rows, then the given ones'; put each back.
    prompt_order = np.concatenate([np.flatnonzero(given_prompts == flag) for _, flag in parts])
    if len(prompt_order) * n != len(rows):
        raise ValueError(f"merge_rollouts: {len(rows)} rows for {len(prompt_order)} prompts x {n} samples")
    source_row = np.empty(len(rows), dtype=np.int64)
    for position, prompt in enumerate(prompt_order):
        source_row[prompt * n : (prompt + 1) * n] = np.arange(position * n, (position + 1) * n)
    out = rows.reorder(torch.from_numpy(source_row))
    out.meta_info = dict(sampled.meta_info) if sampled is not None else {}
    return out
