"""The lane maps of the flash kernels' matrix-core fragments, without a GPU.

ops_cuda/cuda/flash/fragment_maps.h holds, as host-callable constexpr functions, every
lane -> (row, column) map the NVIDIA (mma.cuh: mma.sync m16n8k16, 32 lanes) and AMD
(mfma.cuh: MFMA 32x32x8, wave64) tensor-core layers index their fragments with. This test
compiles them into a host program (tests/flash_fragment_maps.cc) with the host C++ compiler,
and checks that

- each map is the instruction's documented layout (PTX ISA; AMD's CDNA ISA as its matrix
  instruction calculator states it, in the inverse direction) and covers its matrix once;
- the products the kernels issue, emulated lane by lane from those maps exactly as the
  device code gathers its operands (X Y^T from two tiles; P Z with P the previous product's
  fragments, packed), give X Y^T and P Z at the fragment coordinates the shared kernel text
  reads (FragmentCoords), on AMD as on NVIDIA;
- what the shared text assumes of a fragment holds for both: the lanes that share a row are
  those row_reduce visits, a row's elements are adjacent columns (store_rows), one lane per
  row holds column 0 (finish_rows), and each element gets the draw of its own Philox
  counter (eight keys of a row) from the lane exchanges of dropout_kept_pair and, in the
  backward's transposed fragments, dropout_kept_transposed.

So the index math that runs on AMD is exercised here, although it has never run on an AMD GPU.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from conftest import run_host_program

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests" / "flash_fragment_maps.cc"


@pytest.fixture(scope="module")
def maps(tmp_path_factory):
    """{(platform, kind): {key tuple: value tuple}} and {platform: constants} of the host program."""
    out = run_host_program(SOURCE, tmp_path_factory.mktemp("fragment_maps"),
                           [ROOT / "ops_cuda/include", ROOT / "ops_cuda/cuda/flash"])
    tables: dict = defaultdict(dict)
    consts = {}
    key_sizes = {"c": 2, "a": 3, "b": 3, "frag": 2, "item": 2}
    for line in out.splitlines():
        platform, kind, *values = line.split()
        values = tuple(int(v) for v in values)
        if kind == "const":
            consts[platform] = values
            continue
        if kind == "stride":  # kRowLaneStride
            consts[platform, kind] = values[0]
            continue
        size = key_sizes[kind] - (1 if platform == "amd" and kind in ("a", "b") else 0)
        tables[platform, kind][values[:size]] = values[size:]
    return tables, consts


def _nv(maps):
    tables, consts = maps
    lanes, warp_rows, lane_rows, low, high = consts["nv"]
    return tables, lanes, warp_rows, lane_rows, low, high


def _amd(maps):
    tables, consts = maps
    lanes, warp_rows, lane_rows, low, high, block, depth, items = consts["amd"]
    return tables, lanes, warp_rows, lane_rows, low, high, block, depth, items


def _covers_once(cells, shape):
    """Each cell of a matrix of `shape` appears exactly once in `cells`."""
    count = np.zeros(shape, int)
    for r, c in cells:
        count[r, c] += 1
    assert (count == 1).all(), f"cells covered {count.min()}..{count.max()} times, not once"


def test_nvidia_maps_are_the_ptx_layouts(maps):
    tables, lanes, warp_rows, *_ = _nv(maps)
    assert (lanes, warp_rows) == (32, 16)
    c, a, b = tables["nv", "c"], tables["nv", "a"], tables["nv", "b"]
    for lane in range(lanes):
        group, thread = lane // 4, lane % 4  # PTX: groupID, threadID_in_group
        for e in range(4):
            assert c[lane, e] == (group + 8 * (e >= 2), 2 * thread + e % 2)
        for reg in range(4):
            for h in range(2):
                assert a[lane, reg, h] == (group + 8 * (reg % 2), 2 * thread + h + 8 * (reg >= 2))
        for reg in range(2):
            for h in range(2):
                assert b[lane, reg, h] == (2 * thread + h + 8 * reg, group)
    _covers_once(c.values(), (16, 8))
    _covers_once(a.values(), (16, 16))
    _covers_once(b.values(), (16, 8))


def test_amd_maps_are_the_cdna_mfma_layouts(maps):
    tables, lanes, warp_rows, _, _, _, block, depth, items = _amd(maps)
    assert (lanes, warp_rows, block, depth, items) == (64, 32, 32, 8, 16)
    a, b, c = tables["amd", "a"], tables["amd", "b"], tables["amd", "c"]
    # The matrix instruction calculator's form: A[i][k] in lane i + 32 (k / 4), item k % 4;
    # B[k][j] in lane j + 32 (k / 4), item k % 4; D[i][j] in lane j + 32 ((i / 4) % 2),
    # item 4 (i / 8) + i % 4.
    for i in range(32):
        for k in range(8):
            assert a[i + 32 * (k // 4), k % 4] == (i, k)
            assert b[i + 32 * (k // 4), k % 4] == (k, i)
        for j in range(32):
            assert c[j + 32 * ((i // 4) % 2), 4 * (i // 8) + i % 4] == (i, j)
    _covers_once(a.values(), (32, 8))
    _covers_once([(k, j) for k, j in b.values()], (8, 32))
    _covers_once(c.values(), (32, 32))


def _emulate(lane_values, operand_map, shape):
    """The matrix that lanes' operand registers hold: operand_map[(lane, *index)] = (row, col)."""
    m = np.full(shape, np.nan)
    for key, (r, col) in operand_map.items():
        assert np.isnan(m[r, col]), f"({r}, {col}) held twice"
        m[r, col] = lane_values[key]
    assert not np.isnan(m).any(), "a cell no lane holds"
    return m


