"""Resume anywhere: a distributed loader's state resumes on another world size, batch size or worker count.

Every rank's loader of a world size is built in this process with an explicit
``rank`` and ``world_size`` (no process group), over real worker processes.
"""

from __future__ import annotations

import json
import threading
from collections import Counter

import pytest
import torch
from helpers import RangeDataset
from torch.utils.data import DistributedSampler

import rpcdl
from rpcdl.data.elastic import ElasticDistributedSampler
from rpcdl.data.resume import WHOLE_EPOCH, Origin, layout_positions
from rpcdl.distributed import distributed_loader, merge_states

N = 50  # samples: not a multiple of the world sizes, so DistributedSampler pads
SEED = 11


@pytest.fixture(scope="module")
def dataset(two_workers):
    return rpcdl.RPCDataset(two_workers, RangeDataset, N)


def loaders(dataset, world_size: int, batch_size: int, *, in_order=True, drop_last=False, **options):
    base = rpcdl.RPCDataloader(dataset, batch_size=batch_size, shuffle=True, in_order=in_order)
    return [
        distributed_loader(base, world_size, rank, seed=SEED, drop_last=drop_last, **options)
        for rank in range(world_size)
    ]


def take(rank_loaders, batches: int) -> tuple[list, list[int]]:
    """Every rank takes ``batches`` batches (in step, as data-parallel ranks do): its iterators and the samples."""
    iterators = [iter(loader) for loader in rank_loaders]
    samples = [i for _ in range(batches) for iterator in iterators for i in next(iterator).tolist()]
    return iterators, samples


def rest(rank_loaders) -> list[int]:
    return [i for loader in rank_loaders for batch in loader for i in batch.tolist()]


def plain(state):
    """A state as a checkpoint holds it (plain data)."""
    return json.loads(json.dumps(state))


def assert_each_sample_once(before: list[int], after: list[int], world_size: int, drop_last=False):
    """``before`` and ``after`` hold every sample once, but for the padding of the new split (repeats of
    samples taken before), or with ``drop_last`` the few the new split cuts."""
    assert len(before) == len(set(before)), "a sample was yielded twice before the state was taken"
    left = set(range(N)) - set(before)
    counts = Counter(after)
    if drop_last:
        assert set(after) <= left and len(left) - len(set(after)) < world_size
        assert all(count == 1 for count in counts.values())
        return
    assert set(after) >= left, f"samples never yielded: {sorted(left - set(after))}"
    padding = -len(left) % world_size
    assert len(after) == len(left) + padding
    assert sum(count - 1 for count in counts.values()) + len(set(after) - left) == padding


# ---------------------------------------------------------------------------- the layout, without workers


@pytest.mark.parametrize("length", [0, 1, 7, 12, 50])
@pytest.mark.parametrize("world_size", [1, 3, 4, 8])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_whole_epoch_is_distributed_samplers(length, world_size, drop_last, shuffle):
    for rank in range(world_size):
        options = dict(num_replicas=world_size, rank=rank, shuffle=shuffle, seed=3, drop_last=drop_last)
        torch_sampler, elastic = (
            DistributedSampler(range(length), **options),
            ElasticDistributedSampler(range(length), **options),
        )
        for epoch in (0, 2):
            torch_sampler.set_epoch(epoch)
            elastic.set_epoch(epoch)
            assert list(elastic) == list(torch_sampler)
            assert len(elastic) == len(torch_sampler)


def test_the_layout_left_after_an_origin_skips_what_it_consumed():
    assert layout_positions(10, Origin(4, (6,)), 3, drop_last=False) == [4, 5, 7, 8, 9, 0]
    assert layout_positions(10, Origin(4, (6,)), 3, drop_last=True) == [4, 5, 7]
    assert layout_positions(10, Origin(10), 3, drop_last=False) == []
    assert layout_positions(2, WHOLE_EPOCH, 5, drop_last=False) == [0, 1, 0, 1, 0]


