"""Tests of the loop's data side: padding, DP sharding, length-bucketed shuffling, resumable iteration, corpus."""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from d9dfn.data import (
    BatchLoader,
    BufferSortedDataset,
    DeviceBatches,
    ShardedDataset,
    StatefulBatchIterator,
    pad_stack_1d,
    shard_dataset_data_parallel,
)
from d9dfn.jobs import (
    VOCAB_SIZE,
    ByteWindowDataset,
    decode_bytes,
    stdlib_corpus,
    stdlib_source_files,
)


class Lengths(list):
    """A dataset of ints whose sort key is the item itself."""

    def sort_key(self, index: int) -> int:
        return self[index]


def as_list(batch: torch.Tensor) -> list[int]:
    return batch.tolist()


# ------------------------------------------------------------------------------------------------ pad_stack_1d


@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=6),
    multiple=st.none() | st.integers(1, 5),
    side=st.sampled_from(["right", "left"]),
)
def test_pad_stack_1d_keeps_items_and_pads_the_rest(lengths: list[int], multiple: int | None, side: str) -> None:
    items = [torch.arange(1, n + 1) for n in lengths]
    out = pad_stack_1d(items, -100, padding_side=side, pad_to_multiple_of=multiple)
    width = out.shape[1]
    assert out.shape[0] == len(items)
    assert width >= max(lengths)
    assert width - max(lengths) < (multiple or 1)
    if multiple is not None:
        assert width % multiple == 0
    for row, item in zip(out, items, strict=True):
        n = item.shape[0]
        kept, padding = (row[:n], row[n:]) if side == "right" else (row[width - n :], row[: width - n])
        assert torch.equal(kept, item)
        assert bool((padding == -100).all())


def test_pad_stack_1d_keeps_dtype_and_device_of_bool_masks() -> None:
    out = pad_stack_1d([torch.tensor([True]), torch.tensor([True, True])], False)
    assert out.dtype == torch.bool
    assert out.tolist() == [[True, False], [True, True]]


@pytest.mark.parametrize(
    ("items", "kwargs", "message"),
    [
        ([], {}, "no items"),
        ([torch.ones(2)], {"pad_to_multiple_of": 0}, "pad_to_multiple_of is 0"),
        ([torch.ones(2, 2)], {}, r"item \[0\] has shape \(2, 2\)"),
        ([torch.ones(2), torch.ones(2, dtype=torch.int64)], {}, r"item \[1\] has dtype torch.int64"),
        ([torch.ones(2)], {"padding_side": "middle"}, "padding_side"),
    ],
)
def test_pad_stack_1d_rejects_bad_inputs(items: list[torch.Tensor], kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pad_stack_1d(items, 0, **kwargs)


# ------------------------------------------------------------------------------------------------ ShardedDataset


@given(
    num_items=st.integers(1, 40),
    num_shards=st.integers(1, 6),
    mode=st.sampled_from(["sequential", "chunked"]),
    pad=st.booleans(),
)
def test_sharded_dataset_covers_every_item(num_items: int, num_shards: int, mode: str, pad: bool) -> None:
    shards = [
        list(ShardedDataset(range(num_items), num_shards=num_shards, shard=r, mode=mode, pad=pad))
        for r in range(num_shards)
    ]
    per_shard = -(-num_items // num_shards)
    seen = Counter(itertools.chain.from_iterable(shards))
    assert set(seen) == set(range(num_items))
    if pad:
        assert all(len(s) == per_shard for s in shards)
        # The padding repeats the dataset from its start (several times over if it is shorter than the shards).
        assert sorted(seen.elements()) == sorted(p % num_items for p in range(num_shards * per_shard))
    else:
        assert all(count == 1 for count in seen.values())
    for r, shard in enumerate(shards):
        if mode == "sequential":
            assert shard == [(r + k * num_shards) % num_items for k in range(len(shard))]
        else:
            assert shard == [(r * per_shard + k) % num_items for k in range(len(shard))]


def test_sharded_dataset_matches_d9d_round_robin_example() -> None:
    shards = [list(ShardedDataset(range(14), num_shards=4, shard=r, pad=False)) for r in range(4)]
    assert shards == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10], [3, 7, 11]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_shards": 0, "shard": 0}, "num_shards is 0"),
        ({"num_shards": 2, "shard": 2}, r"shard 2 is outside \[0, 2\)"),
        ({"num_shards": 2, "shard": 0, "mode": "random"}, "mode is 'random'"),
    ],
)
def test_sharded_dataset_rejects_bad_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardedDataset(range(4), **kwargs)


