#!/usr/bin/env python3
"""A model, not a measurement: DRAM reads of a gathered varlen-M GEMM under tile orders, from an LRU
model of L2 fed the tiles' operand accesses in the order the persistent scheduler hands them out.

  python3 bench/models/l2_tile_order.py --case dA-1.4B --l2-mb 50 --orders default,block16,block32
  python3 bench/models/l2_tile_order.py --case up-E16K1 --orders default,band4,band8,band16
  python3 bench/models/l2_tile_order.py --shape 16384,2880,2880,128,4 --gemm down --orders default,band8 --tile-keys
  python3 bench/models/l2_tile_order.py --shape 32768,4096,1024,128,8 --gemm dA --tile-keys --drift 0,8,32
  python3 bench/models/l2_tile_order.py --shape 32768,4096,1024,128,8 --gemm dX --bn 192 --tile-keys --jitter 0,0.1,0.15
  python3 bench/models/l2_tile_order.py --shape 32768,4096,512,128,8 --gemm down --bn 192 --tile-keys --partitions 1,2 --peer-fill
(bench/results/h100/gemm_dram_bytes.md sets these variants against ncu's bytes: none fits every GEMM.)

What it models (tile_scheduler.cuh, tile_order.h): experts' rows in ascending token order (routing's
stable sort), tiles of BM = 128 rows x BN columns, run in waves of --sms tiles (the persistent grid:
tile t on CTA t % sms); a wave's tiles go through the reduction in step, K-slice by K-slice (64
columns: each tile's BM source rows, keyed per token so that a token's K experts share them, and its
weight slice BN x 64), then stream their outputs (and dA''s H) through L2: `--stream` 1 inserts those
bytes as never-reused keys (they occupy L2 as plain loads / stores would), 0 leaves them out
(evict-first taken as free).

Orders: `default` (expert, M-tile, N-tile innermost: the kernels' order below 48 MiB of weights per
expert); `bandW` (src/engine/tile_order.h: an expert's N-tiles in bands of W, M-tiles inside a band;
the kernels take band 8 from 48 MiB, heuristic.h kBandMinWeightBytes); `blockG` (not
built: experts in blocks of G, a block's M-tiles walked in rounds, round j = M-tile j of each of its
experts, so that a token's experts inside a block run close in time).

Cases (shapes of bench/configs): dA-1.4B (dA' of 1.4B n256 E128 K8: dO gathered, N = n = 256, BN 128),
up-1.4B (its up-proj: x gathered, N = 2n = 512), dA-7B (7B n256 E128 K8), up-E16K1 (wide E16 K1 n8192
d4096's up-proj: N = 16384), up-DSV3 (DeepSeek-V3.2's up-proj, BN 256; use --tile-keys).
Calibrate with --case dA-1.4B --orders default against ncu's dram__bytes_read.sum of that kernel:
818 MB on the H200, 849 MB on the H100 (bench/results/h200/dswiglu_prefetch_ab.md).
"""

import argparse
import collections
import heapq
import itertools
import random

CASES = {
    # name: (T, d, n, E, K, N of the GEMM, BN, stream bytes per row per N-column, extra compulsory read per row per N-column)
    "dA-1.4B": dict(T=40960, d=768, E=128, K=8, N=256, BN=128, stream_read=4, stream_write=6),
    "up-1.4B": dict(T=40960, d=768, E=128, K=8, N=512, BN=128, stream_read=0, stream_write=3),
    "dA-7B": dict(T=24576, d=1536, E=128, K=8, N=256, BN=128, stream_read=4, stream_write=6),
    "up-E16K1": dict(T=16384, d=4096, E=16, K=1, N=16384, BN=128, stream_read=0, stream_write=3),
    "up-DSV3": dict(T=32768, d=7168, E=256, K=8, N=4096, BN=256, stream_read=0, stream_write=3),
}


def make_case(shape, gemm, bn):
    """A case from `T,d,n,E,K` and the GEMM: up (x gathered, reduction d, N 2n), down (A' contiguous,
    reduction n, N d), dA (dO gathered, reduction d, N n, H read and A' / dH written), dX (dH
    contiguous, reduction 2n, N d). Streams as the named cases count them."""
    T, d, n, E, K = (int(v) for v in shape.split(","))
    g = {"up": dict(red=d, N=2 * n, gathered=True, stream_read=0, stream_write=3),
         "down": dict(red=n, N=d, gathered=False, stream_read=0, stream_write=2),
         "dA": dict(red=d, N=n, gathered=True, stream_read=4, stream_write=6),
         "dX": dict(red=2 * n, N=d, gathered=False, stream_read=0, stream_write=2)}[gemm]
    return dict(T=T, d=d, E=E, K=K, BN=bn, **g)


