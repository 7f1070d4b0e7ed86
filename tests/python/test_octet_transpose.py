"""Model of octet_transpose_bf16 and EpiStoreT's 16-byte transposed stores (src/engine/epilogue.cuh):
the three butterfly stages on one warp, with __byte_perm and __shfl_xor_sync written out, then a check
that every lane holds column n, rows 8h..8h+7 in order, and that the warp's 32 chunks are distinct."""


def bp(x, y, s):  # __byte_perm
    b = [(x >> (8*i)) & 255 for i in range(4)] + [(y >> (8*i)) & 255 for i in range(4)]
    return sum(b[(s >> (4*i)) & 7] << (8*i) for i in range(4))


def pack(lo, hi):
    return lo | (hi << 16)


def shfl(vals, mask):
    return [vals[L ^ mask] for L in range(32)]


def test_octet_transpose_lane_layout():
    # Simulates octet_transpose_bf16 + EpiStoreT's chunk addressing on one warp (J = 0).
    lanes = []
    for L in range(32):
        a, c = L >> 2, L & 3
        e = []
        for k in range(8):
            jj, h, q = k >> 2, (k >> 1) & 1, k & 1
            m, n = a + 8*h, 8*jj + 2*c + q
            e.append(m * 16 + n + 1)  # tag (m, n), 16-bit
        lanes.append([pack(e[2*i], e[2*i+1]) for i in range(4)])
    # stage 0
    for i in (0, 2):
        send = [bp(w[i], w[i+1], 0x5410) if ((L >> 2) & 1) else bp(w[i], w[i+1], 0x7632) for L, w in enumerate(lanes)]
        recv = shfl(send, 4)
        for L, w in enumerate(lanes):
            r = recv[L]
            if (L >> 2) & 1:
                w[i], w[i+1] = bp(r, w[i], 0x7610), bp(r, w[i+1], 0x7632)
            else:
                w[i], w[i+1] = bp(w[i], r, 0x5410), bp(w[i+1], r, 0x7610)
    # stage 1
    for i in (0, 2):
        send = [w[i] if ((L >> 2) & 2) else w[i+1] for L, w in enumerate(lanes)]
        recv = shfl(send, 8)
        for L, w in enumerate(lanes):
            if (L >> 2) & 2: w[i] = recv[L]
            else: w[i+1] = recv[L]
    # stage 2
    for i in (0, 1):
        send = [w[i] if ((L >> 2) & 4) else w[i+2] for L, w in enumerate(lanes)]
        recv = shfl(send, 16)
        for L, w in enumerate(lanes):
            if (L >> 2) & 4: w[i] = recv[L]
            else: w[i+2] = recv[L]
    seen = set()
    for L, w in enumerate(lanes):
        a, c = L >> 2, L & 3
        q, h, jj = a & 1, (a >> 1) & 1, a >> 2
        n = 8*jj + 2*c + q
        vals = []
        for x in w: vals += [x & 0xffff, x >> 16]
        want = [(8*h + t) * 16 + n + 1 for t in range(8)]
        assert vals == want, (L, vals, want)
        seen.add((n, h))
    assert len(seen) == 32
