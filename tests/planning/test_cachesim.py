"""The caching-allocator simulator follows PyTorch's CUDA caching allocator policy (defaults)."""
from megatron_lc.planning.cachesim import CachingAllocatorSim, allocation_size, round_size, simulate
from megatron_lc.planning.trace import Event, Trace

MiB = 1 << 20


def test_rounding_and_segment_sizes():
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    assert allocation_size(512) == 2 * MiB and allocation_size(MiB) == 2 * MiB  # small pool: 2 MiB segments
    assert allocation_size(MiB + 512) == 20 * MiB and allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB and allocation_size(11 * MiB + 1) == 12 * MiB  # 2 MiB rounding


def test_small_requests_pack_into_one_segment_and_split():
    s = CachingAllocatorSim()
    a = [s.malloc(1000) for _ in range(4)]  # 1024 each, one 2 MiB small segment, split each time
    assert s.reserved == 2 * MiB and s.allocated == 4 * 1024 and a == [0, 1024, 2048, 3072]
    s.free(a[1])
    assert s.malloc(600) == 1024  # best fit: the freed 1024 block, split (remainder 512 >= 512)


def test_large_split_rule_and_best_fit():
    s = CachingAllocatorSim()
    a = s.malloc(int(1.5 * MiB))  # 20 MiB segment; remainder 18.5 MiB > 1 MiB -> split
    b = s.malloc(3 * MiB)  # fits in the remainder
    assert s.reserved == 20 * MiB and b == a + int(1.5 * MiB)
    s.free(a)
    c = s.malloc(int(1.25 * MiB))  # best fit is the freed 1.5 MiB block; remainder 0.25 MiB <= 1 MiB: not split
    assert c == a and s.allocated == 3 * MiB + int(1.5 * MiB)


def test_segments_never_merge():
    s = CachingAllocatorSim()
    x = s.malloc(12 * MiB)  # own 12 MiB segment
    y = s.malloc(12 * MiB)  # another 12 MiB segment
    s.free(x)
    s.free(y)
    z = s.malloc(20 * MiB)  # 24 MiB are free but in two segments: a third segment is needed
    assert s.reserved == 44 * MiB and z not in (x, y)


def test_fragmentation_reserved_vs_allocated_and_capacity():
    # a long-lived 6 MiB tensor after each short-lived one: a 20 MiB segment holds 3 long-lived ones (18 MiB, split
    # remainders of 2 MiB are too small), the short-lived one reuses the 6 MiB hole it left; 10 -> 4 segments
    ev = []
    for i in range(10):
        ev += [Event("malloc", 2 * i, 6 * MiB), Event("malloc", 2 * i + 1, 6 * MiB), Event("free", 2 * i, 6 * MiB)]
    r = simulate(Trace(ev))
    assert r.peak_requested_bytes == r.peak_allocated_bytes == 66 * MiB  # 10 long-lived + 1 short-lived
    assert r.peak_reserved_bytes == 80 * MiB and r.segments_allocated == 4
    s = CachingAllocatorSim(capacity=24 * MiB)
    t = s.malloc(12 * MiB)
    s.free(t)
    s.malloc(16 * MiB)  # 12 + 16 > 24: the free 12 MiB segment is released first, no OOM
    assert s.reserved == 16 * MiB and s.seg_release == 1 and s.ooms == 0
