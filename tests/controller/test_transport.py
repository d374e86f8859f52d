"""The data plane's transport: object-store reads are zero-copy, and a method's inputs are its own to write."""

from __future__ import annotations

import ray
import torch
from conftest import make_batch


def test_object_store_reads_map_the_stored_buffer_without_a_copy(ray_session):
    data = make_batch(40_000)  # 5.4 MB: stored in the shared-memory object store
    ref = ray.put(data)
    first, second = ray.get(ref), ray.get(ref)
    assert first.batch["id"].data_ptr() == second.batch["id"].data_ptr() != data.batch["id"].data_ptr()
    assert torch.equal(first.batch["attention_mask"], data.batch["attention_mask"])


def test_read_only_methods_see_the_stored_part_itself(actor):
    future = actor.async_tag(make_batch(40_000))  # each rank's output part lands in the object store
    # Two calls read the same stored parts: the same memory each time, nothing copied.
    assert actor.input_address(future) == actor.input_address(future)
    actor.take_seen()


def test_writing_an_input_in_place_does_not_change_what_other_calls_read(actor):
    data = make_batch(40_000)
    future = actor.async_tag(data)
    first = actor.bump_in_place(future)
    assert actor.bump_in_place(future) == first  # the second call read the stored rows, not the first's writes
    assert torch.equal(future.get().batch["id"], data.batch["id"])
    actor.take_seen()


def test_a_part_read_on_the_rank_that_returned_it_is_not_fetched_back(actor):
    """A call's output part goes to the driver; the next call reading it on the same rank takes
    the rows the process still holds (no round trip through the owner) and sees the same rows a
    fetch would give, even when the parts are re-split for another dp size."""
    data = make_batch(64)
    before = actor.local_reads()
    future = actor.async_tag(data)
    tagged = future.get()
    assert actor.input_address(future)  # each rank reads its own part: from its own outputs
    after = actor.local_reads()
    assert all(b > a for a, b in zip(before, after)), (before, after)
    again = actor.async_sample(future, 2).get()  # reads it locally again, then samples
    assert torch.equal(again.batch["id"], tagged.batch["id"].repeat_interleave(2))
    assert torch.equal(tagged.batch["id"], data.batch["id"])
    actor.take_seen()
