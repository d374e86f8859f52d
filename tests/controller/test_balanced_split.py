"""The dp split balanced by tokens: groups stay whole, row order comes back, results equal the row split."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_batch

from rlflow.controller.data_plane import DataFuture, RemoteRows, collect_rows, split_rows
from rlflow.protocol import DataProto, balanced_row_groups


def skewed_lengths(num_rows: int, seed: int = 0) -> list[int]:
    """Response lengths with a heavy tail, sorted longest first: the worst case for a row split."""
    rng = np.random.default_rng(seed)
    return sorted((rng.lognormal(3.0, 1.0, num_rows).clip(1, 500)).astype(int).tolist(), reverse=True)


def tokens(parts: list[DataProto]) -> list[int]:
    return [int(p.batch["attention_mask"].sum()) for p in parts]


def assert_whole_groups(parts: list[DataProto], group_size: int) -> None:
    for part in parts:
        ids = part.batch["id"].tolist()
        groups = [ids[i : i + group_size] for i in range(0, len(ids), group_size)]
        assert all(g == list(range(g[0], g[0] + group_size)) and g[0] % group_size == 0 for g in groups), ids


@pytest.mark.parametrize(("num_parts", "group_size"), [(2, 1), (4, 1), (2, 8), (4, 4)])
def test_balanced_split_of_skewed_lengths_is_near_even_and_keeps_groups(num_parts, group_size):
    lengths = skewed_lengths(256)
    data = make_batch(256, lengths, seq_len=500)
    balanced = split_rows(data, num_parts, group_size=group_size, balance_by="attention_mask")
    by_rows = split_rows(data, num_parts, group_size=group_size)
    got, even = tokens(balanced.parts), tokens(by_rows.parts)
    group_tokens = [sum(lengths[i : i + group_size]) for i in range(0, 256, group_size)]
    # Karmarkar-Karp's guarantee: the spread is at most the heaviest group.
    assert max(got) - min(got) <= max(group_tokens)
    # No split of equal group counts beats the mean, nor the heaviest group with the lightest others.
    per_part = len(group_tokens) // num_parts
    bound = max(sum(lengths) / num_parts, max(group_tokens) + sum(sorted(group_tokens)[: per_part - 1]))
    assert max(got) <= 1.02 * bound and max(got) < 0.7 * max(even)
    assert {len(p) for p in balanced.parts} == {256 // num_parts}  # equal rows per rank
    assert_whole_groups(balanced.parts, group_size)
    back = collect_rows(balanced.parts, balanced.order)
    assert back.batch["id"].tolist() == list(range(256))
    assert torch.equal(back.batch["attention_mask"], data.batch["attention_mask"])


def test_balanced_row_groups_rejects_partial_groups_and_bad_sizes():
    weights = [3, 1, 2, 2]
    assert [sum(weights[i] for i in part) for part in balanced_row_groups(weights, 2)] == [4, 4]
    with pytest.raises(ValueError, match="whole groups of group_size=4"):
        balanced_row_groups([1.0] * 6, 2, group_size=4)
    with pytest.raises(ValueError, match="group_size=0 must be a positive int"):
        balanced_row_groups([1.0] * 6, 2, group_size=0)
    with pytest.raises(KeyError, match="'tokens'"):
        split_rows(make_batch(4), 2, balance_by="tokens")


def _fake_future(parts: list[DataProto], positions: list[np.ndarray] | None) -> tuple[DataFuture, dict]:
    """A future whose parts are held in a dict instead of the object store (refs are dict keys)."""
    store = {f"part{i}": p for i, p in enumerate(parts)} | {f"rows{i}": len(p) for i, p in enumerate(parts)}
    fut = DataFuture(
        refs=[f"part{i}" for i in range(len(parts))],
        fetch=lambda refs: [store[r] for r in refs],
        collect=lambda outs: collect_rows(outs, positions),
        part_index=list(range(len(parts))),
        order=positions,
        num_rows_refs=[f"rows{i}" for i in range(len(parts))],
        weigh=lambda key: [np.asarray(p.row_weights(key)) for p in parts],
    )
    return fut, store


def _materialize(rows: RemoteRows, store: dict) -> DataProto:
    assert rows.perm is None
    return DataProto.concat([store[ref][sel] for ref, sel in rows.pieces])


@pytest.mark.parametrize("shuffled", [False, True])
def test_balanced_resplit_of_a_future_moves_whole_groups_and_restores_order(shuffled):
    lengths = skewed_lengths(48, seed=1)
    data = make_batch(48, lengths, seq_len=500)
    # The producing call held 3 parts: consecutive rows, or a permutation (itself a balanced split).
    order = [np.arange(0, 16), np.arange(16, 32), np.arange(32, 48)]
    if shuffled:
        perm = np.random.default_rng(2).permutation(12)
        rows = np.concatenate([np.arange(g * 4, g * 4 + 4) for g in perm])
        order = [rows[0:16], rows[16:32], rows[32:48]]
    fut, store = _fake_future([data[o] for o in order], order if shuffled else None)
    split = split_rows(fut, 2, group_size=4, balance_by="attention_mask")
    parts = [_materialize(p, store) for p in split.parts]
    for part, received in zip(parts, split.order):
        assert part.batch["id"].tolist() == received.tolist()  # the order says where each row came from
    got = tokens(parts)
    assert max(got) - min(got) <= max(sum(lengths[i : i + 4]) for i in range(0, 48, 4))
    assert sorted(sum((p.batch["id"].tolist() for p in parts), [])) == list(range(48))
    for part in parts:  # whole groups of the collected order
        assert {i // 4 for i in part.batch["id"].tolist()} == {
            g for g in range(12) if g * 4 in part.batch["id"].tolist()
        }
        assert len(part) % 4 == 0
    assert collect_rows(parts, split.order).batch["id"].tolist() == list(range(48))


def test_dp2_calls_through_a_real_group_give_the_rows_of_the_row_split(actor):
    lengths = skewed_lengths(64, seed=3)
    data = make_batch(64, lengths, seq_len=500)
    plain = actor.view([0, 1], row_group_size=4)
    balanced = actor.view([0, 1], row_group_size=4, balance_by="attention_mask")
    expected = plain.tag(data, offset=5)
    actor.take_seen()
    out = balanced.tag(data, offset=5)
    seen = [s[-1] for s in actor.take_seen()[:2]]
    assert torch.equal(out.batch["id"], expected.batch["id"]) and torch.equal(out.batch["y"], expected.batch["y"])
    assert torch.equal(out.batch["attention_mask"], data.batch["attention_mask"])
    per_rank = [sum(lengths[i] for i in rows) for rows in seen]
    assert max(per_rank) - min(per_rank) <= max(sum(lengths[i : i + 4]) for i in range(0, 64, 4))
    assert all(len(rows) == 32 and all(rows[i] % 4 == 0 for i in range(0, 32, 4)) for rows in seen)
    # Rows that live in the object store (a previous call's future) are re-split the same way.
    sampled = actor.view([0, 1]).async_sample(data[:16], n=4)  # 16 prompts x 4 samples, row split
    chained = balanced.async_tag(sampled).get()
    actor.take_seen()
    assert chained.batch["id"].tolist() == np.repeat(np.arange(16), 4).tolist()
    assert torch.equal(chained.batch["attention_mask"], data.batch["attention_mask"][:16].repeat_interleave(4, dim=0))


def test_the_runner_balances_the_views_of_calls_declared_balanced_dp():
    import networkx as nx

    from rlflow.dataflow.mfc import MFCDef
    from rlflow.strategy import ParallelStrategy
    from rlflow.trainer.runner import CallPlacement, DataflowRunner

    class Recorder:
        ranks = [0, 1]

        def __init__(self) -> None:
            self.views: list[dict] = []

        def view(self, ranks, strategy=None, **kwargs):
            self.views.append(kwargs)
            return kwargs

    graph = nx.DiGraph()
    calls = [
        MFCDef("gen", "actor", "generate", output_keys=("input_ids", "attention_mask")),
        MFCDef("train", "actor", "train_step", input_keys=("input_ids",), balanced_dp=True, objective="rl"),
    ]
    for mfc in calls:
        graph.add_node(mfc.name, mfc=mfc)
    graph.add_edge("gen", "train")
    placements = {m.name: CallPlacement(m, (0, 1), ParallelStrategy(dp=2)) for m in calls}
    runner = DataflowRunner(Recorder(), graph, placements, row_group_size=4)
    assert runner.views["gen"] == {"row_group_size": 1, "balance_by": None}
    assert runner.views["train"] == {"row_group_size": 4, "balance_by": "attention_mask"}
