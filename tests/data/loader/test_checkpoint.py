"""A loader's checkpoint (torchshard.data._loader.checkpoint): the snapshot is a deep copy taken
after the batch it describes, whatever the source (a StatefulDataLoader over a dataset whose state
is a live list, torchdata.nodes, a grain-style get_state()/set_state() iterator, DataLoader
workers); loading never asks the source for its state; a resume equals the uninterrupted run with a
step slower than a batch read, the state pickled late; the layout's keys and errors."""

import pickle
import re
import time

import numpy as np
import pytest
import torch
import torchdata.nodes as tn
from data_helpers import Rows, ids, no_loader_thread_left, process_entry
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import torchshard as ts
from torchshard.data._loader import checkpoint
from torchshard.testing import global_batch_loader_per_host, virtual_hosts


class Packing(IterableDataset):
    """Packs documents of 3 or 4 tokens into sequences of 4, like torchtitan's
    HuggingFaceTextDataset: its ``state_dict()`` returns its token buffer itself (a live list)."""

    def __init__(self, docs=12, seq=4):
        self.docs = [
            [100 * d + j for j in range(3 if d % 2 == 0 else 4)] for d in range(1, docs + 1)
        ]
        self.seq = seq
        self.doc = 0
        self.buffer = []

    def __iter__(self):
        while True:
            while len(self.buffer) >= self.seq:
                out = self.buffer[: self.seq]
                del self.buffer[: self.seq]
                yield torch.tensor(out)
            if self.doc == len(self.docs):
                return
            self.buffer.extend(self.docs[self.doc])
            self.doc += 1

    def state_dict(self):
        return {"doc": self.doc, "buffer": self.buffer}  # not a copy: torchtitan's way

    def load_state_dict(self, state):
        self.doc, self.buffer = state["doc"], list(state["buffer"])


class GrainLike:
    """A grain-style iterator: ``get_state()``/``set_state()``, and ``iter()`` is itself."""

    def __init__(self, n=8):
        self.n, self.pos = n, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.pos == self.n:
            raise StopIteration
        self.pos += 1
        return {"id": np.arange(8) + 8 * (self.pos - 1)}

    def get_state(self):
        return {"position": self.pos}

    def set_state(self, state):
        self.pos = state["position"]


def packing(prefetch):
    source = StatefulDataLoader(Packing(), batch_size=2, num_workers=0)
    return ts.GlobalBatchLoader(source, prefetch=prefetch, partition=ts.P())


def nodes(prefetch):
    batches = tn.Batcher(tn.IterableWrapper(range(64)), batch_size=8)
    root = tn.Mapper(batches, lambda b: {"id": np.array(b)})
    return ts.GlobalBatchLoader(tn.Loader(root), prefetch=prefetch, partition=ts.P("data"))


def grain(prefetch):
    return ts.GlobalBatchLoader(GrainLike(), prefetch=prefetch, partition=ts.P("data"))


def workers(prefetch):
    source = StatefulDataLoader(
        Rows(64),
        batch_size=8,
        shuffle=True,
        generator=torch.Generator().manual_seed(1),
        num_workers=2,
    )
    return ts.GlobalBatchLoader(source, prefetch=prefetch, partition=ts.P("data"))


def sampled(prefetch):
    dataset = Rows(64)
    sampler = ts.host_sampler(dataset, {"num_shards": 1, "shard_index": 0}, seed=3)
    source = DataLoader(dataset, batch_size=8, sampler=sampler)  # not stateful: by position
    return ts.GlobalBatchLoader(source, prefetch=prefetch, partition=ts.P("data"))


def read(batch):
    if isinstance(batch, dict):
        return ids(batch)
    return ts.replicate_to_local_data(batch).tolist()