def route(T, E, K, rng):
    """Rows of each expert: its tokens in ascending order (K distinct experts per token, uniform)."""
    rows = [[] for _ in range(E)]
    experts = range(E)
    for t in range(T):
        for e in rng.sample(experts, K):
            rows[e].append(t)
    return rows


def tiles(rows, n_tiles, order, BM=128):
    """(expert, first row index inside the expert, N-tile) in the scheduler's order."""
    E = len(rows)
    units = [(len(r) + BM - 1) // BM for r in rows]
    if order == "default":
        for e in range(E):
            for u in range(units[e]):
                for nt in range(n_tiles):
                    yield e, u, nt
    elif order.startswith("band"):
        W = int(order[4:])
        for e in range(E):
            for n0 in range(0, n_tiles, W):
                for u in range(units[e]):
                    for nt in range(n0, min(n0 + W, n_tiles)):
                        yield e, u, nt
    elif order.startswith("block"):
        G = int(order[5:])
        for e0 in range(0, E, G):
            block = range(e0, min(e0 + G, E))
            for j in range(max(units[e] for e in block)):
                for e in block:
                    if j < units[e]:
                        for nt in range(n_tiles):
                            yield e, j, nt
    else:
        raise SystemExit(f"unknown order {order}")


def simulate(case, order, l2_bytes, stream, seed=0, BM=128, sms=132, BK=64, tile_keys=False, drift=0, partitions=1,
             peer_fill=False, jitter=0.0):
    """Reads by kind ({'x', 'w', 'stream'}: bytes) and the compulsory bytes. Tiles run in waves of
    `sms` (the persistent grid), a wave's tiles in step through the reduction: K-slice k of every
    tile of the wave (A rows, B columns) before slice k + 1, then the wave's epilogue streams.
    drift > 0: the wave's tiles are not in step: tile i starts o_i K-slices late (o_i uniform in
    [0, drift], seeded), so at step s it loads slice s - o_i; siblings that share an M-tile's rows or
    an N-tile's weights then touch them apart in time, as CTAs whose epilogues or waits differ do.
    partitions > 1: L2 as that many LRUs of l2_bytes / partitions, each serving the CTAs of its share
    of the SMs (CTA -> partition drawn at random, seeded, balanced); a line one partition misses is read
    from DRAM even when another holds it (the hypothesis that the H100's two L2 halves each fetch the
    lines their SMs read; not a documented fact); peer_fill: from another partition that holds it
    (no DRAM read), the copy still taking room in both.
    jitter > 0: no waves. Each CTA runs its own tiles (t = cta + i * sms) back to back, a tile's
    K-slices at a pace drawn per tile uniform in [1 - jitter, 1 + jitter] (seeded), and the loads of all
    CTAs interleave by time: CTAs drift apart as a persistent grid does, so the tiles in flight spread
    over more of the order than one wave (drift accumulates over a CTA's tiles)."""
    c = CASES[case] if isinstance(case, str) else case
    rng = random.Random(seed)
    rows = route(c["T"], c["E"], c["K"], rng)
    d, BN = c.get("red", c["d"]), c["BN"]  # d: the reduction's length
    gathered = c.get("gathered", True)
    n_tiles = (c["N"] + BN - 1) // BN
    k_slices = (d + BK - 1) // BK
    # Gathered rows keyed per token (a token's K experts share them) where K > 1; per tile otherwise
    # (and always for a contiguous A: the grouped rows are distinct).
    per_token = gathered and c["K"] > 1 and not tile_keys
    lrus = [collections.OrderedDict() for _ in range(partitions)]
    held = [0] * partitions
    cap = l2_bytes / partitions
    part_of = [i % partitions for i in range(sms)]
    random.Random(seed + 2).shuffle(part_of)
    reads = {"x": 0, "w": 0, "stream": 0}
    uniq = [0]

    def touch(key, size, kind, part=0):
        lru = lrus[part]
        if key in lru:
            lru.move_to_end(key)
            return
        if kind and not (peer_fill and any(key in other for other in lrus)):
            reads[kind] += size
        lru[key] = size
        held[part] += size
        while held[part] > cap:
            _, s = lru.popitem(last=False)
            held[part] -= s

    def load(i, e, u, nt, toks, k):
        bk = min(BK, d - k * BK)  # the last slice may be narrower
        part = part_of[i]
        if per_token:
            for t in toks:
                touch(("x", t, k), 2 * bk, "x", part)
        else:
            touch(("x", e, u, k), 2 * bk * len(toks), "x", part)
        touch(("w", e, nt, k), 2 * bk * BN, "w", part)

    def finish(i, toks):
        if c["stream_read"]:
            reads["stream"] += len(toks) * BN * c["stream_read"]
        per_row = BN * (c["stream_read"] + c["stream_write"])
        if stream and per_row:
            uniq[0] += 1
            touch(("s", uniq[0]), len(toks) * per_row, None, part_of[i])

    order_list = list(tiles(rows, n_tiles, order, BM))
    if jitter > 0:
        pace_rng = random.Random(seed + 3)
        own = [order_list[i::sms] for i in range(sms)]
        heap = []  # (time, CTA, its tile index, K-slice, pace)
        for i in range(min(sms, len(order_list))):
            heapq.heappush(heap, (0.0, i, 0, 0, pace_rng.uniform(1 - jitter, 1 + jitter)))
        while heap:
            t, i, j, k, pace = heapq.heappop(heap)
            e, u, nt = own[i][j]
            toks = rows[e][u * BM:(u + 1) * BM]
            load(i, e, u, nt, toks, k)
            if k + 1 < k_slices:
                heapq.heappush(heap, (t + pace, i, j, k + 1, pace))
                continue
            finish(i, toks)
            if j + 1 < len(own[i]):
                heapq.heappush(heap, (t + pace, i, j + 1, 0, pace_rng.uniform(1 - jitter, 1 + jitter)))
        order_list = []  # done: skip the waves below
    lag_rng = random.Random(seed + 1)
    for w0 in range(0, len(order_list), sms):
        wave = [(e, u, nt, rows[e][u * BM:(u + 1) * BM]) for e, u, nt in order_list[w0:w0 + sms]]
        lags = [lag_rng.randint(0, drift) if drift > 0 else 0 for _ in wave]
        for step in range(k_slices + max(lags)):
            for i, ((e, u, nt, toks), lag) in enumerate(zip(wave, lags)):
                k = step - lag
                if 0 <= k < k_slices:
                    load(i, e, u, nt, toks, k)
        for i, (e, u, nt, toks) in enumerate(wave):
            finish(i, toks)
    R = sum(len(r) for r in rows)
    compulsory = (c["T"] if gathered else R) * 2 * d + c["E"] * n_tiles * BN * d * 2 + R * BN * n_tiles * c["stream_read"]
    return reads, compulsory


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=sorted(CASES))
    p.add_argument("--shape", help="T,d,n,E,K (with --gemm) instead of --case")
    p.add_argument("--gemm", choices=("up", "down", "dA", "dX"), default="up")
    p.add_argument("--bn", type=int, default=128, help="N tile of --shape")
    p.add_argument("--orders", default="default")
    p.add_argument("--l2-mb", type=float, default=50)
    p.add_argument("--stream", type=int, default=1, choices=(0, 1))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sms", type=int, default=132, help="CTAs of the persistent grid (one wave)")
    p.add_argument("--drift", default="0",
                   help="comma list: each tile of a wave starts up to this many K-slices late (0: in step)")
    p.add_argument("--partitions", default="1",
                   help="comma list: L2 as this many independent LRUs, CTAs spread over them (see simulate)")
    p.add_argument("--jitter", default="0",
                   help="comma list: no waves, CTAs drift (each tile's pace uniform in [1-j, 1+j]; see simulate)")
    p.add_argument("--peer-fill", action="store_true",
                   help="with --partitions: a line another partition holds costs no DRAM read")
    p.add_argument("--tile-keys", action="store_true",
                   help="gathered rows keyed per tile, not per token (fast; ignores reuse across experts)")
    a = p.parse_args()
    if (a.case is None) == (a.shape is None):
        p.error("give --case or --shape")
    case = a.case or make_case(a.shape, a.gemm, a.bn)
    name = a.case or f"{a.gemm} {a.shape} BN{a.bn}"
    print(f"| case | order | drift | jitter | L2 MB | partitions | streams in L2 | source rows MB | weights MB | streamed reads MB | total reads MB | compulsory MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for order in a.orders.split(","):
        for drift, parts, jit in itertools.product([int(v) for v in a.drift.split(",")],
                                                   [int(v) for v in a.partitions.split(",")],
                                                   [float(v) for v in a.jitter.split(",")]):
            reads, comp = simulate(case, order, a.l2_mb * 1e6, a.stream, a.seed, sms=a.sms, tile_keys=a.tile_keys,
                                   drift=drift, partitions=parts, peer_fill=a.peer_fill, jitter=jit)
            tot = sum(reads.values())
            print(f"| {name} | {order} | {drift} | {jit:g} | {a.l2_mb:g} | {parts} | {a.stream} | {reads['x'] / 1e6:.0f} | "
                  f"{reads['w'] / 1e6:.0f} | {reads['stream'] / 1e6:.0f} | {tot / 1e6:.0f} | {comp / 1e6:.0f} |")


if __name__ == "__main__":
    main()