def test_sharded_dataset_raises_index_error_outside_its_length() -> None:
    ds = ShardedDataset(range(4), num_shards=2, shard=0)
    with pytest.raises(IndexError, match=r"index 2 is outside \[0, 2\)"):
        ds[2]
    with pytest.raises(IndexError):
        ds[-1]


def test_shard_dataset_data_parallel_is_one_shard_without_a_process_group() -> None:
    ds = shard_dataset_data_parallel(range(7), mode="chunked")
    assert (ds.num_shards, ds.shard, ds.mode, list(ds)) == (1, 0, "chunked", list(range(7)))


def test_sharded_dataset_forwards_sort_key_and_epoch() -> None:
    inner = BufferSortedDataset(Lengths(range(8)), buffer_size=8, pack_size=2, seed=3)
    ds = ShardedDataset(inner, num_shards=2, shard=1)
    assert [ds.sort_key(i) for i in range(4)] == [ds[i] for i in range(4)]
    assert ds.for_epoch(5).dataset.epoch == 5
    assert ds.state()["dataset"]["seed"] == 3


# ------------------------------------------------------------------------------------------------ BufferSortedDataset


@given(
    keys=st.lists(st.integers(0, 20), min_size=1, max_size=60),
    packs_per_buffer=st.integers(1, 4),
    pack_size=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
)
def test_buffer_sorted_dataset_serves_packs_of_neighbouring_keys(
    keys: list[int], packs_per_buffer: int, pack_size: int, seed: int
) -> None:
    buffer_size = packs_per_buffer * pack_size
    ds = BufferSortedDataset(Lengths(keys), buffer_size=buffer_size, pack_size=pack_size, seed=seed)
    served = [ds.base_index(i) for i in range(len(ds))]
    for start in range(0, len(keys), buffer_size):
        block = served[start : start + buffer_size]
        # Each buffer serves a permutation of its own indices ...
        assert sorted(block) == list(range(start, min(start + buffer_size, len(keys))))
        # ... in packs that are contiguous runs of the buffer's sorted keys.
        packs = [sorted(keys[i] for i in block[k : k + pack_size]) for k in range(0, len(block), pack_size)]
        packs.sort()
        assert [key for pack in packs for key in pack] == sorted(keys[i] for i in block)
        assert all(a[-1] <= b[0] for a, b in itertools.pairwise(packs))
    again = BufferSortedDataset(Lengths(keys), buffer_size=buffer_size, pack_size=pack_size, seed=seed)
    assert [again.base_index(i) for i in reversed(range(len(ds)))] == served[::-1]


def test_buffer_sorted_dataset_reshuffles_per_epoch_and_seed() -> None:
    ds = BufferSortedDataset(Lengths([0] * 40), buffer_size=40, pack_size=4, seed=1)
    orders = [ds.buffer_order(0), ds.for_epoch(1).buffer_order(0), ds.for_epoch(0).buffer_order(0)]
    other_seed = BufferSortedDataset(Lengths([0] * 40), buffer_size=40, pack_size=4, seed=2).buffer_order(0)
    assert orders[0] == orders[2]
    assert orders[0] != orders[1]
    assert orders[0] != other_seed


def test_buffer_sorted_dataset_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="buffer_size 10 is not a positive multiple of pack_size 4"):
        BufferSortedDataset(Lengths(range(8)), buffer_size=10, pack_size=4)
    with pytest.raises(TypeError, match="list has no sort_key"):
        BufferSortedDataset(list(range(8)), buffer_size=4, pack_size=4)
    with pytest.raises(IndexError, match=r"index 8 is outside \[0, 8\)"):
        BufferSortedDataset(Lengths(range(8)), buffer_size=4, pack_size=4)[8]


# ------------------------------------------------------------------------------------------------ StatefulBatchIterator


def make_iterator(num_items: int, **kwargs) -> StatefulBatchIterator:
    return StatefulBatchIterator(list(range(num_items)), **kwargs)


