"""bench/models/l2_tile_order.py: every order visits each (expert, M-tile, N-tile) once; the LRU model
counts compulsory reads at the least, and more when L2 is too small to hold a reuse."""
import collections
import importlib.util
import pathlib
import random

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("l2_tile_order", ROOT / "bench" / "models" / "l2_tile_order.py")
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)


def test_orders_are_permutations():
    rows = [list(range(300)), [], list(range(5)), list(range(129)), list(range(1000))]
    units = [(len(r) + 127) // 128 for r in rows]
    want = collections.Counter((e, u, nt) for e in range(5) for u in range(units[e]) for nt in range(5))
    for order in ("default", "band1", "band2", "band3", "band5", "band9", "block1", "block2", "block3", "block8"):
        got = collections.Counter(m.tiles(rows, 5, order))
        assert got == want, order


def test_default_order_and_bands_match_the_kernels():
    rows = [list(range(256)), list(range(128))]
    assert list(m.tiles(rows, 3, "default"))[:4] == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0)]
    assert list(m.tiles(rows, 3, "band1"))[:3] == [(0, 0, 0), (0, 1, 0), (0, 0, 1)]
    assert list(m.tiles(rows, 3, "block2"))[:4] == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (1, 0, 0)]


def test_routing_is_sorted_and_balanced():
    rows = m.route(1000, 16, 4, random.Random(0))
    assert sum(len(r) for r in rows) == 4000
    assert all(r == sorted(r) and len(set(r)) == len(r) for r in rows)


def test_reads_at_least_compulsory_and_grow_when_l2_shrinks(monkeypatch):
    monkeypatch.setitem(m.CASES, "tiny", dict(T=2048, d=256, E=16, K=4, N=512, BN=128, stream_read=4, stream_write=6))
    big, comp = m.simulate("tiny", "default", 1e12, 1)
    assert sum(big.values()) == comp  # everything fits: every byte read once
    small, _ = m.simulate("tiny", "default", 64e3, 1)
    assert sum(small.values()) > comp
    assert small["stream"] == big["stream"]  # streamed inputs are read once either way


def test_shape_cases_size_each_gemm():
    up = m.make_case("2048,256,192,16,4", "up", 128)
    assert (up["N"], up["red"], up["gathered"]) == (384, 256, True)
    dx = m.make_case("2048,256,192,16,4", "dX", 128)
    assert (dx["N"], dx["red"], dx["gathered"]) == (256, 384, False)
    down = m.make_case("2048,256,192,16,4", "down", 128)
    assert (down["N"], down["red"]) == (256, 192)
    # Everything fits: every byte read once; a contiguous A counts each grouped row (T * K of them),
    # a gathered one each token once.
    for case, a_rows in ((up, 2048), (dx, 2048 * 4)):
        reads, comp = m.simulate(case, "default", 1e12, 1)
        n_tiles = (case["N"] + 127) // 128
        assert comp == a_rows * 2 * case["red"] + 16 * n_tiles * 128 * case["red"] * 2
        assert sum(reads.values()) == comp
    # A partial last N-tile and K-slice (N 2880 at BN 128, reduction 2880 in 64-column slices).
    odd = m.make_case("512,2880,1440,4,1", "down", 128)
    reads, comp = m.simulate(odd, "band8", 1e12, 1)
    assert sum(reads.values()) == comp


def test_drift_spreads_a_waves_reuse_over_time(monkeypatch):
    monkeypatch.setitem(m.CASES, "tiny", dict(T=2048, d=1024, E=16, K=4, N=512, BN=128, stream_read=0, stream_write=3))
    # drift 0 is the in-step wave; with room for everything, drift changes nothing (each byte once).
    assert m.simulate("tiny", "default", 1e12, 1, drift=0) == m.simulate("tiny", "default", 1e12, 1)
    assert m.simulate("tiny", "default", 1e12, 1, drift=8) == m.simulate("tiny", "default", 1e12, 1)
    # An L2 that holds a few of the wave's K-slices (~0.25 MB of distinct rows and weights each here): in step, siblings share every
    # slice; drifted by more than L2 holds, they fetch it again.
    step, comp = m.simulate("tiny", "default", 2e6, 1, sms=32)
    drifted, _ = m.simulate("tiny", "default", 2e6, 1, sms=32, drift=16)
    assert sum(step.values()) >= comp
    assert sum(drifted.values()) > sum(step.values())


def test_partitions_fetch_per_half_unless_peers_fill(monkeypatch):
    monkeypatch.setitem(m.CASES, "tiny", dict(T=2048, d=1024, E=16, K=4, N=512, BN=128, stream_read=0, stream_write=3))
    one, comp = m.simulate("tiny", "default", 1e12, 1, sms=32)
    assert m.simulate("tiny", "default", 1e12, 1, sms=32, partitions=1) == (one, comp)
    # Room for everything: with peers filling, each byte is read once; without, a line read by both
    # halves' CTAs is read once per half (more than once, at most twice).
    peer, _ = m.simulate("tiny", "default", 1e12, 1, sms=32, partitions=2, peer_fill=True)
    own, _ = m.simulate("tiny", "default", 1e12, 1, sms=32, partitions=2)
    assert sum(peer.values()) == comp
    assert comp < sum(own.values()) <= 2 * comp
    # A small L2: halves hold half each, so peers filling still reads at least the one-LRU bytes.
    small, _ = m.simulate("tiny", "default", 2e6, 1, sms=32)
    small_peer, _ = m.simulate("tiny", "default", 2e6, 1, sms=32, partitions=2, peer_fill=True)
    assert sum(small_peer.values()) >= sum(small.values())


def test_jitter_lets_ctas_drift_apart(monkeypatch):
    monkeypatch.setitem(m.CASES, "tiny", dict(T=4096, d=1024, E=8, K=2, N=1024, BN=128, stream_read=0, stream_write=2))
    # Room for everything: drifting CTAs still read each byte once.
    one, comp = m.simulate("tiny", "default", 1e12, 1, sms=16)
    drift, _ = m.simulate("tiny", "default", 1e12, 1, sms=16, jitter=0.3)
    assert sum(drift.values()) == sum(one.values()) == comp
    # An L2 that holds about a wave's working set: in step the wave's siblings share every slice;
    # CTAs that drift apart by tiles touch more of the order at once and read more.
    step, _ = m.simulate("tiny", "default", 3e6, 1, sms=16)
    drift, _ = m.simulate("tiny", "default", 3e6, 1, sms=16, jitter=0.3)
    assert sum(drift.values()) > sum(step.values())
