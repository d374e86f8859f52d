"""Synthetic tasks: correct answers, disjoint splits, solvable countdowns, JSONL round trip."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from rlflow.data import (
    ArithmeticTask,
    CountdownTask,
    PromptDataset,
    SFTDataset,
    build_char_tokenizer,
    solve_countdown,
    write_jsonl,
)
from rlflow.workers.rewards import compute_rule_rewards, evaluate_expression


def parse_arithmetic(prompt: str) -> tuple[int, str, int]:
    body = prompt.removesuffix("=")
    op = next(c for c in "+-*" if c in body[1:])  # body[0] is a digit: operands are non-negative
    a, b = body.split(op, 1)
    return int(a), op, int(b)


def test_arithmetic_answers_and_reversed_format():
    for reverse in (False, True):
        task = ArithmeticTask(num_digits=2, ops=("+", "-", "*"), reverse_answer=reverse, seed=3)
        for example in task.sample("train", 200, seed=1):
            a, op, b = parse_arithmetic(example.prompt)
            result = {"+": a + b, "-": a - b, "*": a * b}[op]
            written = str(abs(result))[::-1] if reverse else str(abs(result))
            assert example.answer == ("-" if result < 0 else "") + written
            assert example.ground_truth == {"answer": str(result), "reverse_digits": reverse}
    assert ArithmeticTask(reverse_answer=True).example(60, "+", 40).answer == "001"


def test_arithmetic_splits_partition_the_problem_space():
    task = ArithmeticTask(num_digits=1, ops=("+", "-"), seed=0, test_fraction=0.2)
    train = {e.prompt for e in task.sample("train", len(task._list_split("train")))}
    test = {e.prompt for e in task.sample("test", len(task._list_split("test")))}
    assert not train & test and len(train | test) == task.num_problems == 200
    assert 20 <= len(test) <= 60  # about 20% of 200
    with pytest.raises(ValueError, match=f"the split holds {len(test)}"):
        task.sample("test", len(test) + 1)
    # A different task seed draws a different split.
    other = ArithmeticTask(num_digits=1, ops=("+", "-"), seed=1, test_fraction=0.2)
    assert {e.prompt for e in other.sample("test", len(other._list_split("test")))} != test


def test_large_spaces_are_sampled_without_overlap_or_repeats():
    task = ArithmeticTask(num_digits=4, ops=("+", "*"), seed=0)
    train, test = task.sample("train", 300, seed=0), task.sample("test", 100, seed=0)
    assert len({e.prompt for e in train}) == 300 and len({e.prompt for e in test}) == 100
    assert all(task.split_of(*parse_arithmetic(e.prompt)) == "train" for e in train)
    assert all(task.split_of(*parse_arithmetic(e.prompt)) == "test" for e in test)
    assert task.sample("train", 300, seed=0) == train and task.sample("train", 300, seed=1) != train


def brute_force_three(numbers: list[int]) -> set[int]:
    """Every positive integer ((a o b) o c) or (a o (b o c)) over the orders of three numbers,
    with the game's rule that every intermediate is a non-negative integer."""

    def apply(x, op, y):
        if op == "-" and x < y or op == "/" and (y == 0 or x % y):
            return None
        return {"+": x + y, "-": x - y, "*": x * y, "/": x // y if y else None}[op]

    results = set()
    for a, b, c in itertools.permutations(numbers):
        for op1, op2 in itertools.product("+-*/", repeat=2):
            left, right = apply(a, op1, b), apply(b, op2, c)
            for value in (
                apply(left, op2, c) if left is not None else None,
                apply(a, op1, right) if right is not None else None,
            ):
                if value is not None and value > 0:
                    results.add(value)
    return results


@pytest.mark.parametrize("numbers", [[2, 3, 4], [1, 1, 7], [5, 6, 9], [3, 3, 8]])
def test_countdown_solver_matches_brute_force(numbers):
    solutions = solve_countdown(numbers)
    assert set(solutions) == brute_force_three(numbers)
    for target, expr in solutions.items():
        value, used = evaluate_expression(expr)
        assert value == target and sorted(used) == sorted(numbers)


def test_countdown_solver_by_hand():
    solutions = solve_countdown([2, 3, 4])
    assert {24, 20, 18, 14, 10, 9, 5, 1} <= set(solutions) and 23 not in solutions
    subsets = solve_countdown([2, 3, 4], use_all=False)
    for target, expr in subsets.items():
        value, used = evaluate_expression(expr)
        assert value == target and len(used) >= 2 and not Counter(used) - Counter([2, 3, 4])
    assert 7 in subsets and 7 not in solutions  # 3 + 4 needs a subset


@pytest.mark.parametrize("use_all", [True, False])
def test_countdown_instances_are_solvable_and_split(use_all):
    task = CountdownTask(num_numbers=3, max_number=9, max_target=50, use_all=use_all, seed=2)
    train, test = task.sample("train", 60, seed=0), task.sample("test", 20, seed=0)
    for example in train + test:
        gt = example.ground_truth
        assert len(gt["numbers"]) == 3 and all(1 <= n <= 9 for n in gt["numbers"]) and 1 <= gt["target"] <= 50
        assert gt["use_all"] is use_all and example.prompt.startswith(f"make {gt['target']} from ")
    scores = compute_rule_rewards(
        "countdown",
        [e.prompt for e in train + test],
        [e.answer for e in train + test],
        [e.ground_truth for e in train + test],
    )
    assert scores.min().item() == 1.0  # every SFT target solves its instance
    keys = lambda examples: {(tuple(sorted(e.ground_truth["numbers"])), e.ground_truth["target"]) for e in examples}  # noqa: E731
    assert not keys(train) & keys(test) and len(keys(train)) == 60


def test_write_jsonl_feeds_datasets_and_rewards(tmp_path):
    tok = build_char_tokenizer()
    task = ArithmeticTask(reverse_answer=True)
    path = write_jsonl(task, tmp_path / "data" / "train.jsonl", "train", 50, seed=0)
    prompts = PromptDataset(path, tok, max_prompt_length=16)
    sft = SFTDataset(path, tok, max_length=16)
    assert len(prompts) == len(sft) == 50
    items = [prompts[i] for i in range(50)]
    answers = [
        tok.decode(sft[i]["input_ids"][len(items[i]["input_ids"]) :], skip_special_tokens=True) for i in range(50)
    ]
    scores = compute_rule_rewards(
        task.reward_name, [i["prompt"] for i in items], answers, [i["ground_truth"] for i in items]
    )
    assert scores.tolist() == [1.0] * 50
    wrong = compute_rule_rewards(
        task.reward_name,
        [i["prompt"] for i in items],
        [a[::-1] + "1" for a in answers],
        [i["ground_truth"] for i in items],
    )
    assert wrong.sum().item() == 0.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="split='valid'"):
        ArithmeticTask().sample("valid", 1)
    with pytest.raises(ValueError, match="ops=\\('/',\\)"):
        ArithmeticTask(ops=("/",))
    with pytest.raises(ValueError, match="test_fraction=1.0"):
        CountdownTask(test_fraction=1.0)