@given(
    num_items=st.integers(1, 30),
    batch_size=st.integers(1, 7),
    seed=st.integers(0, 2**32 - 1),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    stop=st.integers(0, 20),
    more=st.integers(1, 20),
)
def test_stateful_batch_iterator_resumes_exactly(
    num_items: int, batch_size: int, seed: int, shuffle: bool, drop_last: bool, stop: int, more: int
) -> None:
    kwargs = {"batch_size": batch_size, "seed": seed, "shuffle": shuffle, "drop_last": drop_last, "infinite": True}
    if drop_last and num_items < batch_size:
        with pytest.raises(ValueError, match="never yield"):
            make_iterator(num_items, **kwargs)
        return
    uninterrupted = [as_list(b) for b in itertools.islice(make_iterator(num_items, **kwargs), stop + more)]
    first = make_iterator(num_items, **kwargs)
    head = [as_list(b) for b in itertools.islice(first, stop)]
    saved = json.loads(json.dumps(first.state()))  # the state survives a trip through a JSON file
    resumed = StatefulBatchIterator.from_state(list(range(num_items)), saved, **kwargs)
    tail = [as_list(b) for b in itertools.islice(resumed, more)]
    assert head + tail == uninterrupted


@given(
    num_items=st.integers(0, 30),
    batch_size=st.integers(1, 7),
    seed=st.integers(0, 1000),
    drop_last=st.booleans(),
)
def test_stateful_batch_iterator_visits_each_item_once_per_epoch(
    num_items: int, batch_size: int, seed: int, drop_last: bool
) -> None:
    it = make_iterator(num_items, batch_size=batch_size, seed=seed, drop_last=drop_last)
    for epoch in range(2):
        batches = [as_list(b) for b in it]  # a finite iterator runs one epoch per loop
        assert len(batches) == len(it)
        assert all(len(b) == batch_size for b in batches[:-1])
        items = [i for b in batches for i in b]
        assert len(set(items)) == len(items)
        if drop_last:
            assert len(items) == num_items // batch_size * batch_size
        else:
            assert sorted(items) == list(range(num_items))
        assert it.state()["epoch"] == epoch + 1
        assert it.state()["index"] == 0


def test_stateful_batch_iterator_orders_differ_between_epochs_and_follow_the_seed() -> None:
    it = make_iterator(20, batch_size=20, seed=7, infinite=True)
    epoch0, epoch1 = as_list(next(it)), as_list(next(it))
    assert epoch0 != epoch1
    assert as_list(next(make_iterator(20, batch_size=20, seed=7))) == epoch0
    assert as_list(next(make_iterator(20, batch_size=20, seed=8))) != epoch0
    assert as_list(next(make_iterator(5, batch_size=5, shuffle=False))) == [0, 1, 2, 3, 4]


def test_stateful_batch_iterator_resumes_through_sorted_and_sharded_views() -> None:
    def make() -> StatefulBatchIterator:
        keys = Lengths(2 * (i // 16) + i % 2 for i in range(48))  # per buffer: 8 items of one key, 8 of another
        sorted_view = BufferSortedDataset(keys, buffer_size=16, pack_size=8, seed=5)
        shard = ShardedDataset(sorted_view, num_shards=2, shard=1)
        return StatefulBatchIterator(shard, batch_size=4, shuffle=False, infinite=True)

    uninterrupted = [as_list(b) for b in itertools.islice(make(), 12)]
    first = make()
    head = [as_list(b) for b in itertools.islice(first, 7)]
    resumed = make()
    resumed.restore(first.state())
    assert head + [as_list(b) for b in itertools.islice(resumed, 5)] == uninterrupted
    # A batch of the sharded, sorted view holds items of one pack, which here all have the same key.
    assert all(len(set(b)) == 1 for b in uninterrupted)
    assert len({b[0] for b in uninterrupted}) == 6


def test_stateful_batch_iterator_collates_dict_items() -> None:
    data = [{"x": torch.tensor([i, i]), "y": torch.tensor(i)} for i in range(4)]
    batch = next(StatefulBatchIterator(data, batch_size=3, shuffle=False))
    assert batch["x"].shape == (3, 2)
    assert batch["y"].tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seed": 1}, "seed=1 but this iterator has seed=0"),
        ({"batch_size": 3}, "batch_size=3"),
        ({"num_items": 11}, "num_items=11"),
        ({"shuffle": False}, "shuffle=False"),
        ({"index": 99}, "index=99"),
        ({"epoch": -1}, "epoch=-1"),
    ],
)
def test_stateful_batch_iterator_restore_rejects_other_settings(change: dict, message: str) -> None:
    it = make_iterator(10, batch_size=2)
    with pytest.raises(ValueError, match=message):
        it.restore({**it.state(), **change})


def test_stateful_batch_iterator_restore_rejects_a_foreign_dict() -> None:
    with pytest.raises(ValueError, match="state has no 'epoch'"):
        make_iterator(10, batch_size=2).restore({"step": 3})


