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
