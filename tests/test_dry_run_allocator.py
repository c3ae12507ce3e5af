"""The dry run's replay of PyTorch's CUDA caching allocator (accelfn/dryrun/allocator.py): each rule on a sequence
derived by hand from c10/cuda/CUDACachingAllocator.cpp (pytorch/pytorch 001074d; the comments name the function or
constant each expected value comes from), then the replay of a dry run's trace."""

from __future__ import annotations

import time
from typing import Any

import pytest

from accelfn.dryrun.allocator import CachingAllocator, Options, Reserved, Trace, replay

KIB, MIB = 1 << 10, 1 << 20


def test_sizes_round_up_to_512_bytes() -> None:
    a = CachingAllocator()
    a.malloc(1)  # round_size: below kMinBlockSize (512) -> 512
    a.malloc(513)  # round_size: 512 * ceil(513 / 512) = 1024
    assert (a.allocated, a.requested) == (512 + 1024, 1 + 513)
    assert a.reserved == 2 * MIB  # both in one small segment (kSmallBuffer)


def test_small_requests_share_2_mib_segments_and_large_ones_get_20_mib() -> None:
    a = CachingAllocator()
    # get_pool: size <= kSmallSize (1 MiB) -> small pool; get_allocation_size -> kSmallBuffer (2 MiB)
    a.malloc(MIB)
    assert a.reserved == 2 * MIB
    # rounds to 1 MiB + 512 > kSmallSize: large pool; under kMinLargeAlloc (10 MiB) -> kLargeBuffer (20 MiB)
    a.malloc(MIB + 1)
    assert a.reserved == 2 * MIB + 20 * MIB
    # best fit: the 10 MiB request is cut from that segment's free 19 MiB - 512 (leaving 9 MiB - 512)
    a.malloc(10 * MIB)
    assert a.reserved == 22 * MIB
    # get_allocation_size: at or above kMinLargeAlloc, the request rounded up to kRoundLarge (2 MiB): 12 MiB
    a.malloc(11 * MIB)
    assert (a.reserved, a.segments) == ((2 + 20 + 12) * MIB, 3)


def test_a_20_mib_segment_serves_requests_under_10_mib_until_it_is_used_up() -> None:
    a = CachingAllocator()
    for _ in range(6):  # each 3 MiB request splits the segment's free block (should_split: remaining > 1 MiB)
        a.malloc(3 * MIB)
    assert (a.reserved, a.segments) == (20 * MIB, 1)  # 18 MiB used, a 2 MiB free block left
    a.malloc(3 * MIB)  # get_free_block: no free block of 3 MiB -> alloc_block: a second kLargeBuffer segment
    assert (a.reserved, a.segments) == (40 * MIB, 2)


def test_large_blocks_split_only_above_1_mib_small_ones_from_512_bytes() -> None:
    a = CachingAllocator()
    a.malloc(
        19 * MIB
    )  # should_split (large): remaining 1 MiB is not > kSmallSize: the whole 20 MiB is handed out
    assert a.allocated == 20 * MIB
    b = CachingAllocator()
    b.malloc(19 * MIB - 512)  # remaining 1 MiB + 512 > kSmallSize: split
    assert b.allocated == 19 * MIB - 512
    c = CachingAllocator()
    c.malloc(MIB)  # small pool: a 2 MiB segment split (remaining 1 MiB >= kMinBlockSize)
    c.malloc(MIB - 512)  # the 1 MiB free block, split again: remaining 512 >= kMinBlockSize
    c.malloc(512)  # the 512-byte remainder: no new segment
    assert (c.reserved, c.allocated) == (2 * MIB, 2 * MIB)


def test_freed_blocks_coalesce_with_free_neighbours_and_best_fit_takes_the_smallest() -> None:
    a = CachingAllocator()
    x, y, z = (a.malloc(4 * MIB) for _ in range(3))  # one 20 MiB segment: [x 4 | y 4 | z 4 | 8 free]
    a.free(x)
    a.free(z)  # free_block -> try_merge_blocks: z merges with the free 8 MiB after it
    best = a.malloc(
        4 * MIB
    )  # get_free_block: lower_bound by size -> the 4 MiB block (x's), not the 12 MiB one
    assert best.addr == x.addr
    a.free(best)
    a.free(y)  # merges with both neighbours: the segment is one free 20 MiB block again
    a.malloc(18 * MIB)  # fits in it (without the merges it would need a new segment)
    assert (a.reserved, a.segments) == (20 * MIB, 1)


def test_freed_segments_stay_reserved() -> None:
    a = CachingAllocator()
    blocks = [a.malloc(n) for n in (100, 3 * MIB, 12 * MIB, 40 * MIB)]
    for b in blocks:
        a.free(b)  # free_block: back to the pool, never cudaFree'd
    assert a.allocated == 0
    # a 2 MiB small segment; 3 MiB and then 12 MiB cut from one 20 MiB segment (best fit); 40 MiB of its own
    assert (a.reserved, a.segments) == (2 * MIB + 20 * MIB + 40 * MIB, 3)


