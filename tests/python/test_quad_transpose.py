"""Model of quad_transpose (src/engine/epilogue/common.cuh) and of the two ways the dSwiGLU epilogue uses it:
the accumulator layout (lane q of a quad holds columns 2q, 2q+1 of every 8-column group j) against
the 16-byte layout (lane q holds all 8 columns of group 4b+q)."""


def quad_transpose(lanes):
    """lanes[q] = the 4 words w[0..3] of lane q; the two xor-butterfly stages as written in CUDA."""
    w = [list(x) for x in lanes]
    for bit, pairs in ((1, ((0, 1), (2, 3))), (2, ((0, 2), (1, 3)))):
        for lo, hi in pairs:
            send = [w[q][lo] if (q & bit) else w[q][hi] for q in range(4)]
            recv = [send[q ^ bit] for q in range(4)]
            for q in range(4):
                if q & bit:
                    w[q][lo] = recv[q]
                else:
                    w[q][hi] = recv[q]
    return w


def test_transpose_swaps_lane_and_word():
    m = [[(q, k) for k in range(4)] for q in range(4)]
    out = quad_transpose(m)
    assert all(out[q][k] == (k, q) for q in range(4) for k in range(4))


def test_accumulator_to_16_byte_layout():
    # apply_row_halves: lo[k] = dA' of (group 4b + k, column 2q) on lane q; after the transpose
    # lane q must hold (group 4b + q, column 2k), the word k of its 16-byte H load.
    b = 3
    lo = [[(4 * b + k, 2 * q) for k in range(4)] for q in range(4)]
    hi = [[(4 * b + k, 2 * q + 1) for k in range(4)] for q in range(4)]
    tlo, thi = quad_transpose(lo), quad_transpose(hi)
    for q in range(4):
        for k in range(4):
            assert tlo[q][k] == (4 * b + q, 2 * k)
            assert thi[q][k] == (4 * b + q, 2 * k + 1)


def test_16_byte_layout_to_accumulator():
    # The inverse (store_row_16B, and the older halves H path): lane q loads group 4b + q's words
    # k = columns (2k, 2k+1); after the transpose lane q holds columns 2q, 2q+1 of group 4b + k.
    b = 1
    loaded = [[(4 * b + q, 2 * k) for k in range(4)] for q in range(4)]
    out = quad_transpose(loaded)
    assert all(out[q][k] == (4 * b + k, 2 * q) for q in range(4) for k in range(4))
