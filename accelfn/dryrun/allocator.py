"""A replay of PyTorch's CUDA caching allocator over a dry run's allocation trace: the memory
`torch.cuda.max_memory_reserved` reports (the allocator's segments, which hold freed blocks for reuse), beside the
live bytes `StepTracker` counts (`max_memory_allocated`, before rounding).

The rules are those of `c10/cuda/CUDACachingAllocator.cpp` (pytorch/pytorch at 001074d; the names below are its
functions and constants): sizes rounded up to 512 bytes (`round_size`, `kMinBlockSize`); requests of at most 1 MiB
(`kSmallSize`) served from a small pool of 2 MiB segments (`kSmallBuffer`), larger ones from the large pool, whose
new segments are 20 MiB (`kLargeBuffer`) for requests under 10 MiB (`kMinLargeAlloc`) and the request rounded up to
2 MiB (`kRoundLarge`) above (`get_allocation_size`); the smallest free block of the pool and stream that fits
(`get_free_block`, best fit by (size, address)); a block split when what remains is at least 512 bytes in the small
pool, more than 1 MiB in the large one (`should_split`); freed blocks merged with free neighbours of their segment
(`free_block`, `try_merge_blocks`); segments never given back, except when a new one would not fit in the device's
memory: then every wholly free cached segment is released and the allocation retried (`malloc`,
`release_cached_blocks`). `max_split_size` and `expandable_segments` (`PYTORCH_CUDA_ALLOC_CONF`) are options;
expandable segments are modelled as one segment per pool that maps 2 MiB (small) or 20 MiB (large) pages at its
end, best fit ignoring a block's room to grow, and releasing only the free pages at the end (the allocator also
unmaps free pages inside a segment).

Not modelled: the delay before a block freed while another stream uses it is reused (`record_stream`'s events),
`roundup_power2_divisions`, `garbage_collection_threshold`, CUDA graphs' private pools.

Example:
    >>> from accelfn.dryrun.allocator import CachingAllocator
    >>> a = CachingAllocator()
    >>> x = a.malloc(1000)  # 1,024 bytes of a new 2 MiB small segment
    >>> y = a.malloc(3 << 20)  # 3 MiB of a new 20 MiB large segment
    >>> a.free(x)
    >>> a.reserved, a.allocated, a.peak_requested
    (23068672, 3145728, 3146728)
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence
from typing import Any

import attrs

__all__ = ["CachingAllocator", "Options", "Trace", "Reserved", "replay", "round_size", "allocation_size"]

MIN_BLOCK = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
SMALL_SIZE = 1 << 20  # kSmallSize: the largest "small" allocation is 1 MiB
SMALL_BUFFER = 2 << 20  # kSmallBuffer: "small" allocations are packed in 2 MiB segments
LARGE_BUFFER = 20 << 20  # kLargeBuffer: requests of 1-10 MiB get a 20 MiB segment
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge: larger requests get a segment rounded up to 2 MiB

DEFAULT_STREAM = "default"


def round_size(n: int) -> int:
    """`round_size`: bytes a request of `n` takes (512-byte multiples; roundup_power2_divisions unset).

    Example:
        >>> round_size(1), round_size(512), round_size(513)
        (512, 512, 1024)
    """
    return MIN_BLOCK if n < MIN_BLOCK else -(-n // MIN_BLOCK) * MIN_BLOCK


def allocation_size(size: int) -> int:
    """`get_allocation_size`: the bytes of the segment a (rounded) request of `size` makes when nothing cached fits.

    Example:
        >>> [allocation_size(s) >> 20 for s in (4096, 1 << 20, (1 << 20) + 512, 10 << 20, (10 << 20) + 512)]
        [2, 2, 20, 10, 12]
    """
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@attrs.frozen
class Options:
    """`PYTORCH_CUDA_ALLOC_CONF`'s options the replay follows: `max_split_size` in bytes (None: unlimited, the
    default) and `expandable_segments` (off by default, and in torchtitan's runs of 2024-12)."""

    max_split_size: int | None = None
    expandable_segments: bool = False

    @classmethod
    def from_conf(cls, conf: str) -> Options:
        """The options of a `PYTORCH_CUDA_ALLOC_CONF` value (`key:value` pairs, comma-separated); its other keys
        (`garbage_collection_threshold`, `roundup_power2_divisions`, ...) are not replayed and are ignored.

        Example:
            >>> Options.from_conf("expandable_segments:True,max_split_size_mb:128")
            Options(max_split_size=134217728, expandable_segments=True)
        """
        out = cls()
        for item in filter(None, (part.strip() for part in conf.split(","))):
            key, sep, value = item.partition(":")
            key, value = key.strip(), value.strip()
            if not sep or not value:
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {item!r} is not key:value")
            if key == "expandable_segments":
                if value not in ("True", "False"):
                    raise ValueError(
                        f"PYTORCH_CUDA_ALLOC_CONF: expandable_segments is {value!r}, not True or False"
                    )
                out = attrs.evolve(out, expandable_segments=value == "True")
            elif key == "max_split_size_mb":
                # CUDAAllocatorConfig: it must be above kLargeBuffer's 20 MiB
                if not value.isdigit() or int(value) <= LARGE_BUFFER >> 20:
                    raise ValueError(
                        f"PYTORCH_CUDA_ALLOC_CONF: max_split_size_mb is {value!r}; it must be a whole number above 20"
                    )
                out = attrs.evolve(out, max_split_size=int(value) << 20)
        return out


class _Block:
    __slots__ = ("addr", "size", "prev", "next", "allocated", "requested", "pool")

    def __init__(self, addr: int, size: int, pool: _Pool) -> None:
        self.addr = addr
        self.size = size
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False
        self.requested = 0
        self.pool = pool


class _Pool:
    """The free blocks of one (stream, small or large) pool, sorted by (size, address) as `BlockPool.blocks`."""

    __slots__ = ("small", "keys", "blocks", "base", "mapped", "last", "reserved")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.reserved = 0  # the bytes of its segments
        self.keys: list[tuple[int, int]] = []  # (size, addr) of the free blocks, sorted
        self.blocks: dict[int, _Block] = {}  # addr -> free block
        # expandable segments: the pool's one segment, its mapped bytes and its last block
        self.base = 0
        self.mapped = 0
        self.last: _Block | None = None

    def insert(self, b: _Block) -> None:
        bisect.insort(self.keys, (b.size, b.addr))
        self.blocks[b.addr] = b

    def remove(self, b: _Block) -> None:
        i = bisect.bisect_left(self.keys, (b.size, b.addr))
        del self.keys[i]
        del self.blocks[b.addr]


class CachingAllocator:
    """PyTorch's CUDA caching allocator (see the module docs) over sizes and streams only.

    `capacity` is the device memory the segments may take (None: unlimited); `malloc(n, stream)` returns a
    handle for `free`. `reserved`, `allocated` (rounded blocks) and `requested` (the bytes asked for) are the
    allocator's `reserved_bytes`, `allocated_bytes` and `requested_bytes`, each with its `peak_` maximum.
    """

    def __init__(self, capacity: int | None = None, options: Options = Options()) -> None:
        self.capacity = capacity
        self.options = options
        self.max_split = options.max_split_size if options.max_split_size is not None else 1 << 62
        self._pools: dict[tuple[Hashable, bool], _Pool] = {}
        self._next_addr = 1 << 20
        self.reserved = self.allocated = self.requested = 0
        self.peak_reserved = self.peak_allocated = self.peak_requested = 0
        self.segments = 0  # segments allocated (cudaMalloc calls), released ones included
        self.releases = 0  # times the cached segments were released to make room (num_alloc_retries)
        self.over_capacity = False  # a request did not fit even after the release (an OOM on the device)
        self.at_peak: dict[
            tuple[Hashable, bool], int
        ] = {}  # (stream, small pool) -> its segments' bytes at the peak

    # ---- the public calls --------------------------------------------------------------------------------------
    def malloc(self, n: int, stream: Hashable = DEFAULT_STREAM) -> _Block:
        """`malloc`: a block of at least `n` bytes on `stream` (n > 0)."""
        size = round_size(n)
        pool = self._pool(stream, size <= SMALL_SIZE)
        block = self._free_block(pool, size)
        if block is None:
            block = self._new_block(pool, size)
            if block is None:  # release_available_cached_blocks (max_split_size), then release_cached_blocks
                self.releases += 1
                self._release_oversize(pool, size)
                block = self._new_block(pool, size)
                if block is None:
                    self._release_cached()
                    block = self._new_block(pool, size, force=True)
        assert block is not None
        if self._should_split(block, size):
            rest = _Block(block.addr + size, block.size - size, pool)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            if pool.last is block:
                pool.last = rest
            pool.insert(rest)
        block.allocated, block.requested = True, n
        self.allocated += block.size
        self.requested += n
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)
        return block

    def free(self, block: _Block) -> None:
        """`free` / `free_block`: the block goes back to its pool, merged with its free neighbours."""
        assert block.allocated, "a block freed twice"
        pool = block.pool
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        for other in (block.prev, block.next):  # try_merge_blocks: [other block] and [block other]
            if other is None or other.allocated:
                continue
            pool.remove(other)
            if other is block.prev:
                block.addr, block.prev = other.addr, other.prev
                if block.prev is not None:
                    block.prev.next = block
            else:
                block.next = other.next
                if block.next is not None:
                    block.next.prev = block
                if pool.last is other:
                    pool.last = block
            block.size += other.size
        pool.insert(block)

    def reset_peaks(self) -> None:
        """`reset_peak_stats`: each peak starts again from the current value."""
        self.peak_reserved, self.peak_allocated, self.peak_requested = (
            self.reserved,
            self.allocated,
            self.requested,
        )

    # ---- the rules ---------------------------------------------------------------------------------------------
    def _pool(self, stream: Hashable, small: bool) -> _Pool:
        pool = self._pools.get((stream, small))
        if pool is None:
            pool = self._pools[(stream, small)] = _Pool(small)
        return pool

    def _should_split(self, block: _Block, size: int) -> bool:
        """`should_split`."""
        remaining = block.size - size
        if block.pool.small or self.options.expandable_segments:
            return remaining >= MIN_BLOCK
        return size < self.max_split and remaining > SMALL_SIZE

    def _free_block(self, pool: _Pool, size: int) -> _Block | None:
        """`get_free_block`: the smallest free block of the pool that fits (the lowest address among equals)."""
        i = bisect.bisect_left(pool.keys, (size, -1))
        if i == len(pool.keys):
            return None
        found = pool.blocks[pool.keys[i][1]]
        if size < self.max_split <= found.size:  # no oversize block for a request under max_split_size
            return None
        if size >= self.max_split and found.size >= size + LARGE_BUFFER:  # oversize ones within 20 MiB only
            return None
        pool.remove(found)
        return found

    def _fits(self, nbytes: int) -> bool:
        return self.capacity is None or self.reserved + nbytes <= self.capacity

    def _grow(self, pool: _Pool, nbytes: int) -> None:
        self.reserved += nbytes
        pool.reserved += nbytes
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
            self.at_peak = {key: p.reserved for key, p in self._pools.items() if p.reserved}

    def _new_block(self, pool: _Pool, size: int, force: bool = False) -> _Block | None:
        """`alloc_block`: a new segment (None when it would not fit; `force` allocates it anyway: the OOM)."""
        if self.options.expandable_segments:
            return self._expand(pool, size, force)
        nbytes = allocation_size(size)
        if not self._fits(nbytes):
            if not force:
                return None
            self.over_capacity = True
        block = _Block(self._next_addr, nbytes, pool)
        self._next_addr += nbytes
        self.segments += 1
        self._grow(pool, nbytes)
        return block

    def _expand(self, pool: _Pool, size: int, force: bool) -> _Block | None:
        """`try_allocate_expandable_block`: map pages (2 MiB small, 20 MiB large) at the end of the pool's one
        segment, merged with its free last block."""
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        if pool.base == 0:
            pool.base = self._next_addr
            self._next_addr += 1 << 50  # the segment's address space
            self.segments += 1
        tail = pool.last if pool.last is not None and not pool.last.allocated else None
        have = tail.size if tail is not None else 0
        nbytes = -(-(size - have) // page) * page
        if not self._fits(nbytes):
            if not force:
                return None
            self.over_capacity = True
        self._grow(pool, nbytes)
        if tail is not None:
            pool.remove(tail)
            tail.size += nbytes
            pool.mapped += nbytes
            return tail
        block = _Block(pool.base + pool.mapped, nbytes, pool)
        block.prev = pool.last
        if pool.last is not None:
            pool.last.next = block
        pool.last = block
        pool.mapped += nbytes
        return block

    def _release_oversize(self, pool: _Pool, size: int) -> None:
        """`release_available_cached_blocks` (with max_split_size only): the smallest whole free oversize block
        that covers the request, or the largest ones until they do."""
        if self.options.max_split_size is None or self.options.expandable_segments:
            return
        target = max(size, self.max_split)
        whole = [pool.blocks[a] for s, a in pool.keys if s >= self.max_split]
        whole = [b for b in whole if b.prev is None and b.next is None]
        big = [b for b in whole if b.size >= target]
        chosen = big[:1] if big else []
        if not big:
            total = 0
            for b in reversed(whole):
                if total >= target:
                    break
                chosen.append(b)
                total += b.size
            if total < target:
                return
        for b in chosen:
            self._release(pool, b)

    def _release(self, pool: _Pool, block: _Block) -> None:
        pool.remove(block)
        self.reserved -= block.size
        pool.reserved -= block.size

    def _release_cached(self) -> None:
        """`release_cached_blocks`: every wholly free segment of every pool and stream goes back to the device
        (expandable segments: the free pages at the segment's end are unmapped)."""
        for pool in self._pools.values():
            if self.options.expandable_segments:
                tail = pool.last
                if tail is None or tail.allocated:
                    continue
                page = SMALL_BUFFER if pool.small else LARGE_BUFFER
                end = tail.addr + tail.size
                start = -(-(tail.addr - pool.base) // page) * page + pool.base
                if end - start <= 0:
                    continue
                pool.remove(tail)
                tail.size -= end - start
                pool.mapped -= end - start
                self.reserved -= end - start
                pool.reserved -= end - start
                if tail.size:
                    pool.insert(tail)
                else:
                    pool.last = tail.prev
                    if tail.prev is not None:
                        tail.prev.next = None
                continue
            for b in [b for b in pool.blocks.values() if b.prev is None and b.next is None]:
                self._release(pool, b)


# ---- replaying a step's trace ------------------------------------------------------------------------------------


@attrs.frozen
class Trace:
    """What the replay reads of one measured step: the tracker's `events` ((seq, delta bytes, record)), where the
    step starts in them (before: the state the step was given, allocated in the order it was labelled), and the
    records of the state before and after the step, position for position (a record in both: updated in place)."""

    events: Sequence[tuple[int, int, Any]]
    step_start: int = 0
    inputs: Sequence[Any] = ()
    outputs: Sequence[Any] = ()


@attrs.frozen
class Reserved:
    """The replay's figures, in bytes: `reserved` the largest peak of reserved memory over the steps replayed,
    `allocated` the first step's peak of the bytes asked for (the tracker's peak, to the byte), `rounded` the
    peak of the blocks handed out (512-byte multiples, `max_memory_allocated`), `per_step` each step's peak
    reserved, `segments` the segments allocated, `releases` the times the cache was released to make room and
    `over_capacity` whether a request did not fit even then."""

    reserved: int
    allocated: int
    rounded: int
    per_step: tuple[int, ...]
    per_step_allocated: tuple[int, ...]
    segments: int
    releases: int
    over_capacity: bool
    by_pool: dict[str, int] = attrs.Factory(dict)  # "stream small|large" -> its segments' bytes at the peak


def stream_of(rec: Any) -> str:
    """The stream a record's memory is allocated on: its `stream` attribute where the tracker set one (FSDP2's
    all-gather and reduce-scatter buffers), else the default (compute) stream."""
    return getattr(rec, "stream", "") or DEFAULT_STREAM


def replay(
    trace: Trace, *, capacity: int | None = None, steps: int = 2, options: Options = Options()
) -> Reserved:
    """Replay the step `steps` times on one `CachingAllocator` (its cache carries over: the second step is the
    steady state). The state before the step is allocated first; after each step the state it was given is
    freed (`state = step(state, batch)`). A record of the input state that a step's event names stands, from the
    second step on, for the previous step's output at its place. What the first step made and left alive
    besides its outputs (torch pipelining's receive buffers, FSDP's unsharded parameters, the metrics) is held
    across steps and reused, as their owners reuse them: each event sets a record's size (a resize that leaves
    it as it is allocates nothing).

    Example:
        >>> from accelfn.dryrun.allocator import Trace, replay
        >>> p, a = object(), object()  # a 4 MiB parameter updated in place; a 6 MiB activation
        >>> events = [(1, 4 << 20, p), (2, 6 << 20, a), (3, -(6 << 20), a)]
        >>> r = replay(Trace(events, step_start=1, inputs=[p], outputs=[p]))
        >>> r.allocated >> 20, r.reserved >> 20, r.per_step  # both in one 20 MiB segment, reused
        (10, 20, (20971520, 20971520))
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    alloc = CachingAllocator(capacity, options)
    events = trace.events
    # each event's record's size after it (resizes are deltas in the trace)
    sizes: dict[int, int] = {}
    after: list[int] = []
    for _, delta, rec in events:
        sizes[id(rec)] = size = max(0, sizes.get(id(rec), 0) + delta)
        after.append(size)
    pre = {id(rec) for _, _, rec in events[: trace.step_start]}
    outputs = {id(o) for o in trace.outputs}
    replaced = {
        id(i): o for i, o in zip(trace.inputs, trace.outputs, strict=False) if i is not o and id(i) in pre
    }
    held = {key for key, size in sizes.items() if size and key not in pre and key not in outputs}
    persistent = pre | held
    live: dict[Hashable, tuple[_Block, int]] = {}  # key -> (block, bytes)

    def inst(rec: Any, k: int) -> Hashable:
        return id(rec) if k == 1 or id(rec) in persistent else (k, id(rec))

    def key_of(rec: Any, k: int) -> Hashable:
        if k > 1 and id(rec) in replaced:  # the input state: the previous step's output at its place
            return inst(replaced[id(rec)], k - 1)
        return inst(rec, k)

    per_step: list[int] = []
    per_step_allocated: list[int] = []
    first = (0, 0)
    by_pool: dict[str, int] = {}
    for k in range(1, steps + 1):
        alloc.reset_peaks()
        start = 0 if k == 1 else trace.step_start
        for i in range(start, len(events)):
            rec = events[i][2]
            key = key_of(rec, k)
            block, size = live.get(key, (None, 0))
            new = after[i]
            if new == size:
                continue
            if block is not None:  # a resize frees the old block before the new one (the tracker's order)
                alloc.free(block)
                del live[key]
            if new:
                live[key] = (alloc.malloc(new, stream_of(rec)), new)
        if alloc.peak_reserved > max(per_step, default=-1):
            by_pool = {
                f"{stream} {'small' if small else 'large'}": n for (stream, small), n in alloc.at_peak.items()
            }
        per_step.append(alloc.peak_reserved)
        per_step_allocated.append(alloc.peak_requested)
        if k == 1:
            first = (alloc.peak_requested, alloc.peak_allocated)
        # the caller drops what the step was given (the previous step's outputs)
        for key in [key for key in live if _dropped(key, k, pre, outputs, persistent)]:
            alloc.free(live.pop(key)[0])
    return Reserved(
        reserved=max(per_step),
        allocated=first[0],
        rounded=first[1],
        per_step=tuple(per_step),
        per_step_allocated=tuple(per_step_allocated),
        segments=alloc.segments,
        releases=alloc.releases,
        over_capacity=alloc.over_capacity,
        by_pool=by_pool,
    )


def _dropped(key: Hashable, k: int, pre: set[int], outputs: set[int], persistent: set[int]) -> bool:
    """Whether the live `key` is freed at the end of step `k`: the input state the first step replaced, or the
    outputs step k - 1 made (step k's inputs)."""
    if k == 1:
        return key in pre and key not in outputs
    if isinstance(key, tuple):
        return bool(key[0] == k - 1)
    return k == 2 and key not in persistent
