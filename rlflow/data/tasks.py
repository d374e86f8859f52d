"""Synthetic tasks with verifiable answers: multi-digit arithmetic and countdown.

Each task yields :class:`TaskExample` s — a prompt, the answer text a model should write
(the SFT target) and a JSON ground truth for the task's rule-based reward
(``reward_name`` in ``rlflow.workers.rewards``). Train and test splits never overlap: a
problem's split is a hash of the task seed and the problem itself, so it does not depend
on how many examples are drawn or in which order.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any, Protocol

__all__ = [
    "SPLITS",
    "ArithmeticTask",
    "CountdownTask",
    "SyntheticTask",
    "TaskExample",
    "solve_countdown",
    "write_jsonl",
]

SPLITS = ("train", "test")


@dataclass(frozen=True)
class TaskExample:
    prompt: str  # what the policy sees
    answer: str  # the text a correct response consists of (SFT target)
    ground_truth: Any  # JSON value the task's reward compares against

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class SyntheticTask(Protocol):
    name: str
    reward_name: str
    seed: int  # fixes the train/test split

    def sample(self, split: str, n: int, seed: int = 0) -> list[TaskExample]: ...


def _in_test_split(key: str, seed: int, test_fraction: float) -> bool:
    digest = hashlib.blake2b(f"{seed}|{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < test_fraction


def _check_split(split: str, test_fraction: float) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; expected one of {SPLITS}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction} must be in (0, 1)")


def _draw_unique(
    split: str, n: int, candidates: Iterator[tuple[str, TaskExample]], max_tries: int
) -> list[TaskExample]:
    """The first ``n`` distinct examples (by key) of ``candidates``; raises if the split runs dry."""
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    seen: dict[str, TaskExample] = {}
    if n == 0:
        return []
    for _, (key, example) in zip(range(max_tries), candidates):
        seen.setdefault(key, example)
        if len(seen) == n:
            return list(seen.values())
    raise ValueError(f"found only {len(seen)} distinct {split} examples in {max_tries} draws; asked for {n}")


class ArithmeticTask:
    """``a <op> b =`` with operands of up to ``num_digits`` digits.

    Args:
        num_digits: operands are drawn from ``[0, 10**num_digits)``.
        ops: operators among ``"+"``, ``"-"``, ``"*"``.
        reverse_answer: write the answer's digits in reverse order (``46`` as ``64``; a minus
            sign stays in front), so the first digit a model writes is the one that depends on
            the fewest input digits. Measured here: a 0.6M-parameter Llama (SFT, lr 1e-3,
            batch 64, 8000 two-digit sums) reached 100% held-out accuracy after 1300 steps
            with reversed answers and 97.8% after 1800 steps in normal order.
        seed: fixes the train/test split.
        test_fraction: share of all problems held out for test.

    >>> ArithmeticTask(reverse_answer=True).example(12, "+", 34)
    TaskExample(prompt='12+34=', answer='64', ground_truth={'answer': '46', 'reverse_digits': True})
    """

    name = "arithmetic"
    reward_name = "numeric_match"
    _ENUMERATE_BELOW = 200_000  # problem spaces up to this size are listed, larger ones sampled

    def __init__(
        self,
        num_digits: int = 2,
        ops: tuple[str, ...] = ("+",),
        reverse_answer: bool = False,
        seed: int = 0,
        test_fraction: float = 0.1,
    ) -> None:
        if num_digits < 1:
            raise ValueError(f"num_digits={num_digits} must be >= 1")
        if not ops or any(op not in ("+", "-", "*") for op in ops):
            raise ValueError(f"ops={ops!r}; expected a non-empty tuple of '+', '-', '*'")
        _check_split("train", test_fraction)
        self.num_digits, self.ops, self.reverse_answer = num_digits, tuple(ops), reverse_answer
        self.seed, self.test_fraction = seed, test_fraction
        self._listed: dict[str, list[tuple[int, str, int]]] = {}

    @property
    def num_problems(self) -> int:
        return (10**self.num_digits) ** 2 * len(self.ops)

    def split_of(self, a: int, op: str, b: int) -> str:
        return "test" if _in_test_split(f"{a}{op}{b}", self.seed, self.test_fraction) else "train"

    def example(self, a: int, op: str, b: int) -> TaskExample:
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        text = str(result)
        if self.reverse_answer:
            sign = "-" if result < 0 else ""
            text = sign + str(abs(result))[::-1]
        return TaskExample(f"{a}{op}{b}=", text, {"answer": str(result), "reverse_digits": self.reverse_answer})

    def sample(self, split: str, n: int, seed: int = 0) -> list[TaskExample]:
        """``n`` distinct problems of ``split``, reproducible from ``seed``."""
        _check_split(split, self.test_fraction)
        rng = random.Random(f"arithmetic|{split}|{seed}")
        if self.num_problems <= self._ENUMERATE_BELOW:
            problems = self._list_split(split)
            if n > len(problems):
                raise ValueError(f"asked for {n} {split} examples; the split holds {len(problems)}")
            return [self.example(*p) for p in rng.sample(problems, n)]
        high = 10**self.num_digits

        def candidates() -> Iterator[tuple[str, TaskExample]]:
            while True:
                a, op, b = rng.randrange(high), rng.choice(self.ops), rng.randrange(high)
                if self.split_of(a, op, b) == split:
                    yield f"{a}{op}{b}", self.example(a, op, b)

        return _draw_unique(split, n, candidates(), max_tries=100 * n + 1000)

    def _list_split(self, split: str) -> list[tuple[int, str, int]]:
        if split not in self._listed:
            high = range(10**self.num_digits)
            self._listed[split] = [
                (a, op, b) for op in self.ops for a in high for b in high if self.split_of(a, op, b) == split
            ]
        return self._listed[split]


_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_ATOM = 3


def solve_countdown(numbers: list[int], use_all: bool = True) -> dict[int, str]:
    """Every positive integer reachable from ``numbers`` with ``+ - * /`` and one expression
    reaching it, each number used at most once (exactly once with ``use_all``).

    Intermediate results stay non-negative integers (subtraction of a smaller from a larger
    number, exact division only), as in the game; the expressions carry only the
    parentheses precedence requires.

    >>> solve_countdown([3, 5, 7])[22]
    '7+3*5'
    """
    found: dict[int, str] = {}
    items = [(Fraction(n), str(n), _ATOM) for n in numbers]
    _search(items, use_all, found, visited=set())
    return dict(sorted(found.items()))


def _search(items: list[tuple[Fraction, str, int]], use_all: bool, found: dict[int, str], visited: set) -> None:
    # A multiset of values (with atoms told apart) reached once has been fully explored.
    state = tuple(sorted((value, prec == _ATOM) for value, _, prec in items))
    if state in visited:
        return
    visited.add(state)
    # Only composite expressions count: a target equal to a given number is no puzzle.
    for value, expr, prec in items if (len(items) == 1 or not use_all) else ():
        if prec != _ATOM and value > 0 and value.denominator == 1:
            found.setdefault(int(value), expr)
    for i in range(len(items)):
        for j in range(len(items)):
            if i == j:
                continue
            rest = [item for k, item in enumerate(items) if k not in (i, j)]
            for combined in _combine(items[i], items[j], ordered=i < j):
                _search([*rest, combined], use_all, found, visited)


def _combine(left, right, ordered: bool):
    """Results of ``left op right``; commutative ops only once per unordered pair."""
    (a, a_expr, a_prec), (b, b_expr, b_prec) = left, right
    candidates = [("+", a + b), ("*", a * b)] if ordered else []
    if a > b:
        candidates.append(("-", a - b))
    if b != 0 and (a / b).denominator == 1 and b != 1:
        candidates.append(("/", a / b))
    for op, value in candidates:
        prec = _PRECEDENCE[op]
        lhs = a_expr if a_prec >= prec else f"({a_expr})"
        rhs = b_expr if b_prec > prec or (b_prec == prec and op in "+*") else f"({b_expr})"
        yield value, f"{lhs}{op}{rhs}", prec


@functools.lru_cache(maxsize=4096)
def _solve_cached(numbers: tuple[int, ...], use_all: bool) -> dict[int, str]:
    return solve_countdown(list(numbers), use_all)


class CountdownTask:
    """Reach a target from a few numbers with ``+ - * /`` (only solvable instances).

    Args:
        num_numbers: how many numbers (3 or 4 keep the solver fast).
        max_number: numbers are drawn from ``[1, max_number]``.
        max_target: targets are drawn from the reachable values in ``[1, max_target]``.
        use_all: every number must be used exactly once (else at most once).
        seed: fixes the train/test split.
        test_fraction: share of instances held out for test.

    >>> example = CountdownTask().sample("train", 1, seed=0)[0]
    >>> sorted(example.ground_truth)
    ['numbers', 'target', 'use_all']
    """

    name = "countdown"
    reward_name = "countdown"

    def __init__(
        self,
        num_numbers: int = 3,
        max_number: int = 10,
        max_target: int = 100,
        use_all: bool = True,
        seed: int = 0,
        test_fraction: float = 0.1,
    ) -> None:
        if not 2 <= num_numbers <= 5:
            raise ValueError(f"num_numbers={num_numbers} must be in [2, 5]")
        if max_number < 1 or max_target < 1:
            raise ValueError(f"max_number={max_number} and max_target={max_target} must be >= 1")
        _check_split("train", test_fraction)
        self.num_numbers, self.max_number, self.max_target, self.use_all = num_numbers, max_number, max_target, use_all
        self.seed, self.test_fraction = seed, test_fraction

    def split_of(self, numbers: list[int], target: int) -> str:
        key = f"{sorted(numbers)}->{target}"
        return "test" if _in_test_split(key, self.seed, self.test_fraction) else "train"

    def example(self, numbers: list[int], target: int, solution: str) -> TaskExample:
        prompt = f"make {target} from {' '.join(map(str, numbers))}:"
        return TaskExample(prompt, solution, {"numbers": list(numbers), "target": target, "use_all": self.use_all})

    def sample(self, split: str, n: int, seed: int = 0) -> list[TaskExample]:
        """``n`` distinct solvable instances of ``split``, reproducible from ``seed``."""
        _check_split(split, self.test_fraction)
        rng = random.Random(f"countdown|{split}|{seed}")

        def candidates() -> Iterator[tuple[str, TaskExample]]:
            while True:
                numbers = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
                solutions = _solve_cached(tuple(numbers), self.use_all)
                # Filtering targets by split before choosing keeps draws cheap for the small split.
                targets = [t for t in solutions if t <= self.max_target and self.split_of(numbers, t) == split]
                if targets:
                    target = rng.choice(targets)
                    yield f"{sorted(numbers)}->{target}", self.example(numbers, target, solutions[target])

        return _draw_unique(split, n, candidates(), max_tries=50 * n + 1000)


def write_jsonl(task: SyntheticTask, path: str | os.PathLike, split: str, n: int, seed: int = 0) -> str:
    """Write ``n`` examples of ``split`` as JSONL lines ``{"prompt", "answer", "ground_truth"}``.

    The file loads with ``PromptDataset`` (RL) and ``SFTDataset`` (SFT); the ground truth
    goes to ``compute_rule_rewards(task.reward_name, ...)``.

    Returns:
        ``path`` as a string.
    """
    examples = task.sample(split, n, seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for example in examples:
            f.write(json.dumps(example.to_dict()) + "\n")
    return str(path)