@pytest.fixture
def rng():
    return np.random.default_rng()


def _amd_product(maps, n_blocks, k_steps, operands):
    """acc [lanes, 4 n_blocks, 4] of one MFMA chain per 32-column block, as mfma.cuh issues it:
    operands(block, ks) gives the lanes' A and B elements {(lane, i): value}; item r of the
    block lands in tile item_tile(block, r), element item_element(r)."""
    tables, lanes, _, _, _, _, block_n, depth, items = _amd(maps)
    a, b, c, item = tables["amd", "a"], tables["amd", "b"], tables["amd", "c"], tables["amd", "item"]
    acc = np.zeros((lanes, 4 * n_blocks, 4))
    for blk in range(n_blocks):
        d = np.zeros((block_n, block_n))
        for ks in range(k_steps):
            a_regs, b_regs = operands(blk, ks)
            d += _emulate(a_regs, a, (block_n, depth)) @ _emulate(b_regs, b, (depth, block_n))
        for lane in range(lanes):
            for r in range(items):
                t, e = item[blk, r]
                acc[lane, t, e] += d[c[lane, r]]
    return acc


def _check_fragments(acc, want, coords):
    """acc[lane, t, e] == want[row, 8 t + col] for (row, col) = coords[lane, e]."""
    lanes, tiles, _ = acc.shape
    for lane in range(lanes):
        for t in range(tiles):
            for e in range(4):
                row, col = coords[lane, e]
                np.testing.assert_allclose(acc[lane, t, e], want[row, 8 * t + col], rtol=1e-12, atol=1e-12)


