"""Tiny models, batches, losses and a single-process reference for the training-engine tests."""

from __future__ import annotations

import torch
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForTokenClassification,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from rlflow.families import get_family

VOCAB = 96
GLOBAL_ROWS = 8
SEQ = 14
LR = 1e-3
# AdamW's epsilon in the engine and the reference alike. Adam divides each gradient element by its
# own magnitude, so an element whose gradient is at float32's rounding level of the sums behind it
# (a few 1e-9 against terms of 1e-3) moves by whatever that rounding says: the engine's other
# summation order (micro-batches, tied-embedding gradients summed over stages) then changes its
# update by a tenth of the learning rate. An epsilon of 1e-6 leaves such elements still and every
# other update as it was (gradients here are ~1e-3).
ADAM_EPS = 1e-6


def build_model(family: str = "llama", *, tied: bool = False, head: str = "lm", seed: int = 0) -> nn.Module:
    """Hidden 64, 4 layers, 4 heads, 2 kv heads (GQA), vocabulary 96; same weights for one seed."""
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    if head == "value":
        return LlamaForTokenClassification(LlamaConfig(num_labels=1, **kwargs))
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**kwargs))
    if family != "llama":  # another family, a generic one included: its own config and class
        record = get_family(family)  # token ids inside the tiny vocabulary (some defaults are not)
        return record.causal_lm_class(record.build_config(**kwargs, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    return LlamaForCausalLM(LlamaConfig(**kwargs))


def make_batch(seed: int = 1) -> dict[str, torch.Tensor]:
    """Left-padded prompts + right-padded responses of mixed lengths, like a rollout batch."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (GLOBAL_ROWS, SEQ), generator=g)
    mask = torch.zeros(GLOBAL_ROWS, SEQ, dtype=torch.long)
    response = torch.zeros(GLOBAL_ROWS, SEQ, dtype=torch.long)
    prompt_end = 6
    for r in range(GLOBAL_ROWS):
        p_len = 2 + (r * 3) % 5  # 2..6 prompt tokens
        r_len = 1 + (r * 5) % 8  # 1..8 response tokens
        mask[r, prompt_end - p_len : prompt_end + r_len] = 1
        response[r, prompt_end : prompt_end + r_len] = 1
    ids = ids * mask
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "response_mask": response,
        "advantages": torch.randn(GLOBAL_ROWS, SEQ, generator=g) * response,
        "old_log_probs": -4.5 + 0.1 * torch.randn(GLOBAL_ROWS, SEQ, generator=g),
        "returns": torch.randn(GLOBAL_ROWS, SEQ, generator=g) * response,
    }


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum()


def actor_loss(outputs: dict, batch: dict) -> tuple[torch.Tensor, dict]:
    """A PPO-like surrogate with an entropy bonus: mean over response tokens."""
    mask = batch["response_mask"].float()
    ratio = torch.exp(outputs["log_probs"] - batch["old_log_probs"])
    pg = _masked_mean(-ratio * batch["advantages"], mask)
    entropy = _masked_mean(outputs["entropy"], mask)
    return pg - 0.01 * entropy, {"entropy": float(entropy.detach())}


def critic_loss(outputs: dict, batch: dict) -> tuple[torch.Tensor, dict]:
    mask = batch["response_mask"].float()
    loss = _masked_mean((outputs["values"] - batch["returns"]) ** 2, mask)
    return loss, {}


def dp_rows(dp_rank: int, dp: int) -> torch.Tensor:
    """The dp-local rows of the global batch (contiguous blocks)."""
    return torch.arange(GLOBAL_ROWS).chunk(dp)[dp_rank]


def local_batch(batch: dict, dp_rank: int, dp: int) -> dict:
    rows = dp_rows(dp_rank, dp)
    return {k: v[rows] for k, v in batch.items()}


def mini_batch_rows(dp: int, num_mini_batches: int) -> list[torch.Tensor]:
    """Global rows of each mini-batch: mini-batch k is the union of every dp rank's k-th chunk."""
    return [
        torch.cat([dp_rows(d, dp).tensor_split(num_mini_batches)[k] for d in range(dp)])
        for k in range(num_mini_batches)
    ]


def reference_outputs(model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
    """Plain-HF log-probs/entropies (LM) or values (value head), position ids from the mask."""
    mask = batch["attention_mask"]
    pos = ((mask.cumsum(1) - 1) * mask).clamp(min=0)
    out = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=pos)
    if isinstance(model, LlamaForTokenClassification):
        return {"values": out.logits.squeeze(-1)}
    logp_all = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)
    logp = logp_all.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    valid = (pos[:, 1:] > 0).float()
    zero = torch.zeros(mask.shape[0], 1)
    return {"log_probs": torch.cat([zero, logp * valid], 1), "entropy": torch.cat([zero, ent * valid], 1)}


def reference_train(model: nn.Module, batch: dict, *, dp: int, num_mini_batches: int, max_grad_norm: float):
    """Single-process AdamW steps on the global mini-batches; returns (mean loss, mean grad norm)."""
    model.eval()  # no dropout: the engine's heads are deterministic
    loss_fn = critic_loss if isinstance(model, LlamaForTokenClassification) else actor_loss
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, eps=ADAM_EPS)
    losses, norms = [], []
    for rows in mini_batch_rows(dp, num_mini_batches):
        mini = {k: v[rows] for k, v in batch.items()}
        loss, _ = loss_fn(reference_outputs(model, mini), mini)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return sum(losses) / len(losses), sum(norms) / len(norms)
