"""The trainer's data: records from a synthetic task or data files, loaders, and batches as DataProto.

Every algorithm reads its rows under the dataflow keys of ``rlflow.dataflow.algorithms``:

* RL algorithms (dataset ``prompts``: PPO, GRPO, ReMax, RLOO, REINFORCE++): ``prompts`` / ``prompt_mask`` (left-padded) and the
  non-tensor ``answers`` (ground truths for rule-based rewards), ``uid`` (prompt index) and ``columns`` (each row's fields);
* SFT (dataset ``examples``): ``input_ids`` / ``attention_mask`` / ``loss_mask`` (right-padded prompt + answer);
* DPO and reward modelling (dataset ``pairs``): the same keys with pairs interleaved, row ``2i`` chosen and
  ``2i+1`` rejected.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlflow.data.datasets import (
    DatasetFormatError,
    PreferenceDataset,
    PromptDataset,
    SFTDataset,
    collate_sft,
)
from rlflow.data.files import data_format, read_records
from rlflow.data.loader import StatefulDataLoader
from rlflow.data.tasks import ArithmeticTask, CountdownTask, TaskExample, solve_countdown
from rlflow.engine.rollout.given import COMPLETION
from rlflow.protocol import DataProto
from rlflow.trainer.config import ConfigError, RLFlowConfig
from rlflow.workers.environments import MultiTurnSetup, import_object, trace_example
from rlflow.workers.reward_funcs import RewardFuncs, required_columns
from rlflow.workers.rewards import check_ground_truth

logger = logging.getLogger(__name__)

# Enough training problems that a short run never repeats a prompt within an epoch; a task
# with fewer distinct training problems (1-digit arithmetic) gives all it has.
TASK_TRAIN_SIZE = 4096
# Problem spaces up to these sizes are listed to size the requests; larger ones hold far more
# than TASK_TRAIN_SIZE problems per split.
_LIST_ARITHMETIC_BELOW = 200_000  # (a, op, b) triples
_LIST_COUNTDOWN_BELOW = 2_000  # multisets of numbers (each one solved)


@dataclass
class TrainerData:
    """Loaders of one run.

    Attributes:
        train: batches of the algorithm (prompts for RL; pairs for DPO/RM; examples for SFT).
        eval_prompts: held-out prompts with answers, scored by greedy generation (RL and SFT).
        warmup: SFT batches for the warm-up stage before RL (``None`` without warm-up).
        reward_fn: rule-based reward named by the task or the config, or Python reward functions.
        columns: the training records' fields (``prompt`` and every other column; RL algorithms).
    """

    train: StatefulDataLoader
    eval_prompts: DataProto | None
    warmup: StatefulDataLoader | None
    reward_fn: str | RewardFuncs | None
    columns: tuple[str, ...] = ()


def split_examples(task: ArithmeticTask | CountdownTask, split: str) -> list[TaskExample] | None:
    """Every problem of ``split`` when the task's problem space is small enough to list, else None.

    >>> len(split_examples(ArithmeticTask(num_digits=1, seed=0), "test"))
    13
    """
    if isinstance(task, ArithmeticTask):
        if task.num_problems > _LIST_ARITHMETIC_BELOW:
            return None
        high = range(10**task.num_digits)
        triples = ((a, op, b) for op in task.ops for a in high for b in high)
        return [task.example(*t) for t in triples if task.split_of(*t) == split]
    if math.comb(task.max_number + task.num_numbers - 1, task.num_numbers) > _LIST_COUNTDOWN_BELOW:
        return None
    out = []
    for numbers in itertools.combinations_with_replacement(range(1, task.max_number + 1), task.num_numbers):
        for target, solution in solve_countdown(list(numbers), task.use_all).items():
            if target <= task.max_target and task.split_of(list(numbers), target) == split:
                out.append(task.example(list(numbers), target, solution))
    return out


def task_records(cfg: RLFlowConfig, split: str, size: int) -> list[dict[str, Any]]:
    """``size`` distinct problems of the task's ``split`` as records, sized by what the task holds.

    Training asks for ``TASK_TRAIN_SIZE`` and takes every problem when the split holds fewer.
    Held-out evaluation asks for exactly ``data.eval_size``. The run's seed draws the training
    problems; the split's seed (``data.split_seed``, else the run's) draws the held-out ones, so
    runs that share a split are scored on the same problems.

    Raises:
        ConfigError: the test split holds fewer than ``size`` problems (names ``data.eval_size``).
    """
    task = cfg.data.build_task(cfg.seed)
    seed = cfg.seed if split == "train" else task.seed
    listed = split_examples(task, split)
    if listed is None or size < len(listed):
        return [e.to_dict() for e in task.sample(split, size, seed=seed)]
    if split == "test" and size > len(listed):
        raise ConfigError(
            "data.eval_size",
            f"{size}, but the {task.name} task holds only {len(listed)} held-out problems with these data settings "
            f"({task.test_fraction:.0%} of all); set data.eval_size <= {len(listed)} or enlarge the task",
        )
    random.Random(f"{task.name}|{split}|{seed}").shuffle(listed)
    return [e.to_dict() for e in listed]


def _records(cfg: RLFlowConfig, split: str, size: int) -> list[dict[str, Any]] | str:
    """Task examples as records, or the configured data file.

    Raises:
        ConfigError: the file's format is not one ``datasets`` reads here (names the key).
    """
    key = "data.train_file" if split == "train" else "data.eval_file"
    path = cfg.data.train_file if split == "train" else cfg.data.eval_file
    if path is not None:
        try:
            data_format(path)
        except ValueError as err:
            raise ConfigError(key, str(err)) from None
        return path
    if cfg.data.task is None:
        raise ValueError(f"data.{split}_file is not set and data.task is null: nothing to train on")
    return task_records(cfg, split, size)


def build_trainer_data(
    cfg: RLFlowConfig, tokenizer, reward_funcs: RewardFuncs | None = None, multi_turn: MultiTurnSetup | None = None
) -> TrainerData:
    """Datasets and loaders for the algorithm's kind of row (``Algorithm.dataset``) and the warm-up stage.

    Args:
        cfg: the run's config.
        tokenizer: encodes prompts (and answers).
        reward_funcs: Python reward functions scoring responses instead of a named rule; they read
            whatever columns they name, so held-out rows need no ``answer`` then.
        multi_turn: the run's episodes; ``warmup.tool_traces`` runs its traces through them.

    Raises:
        ConfigError: a data file of a format not read here (names ``data.train_file`` or ``data.eval_file``).
        DatasetFormatError: a row lacks what the reward reads (:func:`check_rows`), a row of no
            format the algorithm reads, or a file malformed or empty; the message names the file
            and the line or row.
    """
    dataset_kind, d = cfg.algorithm.record.dataset, cfg.data
    columns: tuple[str, ...] = ()  # the fields of prompt records (RL), passed to reward functions
    max_len = d.max_prompt_len + d.max_response_len
    loader = _loader_factory(cfg)
    reward_fn = reward_funcs or cfg.algorithm.reward_fn
    if reward_fn is None and d.task is not None:
        reward_fn = cfg.data.build_task(cfg.seed).reward_name
    if dataset_kind == "pairs":
        records = _records(cfg, "train", TASK_TRAIN_SIZE)
        pairs = records if isinstance(records, str) else preference_pairs(records, cfg.seed)
        train = loader(PreferenceDataset(pairs, tokenizer, max_len), "data.batch_size", pairs=True)
    elif dataset_kind == "examples":
        train = loader(
            SFTDataset(_records(cfg, "train", TASK_TRAIN_SIZE), tokenizer, max_len), "data.batch_size", sft=True
        )
    else:
        records = _records(cfg, "train", TASK_TRAIN_SIZE)
        dataset = PromptDataset(records, tokenizer, d.max_prompt_len, d.truncation)
        check_rows(dataset, training_reward(cfg, reward_fn))  # every row, before any batch is drawn
        if cfg.algorithm.distill_student_fraction < 1:
            if not isinstance(records, str):
                raise ConfigError(
                    "algorithm.distill_student_fraction",
                    f"{cfg.algorithm.distill_student_fraction:g}: the given responses are the {COMPLETION!r} "
                    f"column of data.train_file's rows; the synthetic task {d.task!r} has none (set data.train_file)",
                )
            check_completions(dataset)
        train, columns = loader(dataset, "data.batch_size"), dataset.columns
    eval_prompts = _eval_prompts(cfg, tokenizer, reward_fn)
    warmup = None
    if cfg.warmup.steps > 0 and cfg.warmup.tool_traces is not None:
        traces = TraceDataset(_records(cfg, "train", TASK_TRAIN_SIZE), tokenizer, cfg.warmup.tool_traces, multi_turn)
        warmup = loader(traces, "warmup.batch_size", sft=True, batch_size=cfg.warmup.batch_size)
    elif cfg.warmup.steps > 0:
        records = _records(cfg, "train", TASK_TRAIN_SIZE)
        from_pairs = isinstance(records, str) and dataset_kind == "pairs"  # DPO's file: SFT on the chosen answers
        sft = SFTDataset(records, tokenizer, max_len, answer_field="chosen" if from_pairs else "answer")
        warmup = loader(sft, "warmup.batch_size", sft=True, batch_size=cfg.warmup.batch_size)
    return TrainerData(train, eval_prompts, warmup, reward_fn, columns)


def training_reward(cfg: RLFlowConfig, reward_fn: str | RewardFuncs | None) -> str | RewardFuncs | None:
    """What scores the training rollouts: ``reward_fn`` (reward functions or a rule), or ``None`` for
    ``models.reward`` (a reward model reads no column; a rule then only scores held-out prompts)."""
    if isinstance(reward_fn, RewardFuncs) or cfg.algorithm.reward_fn is not None or "reward" not in cfg.models:
        return reward_fn
    return None


def ground_truth_of(row: Mapping[str, Any]) -> Any:
    """What a rule reward scores a row against: its ``ground_truth``, else verl's
    ``reward_model["ground_truth"]``, else its ``answer`` (None without any).

    >>> ground_truth_of({"answer": "4", "ground_truth": {"answer": "4", "reverse_digits": True}})
    {'answer': '4', 'reverse_digits': True}
    >>> ground_truth_of({"prompt": [], "reward_model": {"style": "rule", "ground_truth": "72"}})
    '72'
    """
    reward_model = row.get("reward_model")
    verl = reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None
    for value in (row.get("ground_truth"), verl, row.get("answer")):
        if value is not None:
            return value
    return None


def check_rows(dataset: PromptDataset, reward: str | RewardFuncs | None, indices: Iterable[int] | None = None) -> None:
    """Every prompt row (of ``indices``; default all) holds what ``reward`` reads: a rule's ground
    truth, present and parseable by the rule (:func:`~rlflow.workers.rewards.check_ground_truth`),
    or every column a reward function names without a default (one that no row has is left to
    :func:`~rlflow.workers.reward_funcs.check_reward_signature`). Nothing for a reward model (``None``).

    Raises:
        DatasetFormatError: naming where the row is, the reward and what is missing or malformed.
    """
    if reward is None:
        return
    indices = range(len(dataset)) if indices is None else indices
    if isinstance(reward, RewardFuncs):
        # A column no row has is the function's signature's problem, named by check_reward_signature.
        present = set(dataset.columns)
        needs = {
            name: [c for c in required_columns(fn) if c in present] for name, fn in zip(reward.names, reward.load())
        }
        for i in indices:
            for name, columns in needs.items():
                missing = [c for c in columns if c not in dataset[i]]
                if missing:
                    have = sorted(k for k in dataset[i] if k not in ("index", "input_ids"))
                    raise DatasetFormatError(
                        f"{dataset.where(i)}: no column(s) {missing} that reward function {name!r} reads; the row has {have}"
                    )
        return
    for i in indices:
        try:
            check_ground_truth(reward, ground_truth_of(dataset[i]))
        except ValueError as err:
            raise DatasetFormatError(f"{dataset.where(i)}: {err}") from None


def check_completions(dataset: PromptDataset) -> None:
    """Every prompt row holds a string ``completion``: the response a row takes when the student does not
    sample it (``algorithm.distill_student_fraction``, GKD's mixed rows).

    Raises:
        DatasetFormatError: naming where the first row without one is.
    """
    for i in range(len(dataset)):
        completion = dataset[i].get(COMPLETION)
        if not isinstance(completion, str):
            have = sorted(k for k in dataset[i] if k not in ("index", "input_ids"))
            got = "no such column" if completion is None else f"a {type(completion).__name__}"
            raise DatasetFormatError(
                f"{dataset.where(i)}: algorithm.distill_student_fraction < 1 gives rows their {COMPLETION!r} "
                f"(a string: a teacher's sample) as the response; got {got} (the row has {have})"
            )


def _eval_prompts(cfg: RLFlowConfig, tokenizer, reward_fn: str | RewardFuncs | None) -> DataProto | None:
    """The held-out prompts as one batch (the first ``data.eval_size`` of a file, each holding what
    ``reward_fn`` reads); ``None`` when there are none to score (said once, not an error)."""
    d = cfg.data
    if d.eval_size == 0 or not cfg.scores_generations:
        return None
    if d.task is None and d.eval_file is None:
        logger.info(f"no held-out evaluation: data.train_file ({d.train_file}) comes without data.eval_file")
        return None
    eval_set = PromptDataset(_records(cfg, "test", d.eval_size), tokenizer, d.max_prompt_len, d.truncation)
    rows = range(min(d.eval_size, len(eval_set)))
    check_rows(eval_set, reward_fn, rows)
    return prompts_to_proto(eval_set.collate([eval_set[i] for i in rows]))


def preference_pairs(records: list[dict[str, Any]], seed: int) -> list[dict[str, str]]:
    """Task examples → preference pairs: the correct answer chosen, a corrupted one rejected.

    The rejected answer changes one character of the correct one to another digit, so the
    pair differs in exactly the token a model must get right.
    """
    rng = random.Random(seed)
    pairs = []
    for r in records:
        answer = r["answer"]
        digits = [i for i, ch in enumerate(answer) if ch.isdigit()]
        i = rng.choice(digits) if digits else 0
        wrong = rng.choice([d for d in "0123456789" if d != answer[i : i + 1]])
        pairs.append({"prompt": r["prompt"], "chosen": answer, "rejected": answer[:i] + wrong + answer[i + 1 :]})
    return pairs


def _loader_factory(cfg: RLFlowConfig):
    def make(
        dataset, key: str, *, pairs: bool = False, sft: bool = False, batch_size: int | None = None
    ) -> StatefulDataLoader:
        """A loader of full batches; ``key`` names the batch size in errors."""
        to_proto = pairs_to_proto if pairs else (sft_to_proto if sft else prompts_to_proto)
        batch_size = batch_size or cfg.data.batch_size
        if len(dataset) < batch_size:
            raise ConfigError(
                key, f"{batch_size} is more than the {len(dataset)} training examples; one batch must fit in an epoch"
            )
        return StatefulDataLoader(
            dataset,
            batch_size,
            collate_fn=lambda items: to_proto(dataset.collate(items)),
            shuffle=cfg.data.shuffle,
            seed=cfg.seed,
        )

    return make


def _objects(values: list) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def prompts_to_proto(batch: dict[str, Any]) -> DataProto:
    """Collated prompts → ``prompts``, ``prompt_mask``, ``answers``, ``uid`` and ``columns``.

    ``columns`` holds one dict per row with every field of its record (``prompt`` included),
    for reward functions that read any column; ``answers`` is each row's ``ground_truth`` (else
    ``answer``) field the named rule rewards score against (:func:`ground_truth_of`).
    """
    names = [k for k in batch if k not in _COLLATED_KEYS]
    rows = [{k: batch[k][i] for k in names} for i in range(len(batch["index"]))]
    answers = [ground_truth_of(row) for row in rows]
    return DataProto.from_dict(
        tensors={"prompts": batch["input_ids"], "prompt_mask": batch["attention_mask"]},
        non_tensors={
            "answers": _objects(list(answers)),
            "uid": np.asarray(batch["index"], dtype=np.int64),
            "columns": _objects(rows),
        },
    )


_COLLATED_KEYS = ("index", "input_ids", "attention_mask", "position_ids")  # what collate_prompts adds


class TraceDataset:
    """SFT examples of tool use (``warmup.tool_traces``): each training row's turns, as ``fn(row)``
    writes them, run through an episode of the run's tools (:func:`~rlflow.workers.environments.trace_example`).

    An example is built when the loader first reads it (the tools run then): a warm-up reads
    ``steps * batch_size`` rows, often far fewer than the task has. The first row is built at
    construction, so a trace function that does not fit the rows fails before any work.

    Raises:
        ConfigError: no multi-turn tools to run the traces through, or ``fn`` does not import
            (``warmup.tool_traces``).
        DatasetFormatError: a row whose trace fails (the message names the row).
    """

    def __init__(self, source, tokenizer, traces: str, multi_turn: MultiTurnSetup | None) -> None:
        if multi_turn is None:
            raise ConfigError(
                "warmup.tool_traces", "needs tools or an environment (rollout.multi_turn, Trainer(tools=))"
            )
        try:
            self.fn = import_object(traces)
        except ValueError as err:
            raise ConfigError("warmup.tool_traces", str(err)) from None
        self.tokenizer, self.traces = tokenizer, traces
        self.make = multi_turn.episodes(tokenizer)
        self.rows = (
            read_records(source) if isinstance(source, str) else [(f"<records>:{i}", r) for i, r in enumerate(source)]
        )
        self.items: dict[int, dict[str, Any]] = {}
        if self.rows:
            self.__getitem__(0)  # a trace function that does not fit the rows fails here

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index not in self.items:
            where, row = self.rows[index]
            try:
                ids, mask = trace_example(self.make(), row, self.fn(row))
            except (ValueError, KeyError, TypeError) as err:
                raise DatasetFormatError(f"{where}: warmup.tool_traces {self.traces!r}: {err}") from err
            self.items[index] = {"index": index, "input_ids": ids, "loss_mask": mask}
        return self.items[index]

    def collate(self, items):
        return collate_sft(items, self.tokenizer.pad_token_id)


def sft_to_proto(batch: dict[str, Any]) -> DataProto:
    """Collated SFT examples → ``input_ids``, ``attention_mask``, ``loss_mask``."""
    keys = ("input_ids", "attention_mask", "loss_mask")
    return DataProto.from_dict(tensors={k: batch[k] for k in keys})


def pairs_to_proto(batch: dict[str, Any]) -> DataProto:
    """Collated preference pairs → rows interleaved chosen, rejected (``2i``, ``2i+1``)."""
    tensors = {}
    for key in ("input_ids", "attention_mask", "loss_mask"):
        chosen, rejected = batch[f"chosen_{key}"], batch[f"rejected_{key}"]
        tensors[key] = torch.stack([chosen, rejected], dim=1).reshape(-1, chosen.shape[-1])  # (2B, T)
    return DataProto.from_dict(tensors=tensors)