def test_at_capacity_the_wholly_free_segments_are_released_and_the_allocation_retried() -> None:
    a = CachingAllocator(capacity=40 * MIB)
    a.malloc(4 * MIB)  # a 20 MiB segment, split: [4 used | 16 free]
    b = a.malloc(17 * MIB)  # fits no free block: get_allocation_size -> an 18 MiB segment
    a.free(b)
    # 20 MiB more (19 rounded up to kRoundLarge) would make 58 > 40: malloc -> release_cached_blocks frees the
    # unsplit 18 MiB segment (release_blocks: blocks with no prev and no next; the split 20 MiB one stays) and
    # alloc_block retries
    a.malloc(19 * MIB)
    assert (a.reserved, a.releases, a.over_capacity) == (40 * MIB, 1, False)
    assert a.peak_reserved == 40 * MIB  # 20 + 18 before, 20 + 20 after: never above the capacity
    full = CachingAllocator(capacity=20 * MIB)
    full.malloc(12 * MIB)
    full.malloc(12 * MIB)  # nothing to release: the device's OOM (the replay goes on and says so)
    assert full.over_capacity


def test_each_stream_has_its_own_pools() -> None:
    a = CachingAllocator()
    x = a.malloc(4 * MIB, "compute")
    a.free(x)
    a.malloc(4 * MIB, "all_gather")  # get_free_block: a block of another stream is never reused
    assert a.reserved == 40 * MIB
    a.malloc(4 * MIB, "compute")  # the compute stream's cached block
    assert a.reserved == 40 * MIB


def test_max_split_size_keeps_oversize_blocks_whole_and_for_large_requests() -> None:
    a = CachingAllocator(options=Options(max_split_size=8 * MIB))
    x = a.malloc(12 * MIB)  # should_split: size >= max_split_size: never split; a 12 MiB segment
    a.free(x)
    a.malloc(4 * MIB)  # get_free_block: a request under max_split_size gets no oversize block: a new 20 MiB
    assert a.reserved == 32 * MIB
    a.malloc(11 * MIB)  # an oversize request takes an oversize block under size + kLargeBuffer: x's 12 MiB
    assert (a.reserved, a.allocated) == (32 * MIB, 4 * MIB + 12 * MIB)


def test_expandable_segments_grow_one_segment_by_20_mib_pages() -> None:
    plain, grown = CachingAllocator(), CachingAllocator(options=Options(expandable_segments=True))
    for a in (plain, grown):
        x = a.malloc(30 * MIB)  # plain: a 30 MiB segment; expandable: 2 pages of kLargeBuffer mapped (40 MiB)
        a.free(x)
        a.malloc(
            35 * MIB
        )  # plain: 30 MiB is too small, a new 36 MiB segment; expandable: fits in the 40 mapped
    assert plain.reserved == (30 + 36) * MIB
    assert grown.reserved == 40 * MIB


def test_options_read_pytorch_cuda_alloc_conf_and_name_a_bad_value() -> None:
    assert Options.from_conf("") == Options()
    assert Options.from_conf(" expandable_segments:True , garbage_collection_threshold:0.6") == Options(
        expandable_segments=True
    )
    assert Options.from_conf("max_split_size_mb:512").max_split_size == 512 * MIB
    with pytest.raises(ValueError, match="max_split_size_mb is '20'; it must be a whole number above 20"):
        Options.from_conf("max_split_size_mb:20")  # CUDAAllocatorConfig: must be > kLargeBuffer / 1 MiB
    with pytest.raises(ValueError, match="expandable_segments is 'yes'"):
        Options.from_conf("expandable_segments:yes")
    with pytest.raises(ValueError, match="'expandable_segments' is not key:value"):
        Options.from_conf("expandable_segments")


# ---- the replay of a step's trace --------------------------------------------------------------------------------


class Rec:
    """An allocation record as the tracker's (`stream` for the pool)."""

    def __init__(self, stream: str = "") -> None:
        self.stream = stream


def test_replay_carries_the_cache_over_and_the_next_step_frees_the_previous_output() -> None:
    # the step makes new params P1 (6 MiB), frees the ones it was given (P0, donated), then a 12 MiB activation
    p0, p1, act = Rec(), Rec(), Rec()
    events = [(1, 6 * MIB, p0), (2, 6 * MIB, p1), (3, -6 * MIB, p0), (4, 12 * MIB, act), (5, -12 * MIB, act)]
    r = replay(Trace(events, step_start=1, inputs=[p0], outputs=[p1]), steps=3)
    # step 1: [P0 | P1 | 8 free] in a 20 MiB segment; P0 freed; the activation fits in no free block: 12 MiB more.
    # steps 2 and 3: P0's free stands for the previous step's P1 (the state it was given): 6 + 12 MiB at the peak
    assert r.per_step_allocated == (18 * MIB, 18 * MIB, 18 * MIB)
    assert r.per_step == (32 * MIB, 32 * MIB, 32 * MIB) and r.reserved == 32 * MIB