def resume_matches(make, *, take, prefetch, later):
    """Takes ``take`` batches with a step slower than a batch read (the thread reads ahead),
    saves, takes ``later`` more and only then pickles the state (a checkpoint written late);
    a new loader, asked for its state first (as torch.distributed.checkpoint's load does),
    loads it and must yield exactly the rest of the uninterrupted epoch."""
    reference = [read(b) for b in make(prefetch)]
    loader = make(prefetch)
    it = iter(loader)
    taken = []
    for _ in range(take):
        taken.append(read(next(it)))
        time.sleep(0.02)  # the step: the thread reads ahead meanwhile
    time.sleep(0.3)  # the thread fills its prefetch (the resume must match however far it got)
    state = loader.state_dict()
    for _ in range(later):
        next(it, None)
        time.sleep(0.02)
    blob = pickle.dumps(state)
    loader.close()
    resumed = make(prefetch)
    resumed.state_dict()  # the structure, before loading into it
    resumed.load_state_dict(pickle.loads(blob))
    rest = [read(b) for b in resumed]
    assert taken == reference[:take]
    assert rest == reference[take:]
    assert no_loader_thread_left()


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize(
    "make", [packing, nodes, grain, workers, sampled], ids=lambda f: f.__name__
)
def test_a_resume_equals_the_uninterrupted_run(mesh8, make, prefetch):
    resume_matches(make, take=3, prefetch=prefetch, later=2)


def test_the_packing_reproduction_of_the_issue(mesh8):
    """The issue's case: before snapshots were copies, the read-ahead changed the saved token
    buffer, and batch 3 of the resumed run came out wrong."""
    reference = [read(b) for b in packing(2)]
    assert reference[3] == [[703, 800, 801, 802], [900, 901, 902, 903]]
    resume_matches(packing, take=3, prefetch=2, later=0)


def test_a_snapshot_does_not_change_after_the_call(mesh8):
    loader = packing(2)
    it = iter(loader)
    next(it)
    time.sleep(0.2)  # the thread reads ahead
    state = loader.state_dict()
    frozen = pickle.dumps(state)
    for _ in range(3):
        next(it)
    assert pickle.dumps(state) == frozen
    assert pickle.dumps(loader.state_dict()) != frozen  # the position did move
    loader.close()


def test_loading_never_asks_the_source_for_its_state(mesh8):
    class Watched(GrainLike):
        asked = 0

        def get_state(self):
            Watched.asked += 1
            return super().get_state()

    saved = grain(0)
    it = iter(saved)
    next(it), next(it)
    state = saved.state_dict()
    loader = ts.GlobalBatchLoader(Watched(), prefetch=0, partition=ts.P("data"))
    loader.load_state_dict(state)
    assert Watched.asked == 0
    assert [ids(b)[0] for b in loader] == [16, 24, 32, 40, 48, 56]


def test_the_layout_has_a_process_entry_and_a_common_one(mesh8):
    loader = grain(0)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert set(state) == {"process_0", "common"}
    assert set(process_entry(state)) == {"source", "next_batch"}
    assert isinstance(process_entry(state)["source"], bytes)  # one opaque value per source
    assert state["common"] == {
        "loader": "GlobalBatchLoader",
        "processes": 1,
        "hosts": 1,
        "epoch": None,
        "consumed": None,
        "num_examples": None,
        "seed": None,
        "shuffle": None,
        "elastic": None,
        "shards": None,
    }
    loader.close()
    # A state saved before the common entry kept the elastic sources' position (and the
    # samplers' shard count) loads as is.
    kept = ("elastic", "shards")
    old = {**state, "common": {k: v for k, v in state["common"].items() if k not in kept}}
    fresh = grain(0)
    fresh.load_state_dict(old)
    assert ids(next(iter(fresh)))[0] == 8
    fresh.close()


def test_a_host_sampler_position_is_in_the_common_entry(mesh8):
    loader = sampled(0)
    it = iter(loader)
    next(it), next(it)
    common = loader.state_dict()["common"]
    assert (common["epoch"], common["consumed"], common["num_examples"]) == (0, 16, 64)
    assert (common["seed"], common["shuffle"], common["shards"]) == (3, True, 1)
    loader.close()