def test_stateful_batch_iterator_restore_rejects_another_shard_count() -> None:
    state = StatefulBatchIterator(ShardedDataset(range(12), num_shards=2, shard=0), batch_size=2).state()
    with pytest.raises(ValueError, match="dataset="):
        StatefulBatchIterator(ShardedDataset(range(18), num_shards=3, shard=0), batch_size=2).restore(state)


def test_stateful_batch_iterator_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="batch_size is 0"):
        make_iterator(10, batch_size=0)
    with pytest.raises(ValueError, match="3 items make no batch of 4"):
        make_iterator(3, batch_size=4, infinite=True)


# ------------------------------------------------------------------------------------------------ corpus


def test_stdlib_source_files_skips_tests_and_packages() -> None:
    files = stdlib_source_files()
    assert files == sorted(files)
    assert "json/decoder.py" in files
    assert not [f for f in files if {"test", "tests", "site-packages", "__pycache__"} & set(f.split("/")[:-1])]


def test_stdlib_corpus_is_deterministic_disjoint_and_capped() -> None:
    a, b = stdlib_corpus(max_bytes=60_000), stdlib_corpus(max_bytes=60_000)
    assert a == b
    assert a.fingerprint == b.fingerprint
    assert (len(a.train), len(a.validation)) == (54_000, 6_000)
    assert not set(a.train_files) & set(a.validation_files)
    assert a.train.startswith(b"# " + a.train_files[0].encode() + b"\n")
    # A larger budget extends the same file order: the small corpus is a prefix of the large one.
    assert stdlib_corpus(max_bytes=120_000).train_files[: len(a.train_files) - 1] == a.train_files[:-1]


def test_stdlib_corpus_splits_by_file_hash(tmp_path) -> None:
    for i in range(30):
        (tmp_path / f"m{i}.py").write_text(f"x = {i}\n")
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "test_a.py").write_text("skipped\n")
    corpus = stdlib_corpus(max_bytes=100_000, validation_every=3, root=tmp_path)
    assert len(corpus.train_files) + len(corpus.validation_files) == 30
    assert 3 <= len(corpus.validation_files) <= 20
    assert b"skipped" not in corpus.train + corpus.validation
    with pytest.raises(ValueError, match="validation_every=1"):
        stdlib_corpus(validation_every=1, root=tmp_path)
    with pytest.raises(ValueError, match=r"no \*.py files"):
        stdlib_corpus(root=tmp_path / "test" / "nowhere")


@given(seq_len=st.integers(1, 9), stride=st.none() | st.integers(1, 9), size=st.integers(2, 40))
def test_byte_window_dataset_shifts_labels_by_one(seq_len: int, stride: int | None, size: int) -> None:
    data = bytes((7 * i) % 256 for i in range(size))
    if size < seq_len + 1:
        with pytest.raises(ValueError, match="hold no window"):
            ByteWindowDataset(data, seq_len, stride=stride)
        return
    ds = ByteWindowDataset(data, seq_len, stride=stride)
    step = stride or seq_len
    assert len(ds) == (size - seq_len - 1) // step + 1
    for i in range(len(ds)):
        item = ds[i]
        assert item["input_ids"].dtype == item["labels"].dtype == torch.int64
        assert item["input_ids"].tolist() == list(data[i * step : i * step + seq_len])
        assert item["labels"].tolist() == list(data[i * step + 1 : i * step + seq_len + 1])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_byte_window_dataset_of_the_corpus_feeds_the_iterator() -> None:
    corpus = stdlib_corpus(max_bytes=20_000)
    ds = ByteWindowDataset(corpus.train, seq_len=32)
    batch = next(StatefulBatchIterator(ds, batch_size=4, seed=0))
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 32)
    assert int(batch["input_ids"].max()) < VOCAB_SIZE
    assert ds.sort_key(0) == 32
    assert decode_bytes(ds[0]["input_ids"]).startswith("# " + corpus.train_files[0])


def test_decode_bytes_round_trips_utf8_and_rejects_non_bytes() -> None:
    text = "def f():\n    return 'é'\n"
    assert decode_bytes(list(text.encode())) == text
    assert decode_bytes(torch.tensor([0xC3])) == "\ufffd"
    with pytest.raises(ValueError, match=r"ids \[256\] are outside"):
        decode_bytes([256])