def test_replay_holds_what_a_step_left_alive_across_steps_as_its_owner_reuses_it() -> None:
    # a receive buffer (8 MiB) the step makes and keeps (torch pipelining keeps its stage's), an unsharded
    # parameter FSDP resizes up and back down, an activation; the parameter P is updated in place
    p, buf, unsharded, act = Rec(), Rec(), Rec(), Rec()
    events = [(1, 2 * MIB, p), (2, 8 * MIB, buf), (3, 6 * MIB, unsharded), (4, 4 * MIB, act), (5, -4 * MIB, act),
              (6, -6 * MIB, unsharded)]  # fmt: skip
    r = replay(Trace(events, step_start=1, inputs=[p], outputs=[p]), steps=2)
    # step 2 finds the buffer allocated (its event sets the size it has: nothing to do): 2 + 8 + 6 + 4 MiB again,
    # not 8 MiB more
    assert r.per_step_allocated == (20 * MIB, 20 * MIB)


def test_replay_of_a_tracked_step_allocates_the_trackers_peak_to_the_byte() -> None:
    import torch

    from accelfn.dryrun.tracker import StepTracker

    with StepTracker() as t:
        x = torch.ones(300, 700)
        y = (x @ x.t()).relu()
        del x
        z = y.sum(0) + 1
    r = replay(Trace(t.events))
    assert r.allocated == t.peak_bytes > 0
    assert r.rounded >= r.allocated and r.reserved >= r.rounded
    assert z.shape == (300,)


def test_replay_of_a_million_events_takes_seconds() -> None:
    # 500,000 allocations of mixed sizes (97 KiB to 6 MiB, and 1 to 24 MiB), each freed 1,000 allocations later:
    # a million events, on sorted free lists (bisect) rather than scans
    sizes = [((i * 7919) % 64 + 1) * 97 * KIB if i % 3 else ((i * 31) % 24 + 1) * MIB for i in range(500_000)]
    recs = [Rec() for _ in range(500_000)]
    events: list[tuple[int, int, Any]] = []
    for i, size in enumerate(sizes):
        if i >= 1000:
            events.append((0, -sizes[i - 1000], recs[i - 1000]))
        events.append((0, size, recs[i]))
    start = time.perf_counter()
    r = replay(Trace(events), steps=1)
    assert time.perf_counter() - start < 30  # 3-4 s on this project's 2-core machine
    assert r.allocated == max(sum(sizes[max(0, i - 999) : i + 1]) for i in range(0, 500_000, 997))


def test_dry_run_reports_reserved_above_allocated_with_fsdp_streams_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import accelfn as af
    from accelfn.dryrun import allocator
    from accelfn.dryrun.tracker import FSDP_ALL_GATHER_STREAM, FSDP_REDUCE_SCATTER_STREAM

    seen: list[tuple[Trace, Reserved]] = []
    options: list[Options] = []
    real = allocator.replay

    def spy(trace: Trace, **kwargs: Any) -> Reserved:
        out = real(trace, **kwargs)
        seen.append((trace, out))
        options.append(kwargs["options"])
        return out

    monkeypatch.setattr(allocator, "replay", spy)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    report = af.dry_run("examples/train_llama.py", ["--model", "tiny"], nproc_per_node=8, device="cuda",
                        gpu="h100", search=False)  # fmt: skip
    ((trace, r),) = seen
    assert r.allocated == report.per_rank["peak"]  # the tracker's peak, to the byte
    assert report.per_rank["reserved"] == r.reserved >= r.rounded >= r.allocated
    assert r.reserved % (2 * MIB) == 0  # whole segments
    assert sum(r.by_pool.values()) == r.reserved  # by pool at the peak: the streams' pools each hold segments
    assert {key.split()[0] for key in r.by_pool} == {
        "default",
        FSDP_ALL_GATHER_STREAM,
        FSDP_REDUCE_SCATTER_STREAM,
    }
    # FSDP2's all-gather buffers and reduce-scatter outputs were allocated on their own streams
    streams = {allocator.stream_of(rec) for _, _, rec in trace.events}
    assert streams == {"default", FSDP_ALL_GATHER_STREAM, FSDP_REDUCE_SCATTER_STREAM}
    assert "peak reserved" in str(report) and '"reserved"' in report.to_json()
    # the real run's allocator configuration, read as its processes would: one segment per pool that grows
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    again = af.dry_run("examples/train_llama.py", ["--model", "tiny"], nproc_per_node=8, device="cuda",
                       gpu="h100", search=False)  # fmt: skip
    assert options == [Options(), Options(expandable_segments=True)]
    (trace2, grown) = seen[1]
    assert grown == replay(trace2, capacity=again.capacity_bytes, options=Options(expandable_segments=True))
    assert again.per_rank["reserved"] == grown.reserved >= again.per_rank["peak"] == report.per_rank["peak"]