def test_the_sampler_state_resumes_on_another_world_size():
    """The sampler's own state (what torchdata's SamplerWrapper saves): 4 ranks to 3."""
    old = [ElasticDistributedSampler(range(N), num_replicas=4, rank=r, seed=SEED) for r in range(4)]
    iterators = [iter(sampler) for sampler in old]
    before = [next(iterator) for _ in range(5) for iterator in iterators]
    state = plain(old[2].state_dict())
    assert state["consumed"] == 20 and state["yielded"] == 5
    new = [ElasticDistributedSampler(range(N), num_replicas=3, rank=r, seed=SEED) for r in range(3)]
    for sampler in new:
        sampler.load_state_dict(state)
    assert_each_sample_once(before, [i for sampler in new for i in sampler], 3)
    other = ElasticDistributedSampler(range(N), num_replicas=3, rank=0, seed=SEED + 1)
    with pytest.raises(ValueError, match="seed: the state has 11, this sampler has 12"):
        other.load_state_dict(state)


def test_a_sampler_state_of_another_version_is_refused():
    sampler = ElasticDistributedSampler(range(N), num_replicas=4, rank=0, seed=SEED)
    iterator = iter(sampler)
    next(iterator)
    state = plain(sampler.state_dict())
    other = ElasticDistributedSampler(range(N), num_replicas=3, rank=0, seed=SEED)
    with pytest.raises(ValueError, match="has version 2, this rpcdl reads version 1"):
        other.load_state_dict({**state, "version": 2})
    other.load_state_dict(state)
    assert len(list(other)) == len(other) == 16  # (50 - 4) / 3, padded


# ---------------------------------------------------------------------------- distributed_loader states


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("old", "new", "batches"), [(4, 3, 2), (2, 4, 3), (3, 1, 4), (1, 2, 7)], ids=["4to3", "2to4", "3to1", "1to2"]
)
def test_a_mid_epoch_state_moves_to_another_world_size_every_sample_once(dataset, old, new, batches):
    first = loaders(dataset, old, batch_size=3)
    iterators, before = take(first, batches)
    states = [plain(loader.state_dict()) for loader in first]
    assert len(before) == old * batches * 3  # counted before
    for state in states:  # the ranks agree on the global position: any rank's state may be saved
        assert (state["epoch"], state["consumed"], state["consumed_extra"]) == (0, len(before), [])
        assert {**state["layout"], "rank": 0} == {**states[0]["layout"], "rank": 0}
        assert state["layout"]["world_size"] == old and state["batch_size"] == 3
    for iterator in iterators:
        iterator.close()

    second = loaders(dataset, new, batch_size=3)
    for loader in second:
        loader.load_state_dict(states[-1])
        assert loader.state_dict()["consumed"] == len(before)  # loaded, not yet resumed: the same position
    after = rest(second)  # counted after
    assert_each_sample_once(before, after, new)
    for loader in second:  # the epoch is over: the states are the start of the next one
        state = loader.state_dict()
        assert (state["epoch"], state["yielded_prefix"], state["consumed"]) == (1, 0, 0)
    nxt = rest(second)
    assert sorted(set(nxt)) == list(range(N)) and len(nxt) == N + (-N % new)


@pytest.mark.timeout(90)
def test_a_resumed_epoch_moves_again_and_keeps_counting_batches(dataset):
    """4 ranks -> 3 -> 2 within one epoch, another batch size each time; drop_last cuts the remainder."""
    first = loaders(dataset, 4, batch_size=2, drop_last=True)
    iterators, before = take(first, 2)
    state = plain(first[0].state_dict())
    for iterator in iterators:
        iterator.close()
    second = loaders(dataset, 3, batch_size=3, drop_last=True)
    for loader in second:
        loader.load_state_dict(state)
    assert [len(loader) for loader in second] == [2 + 4] * 3  # the 2 counted before, then 34 // 3 // 3
    iterators, middle = take(second, 2)
    state = plain(second[1].state_dict())
    assert state["yielded_prefix"] == 4 and state["origin"] == {"consumed": 16, "consumed_extra": [], "first_batch": 2}
    assert state["consumed"] == 16 + 18
    third = loaders(dataset, 2, batch_size=5, drop_last=True)
    for loader in third:
        loader.load_state_dict(state)
    after = rest(third)
    assert_each_sample_once(before + middle, after, 2, drop_last=True)