def test_amd_rows_times_rows_gives_x_y_transposed_at_the_fragment_coordinates(maps, rng):
    """warp_rows_times_rows of mfma.cuh: C = Y X^T per 32-column block, A from Y's rows, B from
    X's rows (four consecutive depths a lane: SwizzledTile::four)."""
    tables, lanes, warp_rows, _, _, _, block_n, depth, _ = _amd(maps)
    a, b = tables["amd", "a"], tables["amd", "b"]
    k_depth, cols, x_row0 = 64, 64, 32
    x = rng.standard_normal((x_row0 + warp_rows, k_depth))
    y = rng.standard_normal((cols, k_depth))

    def operands(blk, ks):
        k0 = ks * depth
        return ({(l, i): y[blk * block_n + a[l, 0][0], k0 + a[l, 0][1] + i] for l in range(lanes) for i in range(4)},
                {(l, i): x[x_row0 + b[l, 0][1], k0 + b[l, 0][0] + i] for l in range(lanes) for i in range(4)})

    acc = _amd_product(maps, cols // block_n, k_depth // depth, operands)
    _check_fragments(acc, x[x_row0:] @ y.T, tables["amd", "frag"])


def test_amd_regs_times_rows_gives_p_z_from_the_previous_fragments(maps, rng):
    """warp_regs_times_rows of mfma.cuh: C = Z^T P^T, A from Z's columns, B element i = the lane's
    fragment element i of tile ks."""
    tables, lanes, warp_rows, _, _, _, block_n, depth, _ = _amd(maps)
    a, frag = tables["amd", "a"], tables["amd", "frag"]
    k_depth, out, chunk0 = 32, 64, 8
    p_matrix = rng.standard_normal((warp_rows, k_depth))
    z = rng.standard_normal((k_depth, 8 * chunk0 + out))
    p = {(l, t, e): p_matrix[frag[l, e][0], 8 * t + frag[l, e][1]]
         for l in range(lanes) for t in range(k_depth // 8) for e in range(4)}

    def operands(blk, ks):
        k0 = ks * depth
        return ({(l, i): z[k0 + a[l, i][1], 8 * chunk0 + blk * block_n + a[l, i][0]]
                 for l in range(lanes) for i in range(4)},
                {(l, i): p[l, ks, i] for l in range(lanes) for i in range(4)})

    acc = _amd_product(maps, out // block_n, k_depth // depth, operands)
    _check_fragments(acc, p_matrix @ z[:, 8 * chunk0:], frag)


def test_nvidia_regs_times_rows_gives_p_z_from_the_previous_fragments(maps, rng):
    """warp_regs_times_rows of mma.cuh: A register r of step ks packs tile 2 ks + r / 2,
    elements 2 (r % 2), 2 (r % 2) + 1; B from Z as ldmatrix.trans delivers it."""
    tables, lanes, warp_rows, *_ = _nv(maps)
    a, b, c = tables["nv", "a"], tables["nv", "b"], tables["nv", "c"]
    k_depth, out = 32, 16
    p_matrix = rng.standard_normal((warp_rows, k_depth))
    z = rng.standard_normal((k_depth, out))
    p = {(l, t, e): p_matrix[c[l, e][0], 8 * t + c[l, e][1]]
         for l in range(lanes) for t in range(k_depth // 8) for e in range(4)}
    acc = np.zeros((lanes, out // 8, 4))
    for ks in range(k_depth // 16):
        a_regs = {(l, r, h): p[l, 2 * ks + r // 2, 2 * (r % 2) + h] for l in range(lanes) for r in range(4)
                  for h in range(2)}
        a_matrix = _emulate(a_regs, a, (16, 16))
        for n in range(out // 8):
            b_regs = {(l, r, h): z[16 * ks + b[l, r, h][0], 8 * n + b[l, r, h][1]] for l in range(lanes)
                      for r in range(2) for h in range(2)}
            d = a_matrix @ _emulate(b_regs, b, (16, 8))
            for l in range(lanes):
                for e in range(4):
                    acc[l, n, e] += d[c[l, e]]
    _check_fragments(acc, p_matrix @ z, c)


def _fragment(maps, platform):
    """lanes, lane rows, row lane masks and {(lane, e): (row, col)} of a tile of the shared text."""
    if platform == "nv":
        tables, lanes, _, lane_rows, low, high = _nv(maps)
        return lanes, lane_rows, low, high, tables["nv", "c"]
    tables, lanes, _, lane_rows, low, high, *_ = _amd(maps)
    return lanes, lane_rows, low, high, tables["amd", "frag"]


@pytest.mark.parametrize("platform", ["nv", "amd"])
def test_what_the_shared_text_assumes_of_a_fragment(maps, platform):
    lanes, lane_rows, low, high, frag = _fragment(maps, platform)
    row_elems = 4 // lane_rows
    warp_rows = {"nv": 16, "amd": 32}[platform]
    _covers_once(frag.values(), (warp_rows, 8))
    masks = [m for m in (1, 2, 4, 8, 16, 32) if low <= m <= high]
    for lane in range(lanes):
        # store_rows, softmax: element e is lane row e / kRowElems, adjacent ascending columns
        for e in range(4):
            assert frag[lane, e][0] == frag[lane, row_elems * (e // row_elems)][0]
            assert frag[lane, e][1] == frag[lane, row_elems * (e // row_elems)][1] + e % row_elems
        assert len({frag[lane, row_elems * r][0] for r in range(lane_rows)}) == lane_rows
        # row_reduce: the lanes holding the lane's first row are those its masks reach
        sharing = {other for other in range(lanes) if frag[other, 0][0] == frag[lane, 0][0]}
        reach = {lane}
        for m in masks:
            reach |= {x ^ m for x in reach}
        assert sharing == reach
    # finish_rows: one lane per row holds column 0 (FragmentCoords::first_of_row)
    firsts = [frag[lane, row_elems * r][0] for lane in range(lanes) for r in range(lane_rows)
              if frag[lane, 0][1] == 0]
    assert sorted(firsts) == list(range(warp_rows))


def test_dropout_pairs_reach_their_elements(maps):
    """dropout_kept_pair (params.cuh) on fragments whose rows are queries and columns keys,
    two tiles n, n + 1 at a time, emulated lane by lane: every element must get the counter of
    its own row and 8-key block (philox.h: eight 16-bit draws a counter) and the draw of its
    key's place in the block."""
    _, _, _, _, nv = _fragment(maps, "nv")
    for lane in range(32):
        q = lane % 4
        for t in range(2):
            for e in range(4):
                k = 2 * (e // 2) + t  # the counter of element e of tile n + t
                source = lane ^ (k ^ q)
                drawn_row = nv[source, 2 * (k // 2)][0]
                drawn_block = (nv[source, 0][1] + 8 * (k % 2)) // 8
                row, col = nv[lane, e][0], nv[lane, e][1] + 8 * t
                assert (drawn_row, drawn_block) == (row, col // 8)
                assert col % 8 == 2 * q + e % 2  # word q, half e % 2
    _, _, _, _, amd = _fragment(maps, "amd")
    for lane in range(64):
        half = lane // 32
        for t in range(2):
            for e in range(4):
                source = lane if t == half else lane ^ 32
                drawn_row = amd[source, 0][0]
                drawn_block = (amd[source, 0][1] + 8 * (source // 32)) // 8
                row, col = amd[lane, e][0], amd[lane, e][1] + 8 * t
                assert (drawn_row, drawn_block) == (row, col // 8)
                assert col % 8 == 2 * (2 * half + e // 2) + e % 2  # word 2 half + e / 2


def test_packed_dropout_flags_reach_their_elements(maps):
    """dropout_flags_pair and drop_packed (params.cuh, the sm90 forward) emulated bit by bit:
    lane q = l % 4 of a quad puts the flag of draw 2 w + half of its counter #q at bit
    16 half + 15 - w - 4 q, the quad ORs its lanes' words, and drop_packed shifts the word left
    by q + 4 k (k = 2 (j % 2) + j / 2: the counter of packed register j) and reads bits 15 and
    31 for the register's low and high element. Each (register, half) must read the flag of
    its own element: the counter of its row and 8-key block, the draw of its key's place."""
    _, _, _, _, nv = _fragment(maps, "nv")
    for lane in range(32):
        quad = [lane - lane % 4 + q for q in range(4)]
        # word: bit -> (source lane, draw slot) of the flag the quad's OR puts there
        word = {}
        for source in quad:
            q = source % 4
            for w in range(4):
                for half in range(2):
                    bit = 16 * half + 15 - w - 4 * q
                    assert 0 <= bit < 32 and bit not in word
                    word[bit] = (source, 2 * w + half)
        for j in range(4):
            t, elements = j // 2, (2 * (j % 2), 2 * (j % 2) + 1)  # pack order: tile n + j / 2
            k = 2 * (j % 2) + j // 2
            shift = lane % 4 + 4 * k
            for half, e in enumerate(elements):
                source, slot = word[15 + 16 * half - shift]
                sq = source % 4  # the counter that source draws: row 2 (sq / 2), tile n + sq % 2
                drawn_row = nv[source, 2 * (sq // 2)][0]
                drawn_block = (nv[source, 0][1] + 8 * (sq % 2)) // 8
                row, col = nv[lane, e][0], nv[lane, e][1] + 8 * t
                assert (drawn_row, drawn_block) == (row, col // 8)
                assert slot == col % 8


@pytest.mark.parametrize("platform", ["nv", "amd"])
def test_transposed_dropout_draws_reach_their_elements(maps, platform):
    """dropout_kept_transposed (params.cuh) on the backward's transposed fragments (rows: keys,
    columns: queries), two tiles at a time, emulated lane by lane: lane L of a group of eight
    (r = L // kRowLaneStride % 8) draws counter #r (element r % 4 of tile n + r // 4: its query
    and 8-key block); element e of tile n + t takes draw r of counter #(4 t + e), drawn by lane
    L ^ ((r ^ (4 t + e)) kRowLaneStride). Every element must get the counter of its own query
    and key block, and r must be its key's place in the block (tiles whose first row is a
    multiple of 8)."""
    lanes, _, _, _, frag = _fragment(maps, platform)
    stride = maps[1][platform, "stride"]
    for lane in range(lanes):
        r = lane // stride % 8
        for t in range(2):
            for e in range(4):
                counter = 4 * t + e
                source = lane ^ ((r ^ counter) * stride)
                assert source // stride % 8 == counter
                source_key, source_query = frag[source, counter % 4]
                source_query += 8 * (counter // 4)
                key, query = frag[lane, e]
                assert (source_query, source_key // 8) == (query + 8 * t, key // 8)
                assert key % 8 == r
