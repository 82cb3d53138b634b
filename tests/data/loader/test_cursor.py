"""The consumer's position in a loader's sources (torchshard.data._loader.cursor): a ``Cursor`` per
epoch moves as batches are taken and starts over at the end; through a loader, an epoch that
was replaced no longer moves the loader's position."""

import re

import numpy as np
import pytest

import torchshard as ts
from torchshard.data._loader.cursor import Cursor


def test_a_cursor_advances_per_batch_and_keeps_the_sources_state():
    cursor = Cursor(None, 0)
    assert (cursor.snapshot, cursor.next_batch) == (None, 0)
    cursor.advance([{"pos": 1}])
    cursor.advance([{"pos": 2}])
    assert (cursor.snapshot, cursor.next_batch) == ([{"pos": 2}], 2)


def test_the_end_starts_the_next_epoch_at_batch_0():
    cursor = Cursor([{"pos": 3}], 3)
    cursor.end([{"pos": "end"}])
    assert (cursor.snapshot, cursor.next_batch) == ([{"pos": "end"}], 0)
    cursor.end(None)  # sources that are not stateful: no snapshot
    assert (cursor.snapshot, cursor.next_batch) == (None, 0)


def test_a_resumed_cursor_starts_where_it_was_saved():
    cursor = Cursor([{"pos": 5}], 5)
    cursor.advance(None)
    assert cursor.next_batch == 6 and cursor.snapshot is None


def test_a_cursor_holds_only_its_two_fields():
    cursor = Cursor(None, 0)
    with pytest.raises(AttributeError):
        cursor.other = 1  # __slots__


@pytest.mark.xla
def test_the_loaders_state_follows_the_current_epochs_cursor(mesh8):
    from torchdata.stateful_dataloader import StatefulDataLoader

    source = StatefulDataLoader(list(range(32)), batch_size=8)
    loader = ts.GlobalBatchLoader(source, partition=ts.P("data"), prefetch=0)
    first = iter(loader)
    next(first)
    next(first)
    assert loader.state_dict()["process_0"]["next_batch"] == 2
    second = iter(loader)  # a new epoch: a new cursor
    assert loader.state_dict()["process_0"]["next_batch"] == 0
    got = ts.replicate_to_local_data(next(second))
    assert got.tolist() == list(range(8))
    assert loader.state_dict()["process_0"]["next_batch"] == 1
    with pytest.raises(RuntimeError, match=re.escape("ended before batch 2 by a later iter()")):
        next(first)  # the replaced epoch neither yields nor moves the position
    assert loader.state_dict()["process_0"]["next_batch"] == 1
    assert np.array_equal(ts.replicate_to_local_data(next(second)).numpy(), np.arange(8, 16))
    loader.close()