@pytest.mark.timeout(60)
def test_a_state_on_the_same_rank_and_world_size_resumes_exactly(dataset):
    whole = [[batch.tolist() for batch in loader] for loader in loaders(dataset, 3, batch_size=4)]
    first = loaders(dataset, 3, batch_size=4)
    _, _ = take(first, 2)
    resumed = loaders(dataset, 3, batch_size=4)
    for loader, source in zip(resumed, first, strict=True):
        loader.load_state_dict(plain(source.state_dict()))
    assert [[batch.tolist() for batch in loader] for loader in resumed] == [batches[2:] for batches in whole]
    # rank 0's state on every rank (a Lightning checkpoint): the same batches, padding included
    again = loaders(dataset, 3, batch_size=4)
    for loader in again:
        loader.load_state_dict(plain(first[0].state_dict()))
    assert [[batch.tolist() for batch in loader] for loader in again] == [batches[2:] for batches in whole]


@pytest.mark.timeout(60)
def test_a_state_at_an_epochs_end_starts_the_next_epoch_on_any_world_size(dataset):
    first = loaders(dataset, 4, batch_size=3)
    for loader in first:
        assert len(list(loader)) == 5
    state = plain(first[0].state_dict())
    assert (state["epoch"], state["consumed"], state["yielded_prefix"]) == (1, 0, 0)
    second = loaders(dataset, 3, batch_size=3)
    for loader in second:
        loader.load_state_dict(state)
    epoch_one = [batch.tolist() for loader in second for batch in loader]
    expected = loaders(dataset, 3, batch_size=3)
    for loader in expected:
        loader.set_epoch(1)
    assert epoch_one == [batch.tolist() for loader in expected for batch in loader]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch", [0, 1, 2, 3])
def test_the_same_seed_gives_the_same_global_batches_on_every_world_size(dataset, batch):
    """The ranks' batch ``batch`` together, for world sizes that keep the global batch size of 12."""
    global_batches = []
    for world_size, batch_size in ((1, 12), (2, 6), (3, 4), (4, 3)):
        per_rank = [[b.tolist() for b in loader] for loader in loaders(dataset, world_size, batch_size)]
        global_batches.append(sorted(i for batches in per_rank for i in batches[batch]))
    assert all(samples == global_batches[0] for samples in global_batches)
    assert len(set(global_batches[0])) == 12


# ---------------------------------------------------------------------------- in_order=False


def rank_batches(dataset, world_size, batch_size):
    """Each rank's batches of epoch 0, in sampler order."""
    return [[b.tolist() for b in loader] for loader in loaders(dataset, world_size, batch_size)]


@pytest.mark.timeout(90)
def test_out_of_order_states_are_merged_and_resume_on_another_world_size(dataset):
    """Each rank yielded its own batches out of order: the state records them, merge_states joins the ranks'."""
    whole = rank_batches(dataset, 3, 3)  # batches 0..5 of each rank, in sampler order
    yielded = [[0, 2, 3], [0, 1, 4], [1, 2]]  # what each rank had yielded, out of order (rank 2 lags)
    first = loaders(dataset, 3, batch_size=3, in_order=False)
    for loader, batches in zip(first, yielded, strict=True):
        prefix = next(i for i in range(len(batches) + 1) if i not in batches)
        extra = [b for b in batches if b > prefix]
        loader.load_state_dict({**plain(loader.state_dict()), "yielded_prefix": prefix, "yielded_extra": extra})
    states = [plain(loader.state_dict()) for loader in first]
    assert states[0]["yielded_extra"] == [2, 3] and states[1]["yielded_prefix"] == 2
    before = [i for r, batches in enumerate(yielded) for b in batches for i in whole[r][b]]

    other = loaders(dataset, 2, batch_size=4)
    with pytest.raises(ValueError, match="out of order") as info:
        other[0].load_state_dict(states[0])
    assert "merge_states" in str(info.value)

    merged = plain(merge_states(states))
    assert merged["layout"]["rank"] is None and merged["yielded_extra"] == []
    for loader in other:
        loader.load_state_dict(merged)
    assert_each_sample_once(before, rest(other), 2)
    with pytest.raises(ValueError, match="one state per rank of 3"):
        merge_states(states[:2])


