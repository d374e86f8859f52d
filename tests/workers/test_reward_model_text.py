"""A TRL reward model (``*ForSequenceClassification``) is scored as TRL's GRPOTrainer scores it: the
row's prompt and the decoded completion (a conversation through the reward tokenizer's chat
template), tokenized again by the reward model's own tokenizer, scored at the last token — equal to
HF's own forward on those texts. rlflow's token-classification reward models keep scoring the
rollout's token ids."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from transformers import (
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForTokenClassification,
)
from worker_helpers import save_sequence_classifier

from rlflow.data.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer
from rlflow.dataflow import MFCDef
from rlflow.dataflow.algorithms import ROLLOUT_KEYS
from rlflow.engine.models import build_value_model, compute_values, sequence_scores
from rlflow.protocol import DataProto
from rlflow.workers.context import CallContext
from rlflow.workers.interfaces.reward import RewardModelInterface
from rlflow.workers.setup import ModelSetup

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)
CHAT = [{"role": "user", "content": "1+1="}]
PROMPTS = [CHAT, "12+30=", "7*8="]
RENDERED = ["<u>1+1=\n<a>", "12+30=", "7*8="]  # the prompts as the run tokenized them
COMPLETIONS = ["2", "42", "56 ok"]
CTX = CallContext(MFCDef("reward_inf", "reward", "inference", ROLLOUT_KEYS, ("rewards",)))


class ValueEngine:
    """The engine's forward for a value head, on one process: the value at each row's last real token."""

    def __init__(self, path) -> None:
        self.model = build_value_model(path)

    def forward(self, batch):
        with torch.no_grad():
            values = compute_values(self.model, batch["input_ids"], batch["attention_mask"])
        return {"rewards": sequence_scores(values, batch["attention_mask"])}


def chat_tokenizer(alphabet: str = DEFAULT_ALPHABET):
    tokenizer = build_char_tokenizer(alphabet=alphabet)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def rollout(tokenizer) -> DataProto:
    """The rollout's rows: BOS and the rendered prompt, then the completion and an EOS, left and right padding."""
    rows = []
    for prompt, completion in zip(RENDERED, COMPLETIONS):
        p = tokenizer(prompt).input_ids  # with BOS
        c = tokenizer(completion, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        rows.append((p, c))
    width = max(len(p) + len(c) for p, c in rows) + 1
    ids, mask, response = [], [], []
    for p, c in rows:
        pad = width - len(p) - len(c) - 1
        ids.append([0] * pad + p + c + [0])
        mask.append([0] * pad + [1] * (len(p) + len(c)) + [0])
        response.append([0] * (pad + len(p)) + [1] * len(c) + [0])
    columns = np.empty(len(PROMPTS), dtype=object)
    columns[:] = [{"prompt": p} for p in PROMPTS]
    tensors = {
        "input_ids": torch.tensor(ids),
        "attention_mask": torch.tensor(mask),
        "response_mask": torch.tensor(response),
    }
    return DataProto.from_dict(tensors, {"columns": columns})


def trl_scores(path, tokenizer) -> torch.Tensor:
    """What TRL's GRPOTrainer computes: HF's forward on the texts its reward tokenizer encodes."""
    texts = [tokenizer.apply_chat_template(CHAT + [{"role": "assistant", "content": "2"}], tokenize=False)]
    texts += [p + c for p, c in zip(PROMPTS[1:], COMPLETIONS[1:])]
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.no_grad():
        return AutoModelForSequenceClassification.from_pretrained(path)(**batch).logits[:, 0]


def interface(path, run_tokenizer_dir) -> RewardModelInterface:
    model = ModelSetup("reward", "reward", str(path), value_head=True)
    return RewardModelInterface(model, SimpleNamespace(tokenizer_path=str(run_tokenizer_dir)))


def test_a_trl_reward_model_scores_the_text_as_trl_does(tmp_path):
    run = chat_tokenizer()
    run.save_pretrained(tmp_path / "run_tokenizer")
    save_sequence_classifier(tmp_path / "rm", run)
    out = interface(tmp_path / "rm", tmp_path / "run_tokenizer").inference(
        ValueEngine(tmp_path / "rm"), rollout(run), CTX
    )
    torch.testing.assert_close(out.batch["rewards"], trl_scores(tmp_path / "rm", run), rtol=1e-5, atol=1e-5)


def test_a_trl_reward_model_reads_the_text_with_its_own_tokenizer(tmp_path):
    run, own = chat_tokenizer(), chat_tokenizer(DEFAULT_ALPHABET[::-1])  # other ids for every character
    run.save_pretrained(tmp_path / "run_tokenizer")
    save_sequence_classifier(tmp_path / "rm", own)
    out = interface(tmp_path / "rm", tmp_path / "run_tokenizer").inference(
        ValueEngine(tmp_path / "rm"), rollout(run), CTX
    )
    torch.testing.assert_close(out.batch["rewards"], trl_scores(tmp_path / "rm", own), rtol=1e-5, atol=1e-5)


def test_an_rlflow_reward_model_scores_the_rollouts_tokens(tmp_path):
    run = chat_tokenizer()
    run.save_pretrained(tmp_path / "run_tokenizer")
    config = LlamaConfig(vocab_size=len(run), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1)  # fmt: skip
    LlamaForTokenClassification(config).save_pretrained(tmp_path / "rm")
    data = rollout(run)
    engine = ValueEngine(tmp_path / "rm")
    scorer = interface(tmp_path / "rm", tmp_path / "run_tokenizer")
    assert not scorer.scores_text
    out = scorer.inference(engine, data, CTX)
    want = engine.forward({k: data.batch[k] for k in ("input_ids", "attention_mask")})["rewards"]
    assert torch.equal(out.batch["rewards"], want)