# --- data-parallel parts of every global batch ------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(
    num_items=st.integers(1, 40),
    per_part=st.integers(1, 4),
    count=st.integers(1, 4),
    seed=st.integers(0, 3),
    skip=st.integers(0, 5),
)
def test_batch_iterator_parts_tile_every_global_batch_and_share_its_state(
    num_items: int, per_part: int, count: int, seed: int, skip: int
) -> None:
    batch_size = per_part * count
    whole = StatefulBatchIterator(list(range(num_items)), batch_size=batch_size, seed=seed)
    parts = [
        StatefulBatchIterator(list(range(num_items)), batch_size=batch_size, seed=seed, part=(i, count))
        for i in range(count)
    ]
    for _ in range(min(skip, len(whole))):  # the same position on every rank, whatever came before
        expected = next(whole).tolist()
        got = [next(p).tolist() for p in parts]
        assert [i for part in got for i in part] == expected  # consecutive slices, in rank order, make the global batch
        assert all(p.state() == whole.state() for p in parts)  # so any number of ranks can resume it


def test_batch_iterator_part_must_divide_the_batch() -> None:
    with pytest.raises(ValueError, match=r"part=\(0, 3\) with batch_size=4; .* batch_size a multiple of count"):
        StatefulBatchIterator(list(range(8)), batch_size=4, part=(0, 3))
    with pytest.raises(ValueError, match=r"part=\(2, 2\)"):
        StatefulBatchIterator(list(range(8)), batch_size=4, part=(2, 2))
    with pytest.raises(ValueError, match=r"part=\(0, 2\) needs drop_last=True"):
        StatefulBatchIterator(list(range(8)), batch_size=4, part=(0, 2), drop_last=False)


# --- BatchLoader: DataLoader workers over the iterator's order --------------------------------------------