@pytest.mark.timeout(60)
def test_an_out_of_order_state_resumes_its_own_rank_exactly(dataset):
    whole = rank_batches(dataset, 2, 4)
    first = loaders(dataset, 2, batch_size=4, in_order=False)
    iterators = [iter(loader) for loader in first]
    taken = [[next(iterator).tolist() for _ in range(3)] for iterator in iterators]
    states = [plain(loader.state_dict()) for loader in first]
    second = loaders(dataset, 2, batch_size=4, in_order=False)
    for loader, state in zip(second, states, strict=True):
        loader.load_state_dict(state)
    for rank, loader in enumerate(second):
        assert sorted(taken[rank] + [b.tolist() for b in loader]) == sorted(whole[rank])


# ---------------------------------------------------------------------------- what decides the order


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("options", "words"),
    [
        (dict(seed=SEED + 1), "seed: the state has 11, this loader has 12"),
        (dict(shuffle=False), "shuffle: the state has True, this loader has False"),
    ],
)
def test_a_state_over_another_order_is_refused_naming_what_differs(dataset, options, words):
    first = loaders(dataset, 2, batch_size=3)
    take(first, 1)
    state = first[0].state_dict()
    base = rpcdl.RPCDataloader(dataset, batch_size=3, shuffle=True)
    other = distributed_loader(base, 3, 0, **{"seed": SEED, **options})
    with pytest.raises(ValueError, match="another order") as info:
        other.load_state_dict(state)
    assert words in str(info.value) and "start the epoch again" in str(info.value)
    shorter = distributed_loader(rpcdl.RPCDataloader(rpcdl.RPCDataset(dataset.workers, RangeDataset, N - 1),
                                                     batch_size=3, shuffle=True), 3, 0, seed=SEED)  # fmt: skip
    with pytest.raises(ValueError, match="length: the state has 50, this loader has 49"):
        shorter.load_state_dict(state)

    # a state at an epoch's start consumed nothing: it names the epoch, which any order starts whole
    ended = loaders(dataset, 2, batch_size=3)
    for loader in ended:
        list(loader)
    at_start = ended[0].state_dict()
    assert (at_start["epoch"], at_start["consumed"]) == (1, 0)
    other.load_state_dict(at_start)
    assert other.epoch is None and len(list(other)) == len(other) == 6  # rank 0 of 3: 17 samples, the whole epoch 1
    assert other.epoch == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("saved_with_generator", [True, False], ids=["generator-to-none", "none-to-generator"])
def test_a_state_from_a_loader_with_a_generator_is_refused_by_one_without_and_the_reverse(
    dataset, saved_with_generator
):
    """The order of a shuffled loader comes from its generator= or from torch's global generator: a state of
    one must not load into the other (it did, then skipped and repeated samples)."""

    def build(with_generator):
        generator = torch.Generator().manual_seed(5) if with_generator else None
        return rpcdl.RPCDataloader(dataset, batch_size=5, shuffle=True, generator=generator)

    torch.manual_seed(5)
    saver = build(saved_with_generator)
    iterator = iter(saver)
    next(iterator)
    state = saver.state_dict()
    expected = "generator" if saved_with_generator else "global"
    assert state["seed_source"] == expected
    with pytest.raises(ValueError, match="seed_source: the state has") as info:
        build(not saved_with_generator).load_state_dict(state)
    assert "generator=" in str(info.value)
    same = build(saved_with_generator)
    same.load_state_dict(state)
    assert len([i for batch in same for i in batch.tolist()]) == N - 5