def test_a_state_of_another_kind_of_source_is_refused(mesh8):
    loader = grain(0)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader.close()
    other = ts.GlobalBatchLoader(
        StatefulDataLoader(Rows(64), batch_size=8), prefetch=0, partition=ts.P("data")
    )
    msg = (
        f"state_dict['process_0']['source']: saved from a {GrainLike.__module__}.GrainLike, but "
        "this loader's source is a torchdata.stateful_dataloader.stateful_dataloader."
        "StatefulDataLoader with num_workers=0; a source's state means something only to a "
        "source of its kind and configuration. Load the state into a loader over the same kind "
        "of source, configured alike."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        other.load_state_dict(state)


def test_a_state_of_another_num_workers_is_refused(mesh8):
    loader = workers(0)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader.close()
    other = ts.GlobalBatchLoader(StatefulDataLoader(Rows(64), batch_size=8), partition=ts.P("data"))
    with pytest.raises(ValueError, match=re.escape("StatefulDataLoader with num_workers=2, but")):
        other.load_state_dict(state)


def test_the_entry_of_another_process_is_not_this_ones(mesh8):
    loader = grain(0)
    state = loader.state_dict()
    moved = {"process_1": state["process_0"], "common": state["common"]}
    msg = (
        "state_dict: expected this process's entry 'process_0', but the state holds "
        "['process_1']; pass the state this process saved (or the union of every process's)."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        loader.load_state_dict(moved)


def test_a_stream_saved_on_more_hosts_cannot_be_split_again(mesh8):
    sources = [GrainLike() for _ in range(4)]
    with virtual_hosts(4):
        state = global_batch_loader_per_host(sources, partition=ts.P("data")).state_dict()
    with virtual_hosts(2):
        loader = global_batch_loader_per_host(sources[:2], partition=ts.P("data"))
        msg = (
            "state_dict: saved by 1 process(es) feeding 4 data host(s), but this loader runs on 1 "
            "process(es) feeding 2; its sources' state is per process and has no global "
            "position, so it cannot be split over another number of hosts. Resume on the same "
            "number of processes, or feed map-style data through torchshard.host_sampler: its "
            "position in the epoch's global order resumes on any number of hosts."
        )
        with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
            loader.load_state_dict(state)


def test_a_position_beyond_the_dataset_is_refused(mesh8):
    """consumed 10**6 of 64: not an empty epoch, an error naming the key."""
    loader = sampled(0)
    next(iter(loader))
    state = loader.state_dict()
    loader.close()
    state["common"]["consumed"] = 10**6
    msg = (
        "state_dict['common']['consumed']: expected at most the epoch's 64 examples "
        "(num_examples) consumed, but got 1000000; the position lies beyond the dataset, so the "
        "state is corrupt or was edited. Load the state that GlobalBatchLoader.state_dict() saved."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        sampled(0).load_state_dict(state)


@pytest.mark.parametrize("blob", [b"garbage", "truncated"])
def test_a_corrupt_source_state_names_its_path(mesh8, blob):
    with virtual_hosts(2):
        sources = [StatefulDataLoader(Rows(64), batch_size=4) for _ in range(2)]
        loader = global_batch_loader_per_host(sources, partition=ts.P("data"))
        next(iter(loader))
        state = loader.state_dict()
        loader.close()
        saved = state["process_0"]["sources"][1]
        bad = saved[:20] if blob == "truncated" else blob
        state["process_0"]["sources"][1] = bad
        fresh = [StatefulDataLoader(Rows(64), batch_size=4) for _ in range(2)]
        msg = (
            "state_dict['process_0']['sources'][1]: expected a source's state as "
            f"GlobalBatchLoader.state_dict() saved it, but its {len(bad)} bytes do not unpickle "
            "(UnpicklingError: "
        )
        with pytest.raises(ValueError, match=f"^{re.escape(msg)}") as info:
            global_batch_loader_per_host(fresh, partition=ts.P("data")).load_state_dict(state)
        assert isinstance(info.value.__cause__, pickle.UnpicklingError)


@pytest.mark.parametrize("kind", [DataLoader, StatefulDataLoader])
def test_a_break_then_set_epoch_saves_the_new_epochs_start(mesh8, kind):
    """Epoch 0 broken off after 3 batches, then set_epoch(1): the state is epoch 1 from its
    start, and a resume yields exactly the uninterrupted epoch 1."""

    def make():
        data = Rows(64)
        sampler = ts.host_sampler(data, {"num_shards": 1, "shard_index": 0}, seed=3)
        source = kind(data, batch_size=8, sampler=sampler)
        return ts.GlobalBatchLoader(source, partition=ts.P("data"))

    reference = make()
    reference.set_epoch(1)
    epoch1 = [ids(b) for b in reference]
    loader = make()
    loader.set_epoch(0)
    it = iter(loader)
    for _ in range(3):
        next(it)
    assert loader.state_dict()["common"]["consumed"] == 24  # mid-epoch 0: resumable there
    loader.set_epoch(1)
    state = loader.state_dict()
    assert (state["common"]["epoch"], state["common"]["consumed"]) == (1, 0)
    assert process_entry(state)["next_batch"] == 0
    loader.close()
    resumed = make()
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    assert [ids(b) for b in resumed] == epoch1
    again = make()  # the same set_epoch(1) without a break keeps the position of epoch 1
    again.set_epoch(1)
    it = iter(again)
    next(it)
    again.set_epoch(1)
    assert again.state_dict()["common"]["consumed"] == 8
    again.close()


def _feeds(mesh, spec, stateful):
    """4 virtual hosts' sources over host_sampler(spec) on ``mesh``: their shards and feeds."""
    kind = StatefulDataLoader if stateful else DataLoader
    sources = []
    for h in range(4):
        with virtual_hosts(4, process_index=h), mesh:
            sampler = ts.host_sampler(Rows(64), spec, shuffle=False)
        sources.append(kind(Rows(64), batch_size=2, sampler=sampler))
    return global_batch_loader_per_host(sources, partition=spec)


@pytest.mark.parametrize("stateful", [True, False])
def test_the_same_host_count_on_a_new_layout_resumes_by_example(mesh8, stateful):
    """(dp 2 x tp 4) -> (data 8), 4 hosts both times (the issue: dp 2 x tp 6 -> data 12 on 12
    processes): 2 shards become 4; the position in the epoch's order carries over, the
    per-host sampler states (of 2 shards) are not loaded."""
    old = ts.Mesh(np.arange(8).reshape(2, 4), ("dp", "tp"))
    new = ts.Mesh(np.arange(8), ("data",))
    with virtual_hosts(4), old:
        loader = _feeds(old, ts.P("dp"), stateful)
        it = iter(loader)
        taken = [ids(next(it)) for _ in range(2)]
        state = loader.state_dict()
        loader.close()
    assert state["common"]["shards"] == 2 and state["common"]["consumed"] == 8
    with virtual_hosts(4), new:
        resumed = _feeds(new, ts.P("data"), stateful)
        resumed.load_state_dict(state)
        rest = [ids(b) for b in resumed]
    seen = sorted(i for b in taken + rest for i in b)
    assert seen == list(range(64))  # every example once, none twice
    assert sorted(i for b in taken for i in b) == list(range(8))  # the order: 0..63


def test_a_state_saved_before_shards_were_kept_loads(mesh8):
    loader = sampled(0)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    loader.close()
    del state["common"]["shards"]
    resumed = sampled(0)
    resumed.load_state_dict(state)
    assert len(list(resumed)) == 6


def test_capture_copies_and_restore_loads_either_protocol():
    source = Packing()
    state = checkpoint.capture(source)
    assert state == {"doc": 0, "buffer": []} and state["buffer"] is not source.buffer
    grain_like = GrainLike()
    checkpoint.restore(grain_like, {"position": 5})
    assert grain_like.pos == 5
    assert checkpoint.stateful(grain_like) and checkpoint.stateful(source)
    assert not checkpoint.stateful([1, 2])
    assert checkpoint.capture([1, 2]) is None


# -- resuming on another number of hosts -----------------------------------------------------

N_EXAMPLES = 96
CASES = "_loader_cases:"


def epoch_order(n, seed, epoch):
    """The epoch's global order, from torch's own DistributedSampler over one replica."""
    s = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=seed)
    s.set_epoch(epoch)
    return list(s)


def check_exactly_once(taken, rest, *, order, consumed, new_hosts):
    """The examples before the save and after the resume are the epoch's, each once (up to
    the new hosts' drop_last tail), and each resumed batch is the next chunk of the order."""
    before = [i for b in taken for i in b]
    assert sorted(before) == sorted(order[:consumed])
    start = consumed
    for b in rest:
        assert sorted(b) == sorted(order[start : start + len(b)])
        start += len(b)
    usable = consumed + (len(order) - consumed) // new_hosts * new_hosts
    assert start == usable
    seen = before + [i for b in rest for i in b]
    assert len(seen) == len(set(seen)) == usable


def real_ids(step):
    """The real examples of a step (``(batch, mask)`` with last_batch="pad")."""
    if isinstance(step, tuple):
        batch, mask = step
        return ts.replicate_to_local_data(batch["id"])[ts.replicate_to_local_data(mask)].tolist()
    return ids(step)


def _per_host(hosts, batch, *, seed, epoch, stateful, prefetch, last_batch="error"):
    from torchshard.testing import global_batch_loader_per_host

    data = Rows(N_EXAMPLES)
    kind = StatefulDataLoader if stateful else DataLoader
    sources, samplers = [], []
    for h in range(hosts):
        sampler = ts.host_sampler(data, {"num_shards": hosts, "shard_index": h}, seed=seed)
        sampler.set_epoch(epoch)
        samplers.append(sampler)
        sources.append(kind(data, batch_size=batch, sampler=sampler))
    loader = global_batch_loader_per_host(
        sources, partition=ts.P("data"), prefetch=prefetch, last_batch=last_batch
    )
    return loader, samplers


@pytest.mark.parametrize("stateful", [True, False])
@pytest.mark.parametrize(("new_batch", "prefetch"), [(4, 2), (8, 0), (8, 2)])
def test_virtual_hosts_resume_from_4_on_2(mesh8, stateful, new_batch, prefetch):
    """4 hosts of 2 rows (global batch 8) take 5 batches (40 examples); 2 hosts resume, with
    4 rows each (the same global batch) or 8 (16: 40 does not divide it; the last batch is
    short, padded)."""
    from torchshard.testing import global_to_host_array_per_host, virtual_hosts

    seed, epoch = 5, 3
    order = epoch_order(N_EXAMPLES, seed, epoch)
    with virtual_hosts(4):
        loader, _ = _per_host(4, 2, seed=seed, epoch=epoch, stateful=stateful, prefetch=prefetch)
        it = iter(loader)
        taken = []
        for _ in range(5):
            taken.append(ids(next(it)))
            time.sleep(0.01)
        state = pickle.loads(pickle.dumps(loader.state_dict()))
        loader.close()
    assert state["common"]["consumed"] == 40 and state["common"]["hosts"] == 4
    with virtual_hosts(2):
        resumed, samplers = _per_host(
            2,
            new_batch,
            seed=seed,
            epoch=epoch,
            stateful=stateful,
            prefetch=prefetch,
            last_batch="pad" if new_batch == 8 else "error",
        )
        resumed.load_state_dict(state)
        rest, blocks = [], []
        for step in resumed:
            rest.append(real_ids(step))
            b = step[0] if isinstance(step, tuple) else step
            blocks.append([blk["id"].tolist() for blk in global_to_host_array_per_host(b)])
        assert resumed.state_dict()["common"]["consumed"] == 0  # the epoch ended
        again = [real_ids(b) for b in resumed]  # the next pass: the whole epoch again
    check_exactly_once(taken, rest, order=order, consumed=40, new_hosts=2)
    for k, per_host in enumerate(blocks):  # host h reads every 2nd example from 40 on
        for h, block in enumerate(per_host):
            start = 40 + 2 * new_batch * k
            real = order[start + h : start + 2 * new_batch : 2]
            assert block == real + [0] * (new_batch - len(real))
    assert sorted(i for b in again for i in b) == sorted(order)
    assert all(s.epoch == epoch for s in samplers)


def test_a_sampler_of_another_order_is_refused_on_resume(mesh8):
    from torchshard.testing import virtual_hosts

    with virtual_hosts(4):
        loader, _ = _per_host(4, 2, seed=5, epoch=0, stateful=True, prefetch=0)
        next(iter(loader))
        state = loader.state_dict()
        loader.close()
    with virtual_hosts(2):
        other, _ = _per_host(2, 4, seed=6, epoch=0, stateful=True, prefetch=0)
        msg = (
            "state_dict['common']: saved over an epoch order of {'num_examples': 96, 'seed': 5, "
            "'shuffle': True}, but this loader's sampler (host 0's) has {'num_examples': 96, "
            "'seed': 6, 'shuffle': True}; a position in one order means nothing in another. "
            "Resume with the same dataset, seed and shuffle."
        )
        with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
            other.load_state_dict(state)


def _union(results):
    union = {}
    for r in results:
        union.update(r["state"])
    return union


@pytest.mark.parametrize(
    ("old", "new", "old_batch", "new_batch", "take", "via", "stateful"),
    [
        (4, 2, 4, 4, 3, "union", True),  # the per-process batch kept
        (4, 2, 4, 8, 3, "dcp", True),  # the global batch kept
        (2, 4, 6, 4, 2, "union", True),  # 24 consumed, global batch 16: not a multiple
        (2, 4, 6, 4, 2, "dcp", True),
        (4, 2, 4, 4, 2, "union", False),  # a plain DataLoader: by position alone
    ],
)
def test_gloo_processes_resume_on_another_count(
    pools, tmp_path, old, new, old_batch, new_batch, take, via, stateful
):
    seed, epoch = 0, 1
    path = str(tmp_path / "checkpoint") if via == "dcp" else None
    saved = pools(old).run(
        CASES + "resume_save",
        n=N_EXAMPLES,
        batch=old_batch,
        take=take,
        seed=seed,
        epoch=epoch,
        stateful=stateful,
        path=path,
    )
    taken = saved[0]["taken"]
    assert all(r["taken"] == taken for r in saved)
    union = _union(saved)
    assert sorted(union) == ["common"] + [f"process_{i}" for i in range(old)]
    consumed = take * old * old_batch
    assert union["common"]["consumed"] == consumed
    loaded = pools(new).run(
        CASES + "resume_load",
        n=N_EXAMPLES,
        batch=new_batch,
        states=None if via == "dcp" else union,
        path=path,
        seed=seed,
        epoch=epoch,
        stateful=stateful,
    )
    rest = loaded[0]["rest"]
    assert all(r["rest"] == rest for r in loaded)
    order = epoch_order(N_EXAMPLES, seed, epoch)
    check_exactly_once(taken, rest, order=order, consumed=consumed, new_hosts=new)
    usable = N_EXAMPLES // new * new
    assert sorted(i for b in loaded[0]["again"] for i in b) == sorted(order[:usable])


def test_gloo_same_count_resume_through_dcp(pools, tmp_path):
    path = str(tmp_path / "checkpoint")
    saved = pools(2).run(CASES + "resume_save", n=N_EXAMPLES, batch=4, take=3, path=path)
    loaded = pools(2).run(CASES + "resume_load", n=N_EXAMPLES, batch=4, path=path)
    order = epoch_order(N_EXAMPLES, 0, 1)
    check_exactly_once(saved[0]["taken"], loaded[0]["rest"], order=order, consumed=24, new_hosts=2)


def test_gloo_a_stream_state_cannot_move_to_another_count(pools):
    union = {}
    for state in pools(4).run(CASES + "stream_state"):
        union.update(state)
    errors = pools(2).run(CASES + "resume_stream_on_another_count", states=union)
    msg = (
        "state_dict: saved by 4 process(es) feeding 4 data host(s), but this loader runs on 2 "
        "process(es) feeding 2; its sources' state is per process and has no global position, so "
        "it cannot be split over another number of hosts. Resume on the same number of "
        "processes, or feed map-style data through torchshard.host_sampler: its position in the "
        "epoch's global order resumes on any number of hosts."
    )
    assert errors == [msg, msg]