def _sorted_sharded_iterator(**kwargs) -> StatefulBatchIterator:
    """An iterator whose dataset views change per epoch, over several epochs."""
    keys = Lengths(2 * (i // 16) + i % 2 for i in range(48))
    shard = ShardedDataset(BufferSortedDataset(keys, buffer_size=16, pack_size=8, seed=5), num_shards=2, shard=1)
    return StatefulBatchIterator(shard, batch_size=4, **kwargs)


@pytest.mark.parametrize("num_workers", [1, 2])
def test_batch_loader_serves_the_iterators_batches_in_order_across_epochs(num_workers: int) -> None:
    expected = [as_list(b) for b in itertools.islice(_sorted_sharded_iterator(infinite=True), 15)]  # 2.5 epochs
    loader = BatchLoader(_sorted_sharded_iterator(infinite=True), num_workers=num_workers)
    assert [as_list(b) for b in itertools.islice(loader, 15)] == expected
    loader.close()


def test_batch_loader_finite_epochs_stop_like_the_iterator() -> None:
    plain = _sorted_sharded_iterator()
    loader = BatchLoader(_sorted_sharded_iterator(), num_workers=2, persistent_workers=True)
    for _ in range(2):  # two epochs, each a `for` loop
        assert [as_list(b) for b in loader] == [as_list(b) for b in plain]
        assert loader.state() == plain.state()
    loader.close()


@pytest.mark.parametrize("persistent", [False, True])
def test_batch_loader_resumes_exactly_from_batches_consumed_not_prefetched(persistent: bool) -> None:
    uninterrupted = [as_list(b) for b in itertools.islice(_sorted_sharded_iterator(infinite=True), 12)]
    first = BatchLoader(_sorted_sharded_iterator(infinite=True), num_workers=2, prefetch_factor=4)
    head = [as_list(b) for b in itertools.islice(first, 7)]
    assert first.sampler.num_planned > 7  # the workers ran ahead ...
    plain = _sorted_sharded_iterator(infinite=True)
    list(itertools.islice(plain, 7))
    assert first.state() == plain.state()  # ... but the position counts the 7 batches returned
    first.close()
    resumed = BatchLoader(_sorted_sharded_iterator(infinite=True), num_workers=2, persistent_workers=persistent)
    next(resumed)  # batches in flight from the old position are dropped by restore
    resumed.restore(first.state())
    assert head + [as_list(b) for b in itertools.islice(resumed, 5)] == uninterrupted
    resumed.close()


@pytest.mark.parametrize(("num_workers", "prefetch_factor"), [(1, 3), (2, 1)])
def test_batch_loader_prefetches_prefetch_factor_batches_per_worker(num_workers: int, prefetch_factor: int) -> None:
    loader = BatchLoader(
        _sorted_sharded_iterator(infinite=True), num_workers=num_workers, prefetch_factor=prefetch_factor
    )
    next(loader)
    assert loader.sampler.num_planned - 1 == num_workers * prefetch_factor
    loader.close()


class WorkerPids:
    """Each item is the id of the process that loaded it."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return os.getpid()


@pytest.mark.parametrize("persistent", [False, True])
def test_batch_loader_persistent_workers_outlive_an_epoch(persistent: bool) -> None:
    loader = BatchLoader(
        StatefulBatchIterator(WorkerPids(), batch_size=2, shuffle=False),
        num_workers=1,
        persistent_workers=persistent,
    )
    first, second = {p for b in loader for p in b.tolist()}, {p for b in loader for p in b.tolist()}
    assert os.getpid() not in first | second  # loaded by a worker
    assert (first == second) is persistent
    loader.close()


def test_batch_loader_pins_memory_when_asked() -> None:
    loader = BatchLoader(StatefulBatchIterator(list(range(8)), batch_size=4), pin_memory=True)
    assert loader.data_loader.pin_memory is True
    if torch.accelerator.is_available():
        assert next(loader).is_pinned()
    else:  # CPU-only torch cannot pin; the DataLoader says so when it starts, which shows it got the flag
        with pytest.warns(UserWarning, match="'pin_memory' argument is set as true but no accelerator"):
            next(loader)


@pytest.mark.parametrize(
    ("pin_memory", "device", "pinned"),
    [("auto", "cpu", None), ("auto", "cuda", True), (False, "cuda", None), (True, "cpu", True)],
)
def test_load_batches_pins_for_cuda_when_auto(pin_memory: bool | str, device: str, pinned: bool | None) -> None:
    from d9dfn.config import DataLoadingConfig
    from d9dfn.loop._train import load_batches

    iterator = StatefulBatchIterator(list(range(8)), batch_size=4)
    data = load_batches(iterator, DataLoadingConfig(pin_memory=pin_memory), torch.device(device))
    if pinned is None:  # nothing to add: the iterator itself, no DataLoader in between
        assert data is iterator
    else:
        assert isinstance(data, BatchLoader)
        assert data.data_loader.pin_memory is pinned


def test_batch_loader_rejects_persistent_workers_without_workers() -> None:
    with pytest.raises(ValueError, match="persistent_workers=True needs num_workers > 0"):
        BatchLoader(StatefulBatchIterator(list(range(8)), batch_size=4), persistent_workers=True)


# --- DeviceBatches: one batch ahead, the position of the batches returned ------------------------------------------


@given(
    count=st.integers(0, 9),
    saves=st.lists(st.integers(0, 9), max_size=3),
    workers=st.sampled_from([0, 1]),
)
@settings(max_examples=20)  # each example may start a worker process
def test_device_batches_serve_the_loaders_batches_and_resume_exactly(
    count: int, saves: list[int], workers: int
) -> None:
    """As a loop uses it (next, step, prefetch, maybe save): the loader's batches in order, never more than
    ``count`` taken, and a position that restores to exactly the batches after the ones returned."""

    def loader() -> StatefulBatchIterator | BatchLoader:
        iterator = StatefulBatchIterator(list(range(10)), batch_size=3, seed=1, infinite=True)
        return BatchLoader(iterator, num_workers=workers) if workers else iterator

    reference = loader()
    expected = [next(reference).tolist() for _ in range(count + 2)]
    source = loader()
    batches = DeviceBatches(source, torch.device("cpu"), count)
    got, positions = [], {}
    for index in range(count):
        got.append(next(batches).tolist())
        batches.prefetch()  # the loop's step has been enqueued: take the next one
        positions[index + 1] = batches.state()
    assert got == expected[:count]
    with pytest.raises(StopIteration):
        next(batches)
    after = loader()
    for _ in range(count):
        next(after)
    assert source.state() == after.state()  # nothing was taken past the last step
    if workers:
        after.close()
    for consumed in (s for s in saves if s in positions):  # a checkpoint after `consumed` steps resumes there
        resumed = loader()
        resumed.restore(positions[consumed])
        assert [next(resumed).tolist() for _ in range(2)] == expected[consumed : consumed + 2]
        if workers:
            resumed.close()
    if workers:
        source.close()
        reference.close()


def test_device_batches_refuse_a_negative_count() -> None:
    with pytest.raises(ValueError, match="DeviceBatches: count=-1; pass the number of batches"):
        DeviceBatches(StatefulBatchIterator(list(range(4)), batch_size=2), torch.device("cpu"), -1)