# ---------------------------------------------------------------------------- torchdata.nodes


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("old", "new"), [(4, 3), (2, 3)])
def test_rpc_mapper_under_a_torchdata_loader_resumes_on_another_world_size(two_workers, old, new):
    """SamplerWrapper(ElasticDistributedSampler) -> RPCMapper -> Batcher -> Loader: a rank's Loader state
    (its sampler's global position) resumes on ``new`` ranks, every sample once."""
    nodes = pytest.importorskip("torchdata.nodes")
    from rpcdl.integrations.torchdata import RPCMapper

    def pipeline(world_size, rank):
        sampler = ElasticDistributedSampler(range(N), num_replicas=world_size, rank=rank, seed=SEED)
        mapped = RPCMapper(nodes.SamplerWrapper(sampler), two_workers, int, prefetch_factor=3)
        return nodes.Loader(nodes.Batcher(mapped, batch_size=3, drop_last=False))

    first = [pipeline(old, rank) for rank in range(old)]
    iterators = [iter(loader) for loader in first]
    before = [i for _ in range(3) for iterator in iterators for i in next(iterator)]  # items pulled ahead, too
    state = first[-1].state_dict()
    second = [pipeline(new, rank) for rank in range(new)]
    for loader in second:
        loader.load_state_dict(state)
    after = [i for loader in second for batch in loader for i in batch]
    assert_each_sample_once(before, after, new)


# ---------------------------------------------------------------------------- what a state must hold


@pytest.mark.timeout(60)
def test_a_distributed_state_without_its_global_position_is_refused(dataset):
    """A state whose global position is gone must not load as a whole epoch's start (it did: the old format's
    path took it for torch's DistributedSampler and resumed another shape at the batch number alone)."""
    first = loaders(dataset, 6, batch_size=5)  # 2 batches per rank, as on 7 ranks
    iterators, _ = take(first, 1)
    state = plain(first[0].state_dict())
    for iterator in iterators:
        iterator.close()
    stripped = {name: value for name, value in state.items() if name != "layout"}
    other = loaders(dataset, 7, batch_size=5)[0]
    with pytest.raises(ValueError, match=r"missing \['layout'\]"):
        other.load_state_dict(stripped)
    other.load_state_dict(state)
    assert other.state_dict()["consumed"] == 30


@pytest.mark.timeout(60)
def test_the_length_after_a_resumed_epoch_is_the_next_epochs(dataset):
    """len() tells the resumed epoch's batches until that epoch ends, then a whole epoch's: as many as the
    next iteration yields."""
    first = loaders(dataset, 4, batch_size=2)
    iterators, _ = take(first, 3)
    state = plain(first[0].state_dict())  # 24 of 50 consumed
    for iterator in iterators:
        iterator.close()
    loader = loaders(dataset, 2, batch_size=5)[0]
    loader.load_state_dict(state)
    assert len(loader) == 3 + 3  # the 3 batches counted before, then 13 of the 26 left in batches of 5
    assert len(list(loader)) == 3
    assert loader.state_dict()["epoch"] == 1
    assert len(loader) == len(list(loader)) == 5  # epoch 1, whole: 25 samples in batches of 5


@pytest.mark.timeout(60)
def test_the_state_and_length_asked_while_a_resumed_epoch_runs_on_another_thread(dataset, switching_often):
    """A thread asks len() and state_dict() while another iterates a resumed epoch: each answer is the
    resumed epoch's (the global position never going back) or, once it ended, the next epoch's start."""
    first = loaders(dataset, 4, batch_size=2)
    iterators, before = take(first, 3)
    state = plain(first[0].state_dict())  # 24 of 50 consumed
    for iterator in iterators:
        iterator.close()
    loader = loaders(dataset, 2, batch_size=5)[0]
    loader.load_state_dict(state)
    answers = []
    done = threading.Event()

    def ask() -> None:
        while not done.is_set():
            answers.append((len(loader), plain(loader.state_dict())))

    asker = threading.Thread(target=ask, name="test-asker")
    asker.start()
    try:
        batches = [batch.tolist() for batch in loader]
    finally:
        done.set()
        asker.join()
    answers.append((len(loader), plain(loader.state_dict())))
    assert len(batches) == 3 and not set(before) & {i for batch in batches for i in batch}
    consumed = [s["consumed"] for _, s in answers if s["epoch"] == 0]
    assert consumed == sorted(consumed) and set(consumed) <= {24, 34, 44, 50}
    assert all(length == 6 for length, s in answers if s["epoch"] == 0)  # 3 counted before, 3 of this rank
    assert answers[-1][0] == 5 and (answers[-1][1]["epoch"], answers[-1][1]["consumed"]) == (1, 0)
