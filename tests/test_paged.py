"""Paged KV cache layouts (fusedattn/ops/paged.py): the xla backend's paged path against a
float64 NumPy reference (tests/reference.py, one sequence at a time over its gathered
pages), the host build of the paged decode kernel ("decode" backend) against the xla
backend, the bounds guard, gradients, and the errors of every user mistake.

Inputs are random: page tables drawn with replacement from a pool larger than needed
(pages shared between sequences, unused entries -1 or garbage page numbers), key
lengths that are not multiples of the page size, and NaN in every pool page no
sequence uses for its first kv_len tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, make_config, poison_like, tolerance
from jax.extend.core import Literal
from reference import reference_attention

from fusedattn.ops import SequenceDescriptor, _library, explain, fused_attn

BSHD = "paged_kv_bshd_bshd_bshd"
THD = "paged_kv_thd_bshd_bshd"
# Under paged layouts every mask reads the key lengths; the reference sees exact arrays.
_DENSE_MASK = {"no_mask": "no_mask", "padding": "no_mask", "padding_causal": "causal",
               "causal_bottom_right": "causal_bottom_right",
               "padding_causal_bottom_right": "causal_bottom_right"}

needs_host = pytest.mark.skipif(_library.available("cpu") is not None,
                                reason=f"host op library unavailable: {_library.available('cpu')}")


@pytest.fixture(autouse=True)
def _on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


class Case:
    """A random paged call: pools, table, lengths, and the descriptor of its layout.

    BSHD: rows b with one sequence each. THD: rows b with m sequence slots each (one
    unused slot per row when m > 1), packed queries at random offsets.
    """

    def __init__(self, rng, layout=BSHD, b=3, m=1, sq=4, h=4, h_kv=2, d=16, dv=16,
                 page_size=5, pages=4, dtype=jnp.float32, max_queries=None):
        self.layout, self.b, self.m = layout, b, m
        thd = layout == THD
        s = b * m
        cap = pages * page_size
        q_len = rng.integers(1, (max_queries or (sq if not thd else 3)) + 1, size=s)
        kv_len = rng.integers(0, cap + 1, size=s)
        kv_len[rng.integers(s)] = cap - 2  # a length that is not a multiple of the page size
        q_start = np.zeros(s, np.int64)
        if thd:
            q_len[m - 1::m] = -1  # last slot of every row unused
            for r in range(b):
                start = 1  # token 0 of every row belongs to no sequence
                for j in range(m):
                    if q_len[r * m + j] > 0:
                        q_start[r * m + j] = start
                        start += q_len[r * m + j] + int(rng.integers(0, 2))
            assert start <= sq, "sq too small for the THD case"
        num_pages = s * pages + 3
        table = rng.integers(0, num_pages, size=(s, pages))
        for i in range(s):  # entries past a sequence's pages are never read
            used = -(-max(kv_len[i], 0) // page_size)
            table[i, used:] = rng.choice([-1, num_pages + 7], size=pages - used)
        self.q_len, self.kv_len, self.q_start = q_len, kv_len, q_start
        self.table = jnp.asarray(table, jnp.int32)
        self.q = jnp.asarray(rng.standard_normal((b, sq, h, d)), dtype)
        k = rng.standard_normal((num_pages, page_size, h_kv, d))
        v = rng.standard_normal((num_pages, page_size, h_kv, dv))
        read = np.zeros((num_pages, page_size), bool)
        for i in range(s):
            for j in range(max(kv_len[i], 0)):
                read[table[i, j // page_size], j % page_size] = True
        k[~read], v[~read] = np.nan, np.nan
        self.k, self.v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
        if thd:
            offsets = np.concatenate([q_start.reshape(b, m), np.full((b, 1), sq)], axis=1)
            self.sequence = SequenceDescriptor.from_seqlens_and_offsets(
                q_len.reshape(b, m), kv_len.reshape(b, m), offsets, np.zeros_like(offsets))
        else:
            self.sequence = SequenceDescriptor.from_seqlens(q_len, kv_len)

    def config(self, **overrides):
        overrides.setdefault("sequence", {})
        if self.layout == THD:
            overrides["sequence"].setdefault("max_segments_per_seq", self.m)
        return make_config(qkv_layout=self.layout, **overrides)

    def run(self, config, **kwargs):
        return fused_attn((self.q, self.k, self.v), config=config, sequence=self.sequence,
                          page_table=self.table, **kwargs)

    def reference(self, mask, window=(-1, -1), softmax="vanilla", offset=None):
        """float64 [b, sq, h, dv]: each sequence through tests/reference.py, zeros elsewhere."""
        q = np.asarray(self.q, np.float64)
        k, v = np.asarray(self.k, np.float64), np.asarray(self.v, np.float64)
        table = np.asarray(self.table)
        page_size = k.shape[1]
        out = np.zeros((*q.shape[:3], v.shape[3]))
        config = dict(qkv_layout="bshd_bshd_bshd", mask=_DENSE_MASK[mask], window_size=window,
                      softmax=softmax)
        for s in range(self.b * self.m):
            q_len, kv_len, start = self.q_len[s], self.kv_len[s], self.q_start[s]
            if q_len <= 0 or kv_len <= 0:
                continue
            rows = [table[s, j // page_size] for j in range(kv_len)]
            cols = [j % page_size for j in range(kv_len)]
            r = s // self.m
            result = reference_attention(
                (q[r:r + 1, start:start + q_len], k[rows, cols][None], v[rows, cols][None]),
                config, softmax_offset=offset)
            out[r, start:start + q_len] = result.out[0]
        return out


MASKS = ("no_mask", "padding", "padding_causal", "causal_bottom_right",
         "padding_causal_bottom_right")


@pytest.mark.parametrize("layout", [BSHD, THD])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("window", [(-1, -1), (3, 0)])
def test_xla_matches_float64_reference(rng, layout, mask, window):
    case = (Case(rng, layout, b=2, m=3, sq=12) if layout == THD else Case(rng, layout, sq=5))
    out = case.run(case.config(backend="xla", mask=mask, window_size=window))
    expected = case.reference(mask, window)
    assert_close(out, expected, tolerance(jnp.float32), "out")


@pytest.mark.parametrize("softmax", ["off_by_one", "learnable"])
def test_xla_softmax_variants(rng, softmax):
    case = Case(rng, sq=3)
    offset = jnp.asarray(rng.standard_normal(4), jnp.float32)
    config = case.config(backend="xla", mask="padding_causal_bottom_right", softmax=softmax)
    out = case.run(config, softmax_offset=offset if softmax == "learnable" else None)
    expected = case.reference("padding_causal_bottom_right", softmax=softmax,
                              offset=np.asarray(offset) if softmax == "learnable" else None)
    assert_close(out, expected, tolerance(jnp.float32), "out")


@needs_host
@pytest.mark.parametrize("layout", [BSHD, THD])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("window", [(-1, -1), (2, 1)])
def test_decode_matches_xla(rng, layout, mask, window):
    case = (Case(rng, layout, b=2, m=3, sq=12) if layout == THD else Case(rng, layout, sq=4))
    bound = {"max_seqlen_q": 3} if layout == THD else {}
    expected = case.run(case.config(backend="xla", mask=mask, window_size=window,
                                    sequence=dict(bound)))
    config = case.config(backend="decode", mask=mask, window_size=window, sequence=dict(bound))
    poison_like(expected)
    out = case.run(config)
    assert_close(out, expected, tolerance(jnp.float32), "out")


@needs_host
@pytest.mark.parametrize("sq", [1, 3, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("heads", [(8, 2), (6, 1)])
def test_decode_query_counts_dtypes_gqa(rng, sq, dtype, heads):
    h, h_kv = heads
    case = Case(rng, b=4, sq=sq, h=h, h_kv=h_kv, d=32, dv=24, page_size=16, pages=3,
                dtype=dtype)
    mask = "padding_causal_bottom_right"
    expected = case.run(case.config(backend="xla", mask=mask))
    poison_like(expected)
    out = jax.jit(lambda: case.run(case.config(backend="decode", mask=mask)))()
    assert out.dtype == dtype
    assert_close(out, expected, tolerance(dtype), "out")


@needs_host
@pytest.mark.parametrize("softmax", ["off_by_one", "learnable"])
def test_decode_softmax_variants(rng, softmax):
    case = Case(rng, sq=2)
    offset = jnp.asarray(rng.standard_normal(4), jnp.float32) if softmax == "learnable" else None
    outs = [case.run(case.config(backend=name, mask="padding_causal_bottom_right",
                                 softmax=softmax), softmax_offset=offset)
            for name in ("xla", "decode")]
    assert_close(outs[1], outs[0], tolerance(jnp.float32), "out")


def test_auto_picks_decode_for_decoding_and_xla_for_prefill(rng):
    case = Case(rng, sq=4)
    mask = "padding_causal_bottom_right"
    chosen = explain((case.q, case.k, case.v), config=case.config(mask=mask),
                     sequence=case.sequence, page_table=case.table, platform="cpu")
    assert chosen.backend == ("decode" if _library.available("cpu") is None else "xla")
    for name in ("small_seq", "cudnn", "flash"):
        assert "no paged KV cache path" in chosen.verdicts[name]
    prefill = Case(rng, sq=9, max_queries=9)
    chosen = explain((prefill.q, prefill.k, prefill.v), config=prefill.config(mask=mask),
                     sequence=prefill.sequence, page_table=prefill.table, platform="cpu")
    assert chosen.backend == "xla"
    assert "at most 8 query tokens" in chosen.verdicts["decode"]
    assert "max_seqlen_q" in chosen.verdicts["decode"]
    on_gpu = explain((case.q, case.k, case.v), config=case.config(mask=mask),
                     sequence=case.sequence, page_table=case.table, platform="cuda")
    missing = _library.available("cuda")
    if missing is not None:
        assert on_gpu.verdicts["decode"] == f"decode: {missing}"
    else:  # the case is float32, which the CUDA kernel does not take
        assert "takes bfloat16 or float16" in on_gpu.verdicts["decode"]
    on_rocm = explain((case.q, case.k, case.v), config=case.config(mask=mask),
                      sequence=case.sequence, page_table=case.table, platform="rocm")
    assert "exists for cpu (host build) and CUDA GPUs" in on_rocm.verdicts["decode"]


@needs_host
@pytest.mark.parametrize("softmax", ["vanilla", "off_by_one", "learnable"])
def test_unchecked_decode_call_is_the_kernel_alone(rng, softmax):
    """Jitted and unchecked, a BSHD decode call lowers to its custom call and nothing else:
    the lengths and the table go in as the caller passed them (the kernel finds the broken
    sequences itself), zero q_start and offsets as empty operands, not device fills
    (paged_decode_ffi.h)."""
    case = Case(rng, b=2, sq=1, h=4, h_kv=2, page_size=4, pages=3)
    config = case.config(backend="decode", mask="padding_causal_bottom_right", softmax=softmax,
                         sequence={"check_bounds": False})
    offset = jnp.asarray(rng.standard_normal(4), jnp.float32) if softmax == "learnable" else None

    def attend(q_len, kv_len, table):
        return fused_attn((case.q, case.k, case.v), config=config, page_table=table,
                          sequence=SequenceDescriptor.from_seqlens(q_len, kv_len),
                          softmax_offset=offset)

    args = (jnp.asarray(case.q_len, jnp.int32), jnp.asarray(case.kv_len, jnp.int32), case.table)
    jaxpr = jax.make_jaxpr(attend)(*args).jaxpr
    inputs = set(jaxpr.invars)
    readers = [e for e in jaxpr.eqns
               if any(v in inputs for v in e.invars if not isinstance(v, Literal))]
    assert [e.primitive.name for e in readers] == ["custom_vjp_call"], jaxpr
    inner = readers[0].params["call_jaxpr"].jaxpr
    assert [e.primitive.name for e in inner.eqns] == ["ffi_call"], inner
    hlo = jax.jit(attend).lower(*args).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):].splitlines()[1:-1]
    ops = [line.split(" = ", 1)[1].split("(", 1)[0].split()[-1] for line in entry if " = " in line]
    assert sorted(set(ops)) == ["constant", "custom-call", "parameter"], entry
    assert ops.count("custom-call") == 1, entry
    call = next(line for line in entry if "custom-call(" in line)
    assert "%q_len" in call and "%kv_len" in call and "%table" in call, call
    assert "s32[0]{0} constant({})" in "\n".join(entry)
    expected = case.reference("padding_causal_bottom_right", softmax=softmax,
                              offset=None if offset is None else np.asarray(offset))
    assert_close(jax.jit(attend)(*args), expected, tolerance(jnp.float32), "out")


def test_decode_refuses_contiguous_layouts(rng):
    q = jnp.asarray(rng.standard_normal((1, 2, 2, 8)), jnp.float32)
    verdicts = explain((q, q, q), config=make_config(), platform="cpu").verdicts
    assert "paged layouts only" in verdicts["decode"]
    with pytest.raises(ValueError, match="paged layouts only"):
        fused_attn((q, q, q), config=make_config(backend="decode"))


@pytest.mark.parametrize("backend", ["xla", pytest.param("decode", marks=needs_host)])
def test_thd_bound_declared_and_broken(rng, backend):
    """THD queries on decode need a declared per-sequence bound; data above it is refused."""
    case = Case(rng, THD, b=1, m=3, sq=10, max_queries=3)
    if backend == "decode":
        verdicts = explain((case.q, case.k, case.v), config=case.config(mask="padding"),
                           sequence=case.sequence, page_table=case.table,
                           platform="cpu").verdicts
        assert "declare config.sequence.max_seqlen_q <= 8" in verdicts["decode"]
    config = case.config(backend=backend, mask="padding", sequence={"max_seqlen_q": 1})
    if (case.q_len > 1).any():
        with pytest.raises(ValueError, match="max_seqlen_q=1"):
            case.run(config)


def _broken_cases(case):
    """(name, q_len, kv_len, table) variants each breaking sequence 1 only."""
    cap = case.table.shape[1] * case.k.shape[1]
    kv_len = case.kv_len.copy()
    kv_len[1] = cap + 1
    table = np.asarray(case.table).copy()
    table[1, 0] = case.k.shape[0]  # a page past the pool, among the used pages
    kv_table = case.kv_len.copy()
    kv_table[1] = max(kv_table[1], 1)
    return [("too many keys", case.q_len, kv_len, case.table),
            ("page out of range", case.q_len, kv_table, jnp.asarray(table))]


@pytest.mark.parametrize("check_bounds", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("backend", ["xla", pytest.param("decode", marks=needs_host)])
def test_broken_sequences_raise_eagerly_and_are_nan_under_jit(rng, backend, check_bounds):
    """Unchecked (no guard under jit), the decode backend leaves finding the broken
    sequences to its kernel; the NaN marks must be the same."""
    case = Case(rng, sq=3)
    config = case.config(backend=backend, mask="padding_causal_bottom_right",
                         sequence={"check_bounds": check_bounds})
    for name, q_len, kv_len, table in _broken_cases(case):
        sequence = SequenceDescriptor.from_seqlens(q_len, kv_len)
        with pytest.raises(ValueError, match="breaks the call's bounds"):
            fused_attn((case.q, case.k, case.v), config=config, sequence=sequence,
                       page_table=table)
        out = np.asarray(jax.jit(lambda s, t: fused_attn(
            (case.q, case.k, case.v), config=config, sequence=s, page_table=t))(sequence, table))
        assert np.isnan(out[1, :q_len[1]]).all(), name
        assert (out[1, q_len[1]:] == 0).all(), name
        good = SequenceDescriptor.from_seqlens(case.q_len[[0, 2]], case.kv_len[[0, 2]])
        rows = np.array([0, 2])
        expected = fused_attn((case.q[rows], case.k, case.v), config=config, sequence=good,
                              page_table=case.table[rows])
        assert_close(out[rows], expected, tolerance(jnp.float32), name)


class BoundVariant(NamedTuple):
    """A call's data with one sequence's bound broken (or none): the lengths [S], q_start [S]
    (THD), the table, config.sequence bounds, and nan, bool [b, sq]: its NaN query rows."""

    name: str
    q_len: np.ndarray
    kv_len: np.ndarray
    q_start: np.ndarray
    table: np.ndarray
    bounds: dict
    nan: np.ndarray


def _bound_variants(case: Case) -> list[BoundVariant]:
    """Every way a used sequence breaks the call's bounds, each applied to sequence 1 alone
    (BSHD: row 1; THD: row 0's second slot), and two changes that break nothing: a
    negative key length (0 keys) and an unused slot with lengths past every bound.

    Every sequence keeps fewer than cap - 1 keys (cap: a table row's), so that a declared
    max_seqlen_kv of cap - 2 breaks sequence 1 alone; BSHD cases need max_queries=2 < sq
    (likewise for max_seqlen_q=2), THD ones m >= 3 (slot 1 used) and sq >= 8.
    """
    cap = case.table.shape[1] * case.k.shape[1]
    num_pages = case.k.shape[0]
    b, sq = case.q.shape[:2]
    row, bounds = (0, {"max_seqlen_q": 3}) if case.layout == THD else (1, {})
    kv_lens = np.minimum(case.kv_len, cap - 2)

    def variant(name, broken=True, q_len=None, kv_len=None, q_start=None, page=None,
                **declared):
        q_lens, q_starts, kv = case.q_len.copy(), case.q_start.copy(), kv_lens.copy()
        table = np.array(case.table)
        table[1] = np.arange(table.shape[1]) % num_pages  # pages inside the pool: one bound broken
        for array, value in ((q_lens, q_len), (kv, kv_len), (q_starts, q_start)):
            if value is not None:
                array[1] = value
        if page is not None:
            table[1, 0] = page  # among the pages sequence 1 uses (kv_len >= 1)
        nan = np.zeros((b, sq), bool)
        if broken:  # its rows that lie in its q row
            nan[row, max(q_starts[1], 0):max(min(q_starts[1] + q_lens[1], sq), 0)] = True
        return BoundVariant(name, q_lens, kv, q_starts, table, {**bounds, **declared}, nan)

    some_keys = max(kv_lens[1], 1)
    variants = [
        variant("more keys than its pages hold", kv_len=cap + 1),
        variant("more keys than max_seqlen_kv", kv_len=cap - 1, max_seqlen_kv=cap - 2),
        variant("a page past the pool", kv_len=some_keys, page=num_pages),
        variant("a negative page number", kv_len=some_keys, page=-3),
        variant("a negative key count (no keys)", broken=False, kv_len=-3),
    ]
    if case.layout == THD:
        return variants + [
            variant("queries before its q row", q_start=-1, q_len=2),
            variant("queries past its q row", q_start=sq - 1, q_len=2),
            variant("an unused slot with lengths past every bound", broken=False, q_len=0,
                    kv_len=cap + 5, q_start=sq + 3, page=num_pages),
        ]
    return variants + [
        variant("more queries than max_seqlen_q", q_len=3, max_seqlen_q=2),
        variant("more queries than its q row holds", q_len=sq + 1),
        variant("an unused sequence with lengths past every bound", broken=False, q_len=0,
                kv_len=cap + 5, page=num_pages),
    ]


def _run_traced(case: Case, qkv: tuple, config, v: BoundVariant) -> np.ndarray:
    """The call of v's data on qkv under jit, every length, offset and the table traced."""
    if case.layout == THD:
        b, m, sq = case.b, case.m, case.q.shape[1]
        offsets = np.concatenate([v.q_start.reshape(b, m), np.full((b, 1), sq)], axis=1)

        def call(q_len, kv_len, q_offsets, table):
            sequence = SequenceDescriptor.from_seqlens_and_offsets(
                q_len, kv_len, q_offsets, jnp.zeros_like(q_offsets))
            return fused_attn(qkv, config=config, sequence=sequence, page_table=table)

        args = (v.q_len.reshape(b, m), v.kv_len.reshape(b, m), offsets, v.table)
    else:
        def call(q_len, kv_len, table):
            return fused_attn(qkv, config=config, page_table=table,
                              sequence=SequenceDescriptor.from_seqlens(q_len, kv_len))

        args = (v.q_len, v.kv_len, v.table)
    return np.asarray(jax.jit(call)(*(jnp.asarray(x, jnp.int32) for x in args)), np.float32)


def check_bound_variants(case: Case, check_bounds: bool) -> None:
    """Each of _bound_variants through the decode backend under jit: NaN on exactly the
    broken sequence's query rows (every head and dim), the xla backend's outputs elsewhere.
    The pools' unread entries are zeros, not the Case's NaN: a key read past a bound must
    not pass for the NaN mark."""
    qkv = (case.q, jnp.nan_to_num(case.k), jnp.nan_to_num(case.v))
    for v in _bound_variants(case):
        outs = {}
        for backend in ("xla", "decode"):
            config = case.config(backend=backend, mask="padding_causal_bottom_right",
                                 sequence={"check_bounds": check_bounds, **v.bounds})
            out = _run_traced(case, qkv, config, v)
            nan = np.isnan(out)
            assert (nan.all(axis=(2, 3)) == v.nan).all(), (backend, v.name)
            assert not nan[~v.nan].any(), (backend, v.name)
            outs[backend] = np.where(nan, 0.0, out)
        assert_close(outs["decode"], outs["xla"], tolerance(case.q.dtype), v.name)


@needs_host
@pytest.mark.parametrize("check_bounds", [False, True], ids=["unchecked", "checked"])
@pytest.mark.parametrize("layout", [BSHD, THD])
def test_decode_kernel_finds_each_broken_sequence(rng, layout, check_bounds):
    """Traced, the host kernel decides which sequences are broken from the lengths as given
    (unchecked, nothing computes the marks before it): every bound of paged.py's
    broken_sequences, one at a time."""
    if layout == THD:
        case = Case(rng, THD, b=2, m=3, sq=12)
    else:
        case = Case(rng, b=3, sq=4, max_queries=2)
    check_bound_variants(case, check_bounds)


@pytest.mark.parametrize("backend", ["xla", pytest.param("decode", marks=needs_host)])
def test_page_check_before_the_kernel_only_where_read(rng, backend):
    """The [S, pages] page check runs before a decode kernel only while a guard reads it
    (check_bounds on); the xla backend always needs it (its NaN marks come from it)."""
    case = Case(rng, sq=2)
    page_check = f"bool[{case.table.shape[0]},{case.table.shape[1]}]"

    def page_checks(check_bounds):
        config = case.config(backend=backend, mask="padding_causal_bottom_right",
                             sequence={"check_bounds": check_bounds})
        jaxpr = jax.make_jaxpr(lambda t: fused_attn((case.q, case.k, case.v), config=config,
                                                    sequence=case.sequence, page_table=t))
        return str(jaxpr(case.table)).count(page_check)

    assert page_checks(True) >= 1
    assert (page_checks(False) == 0) == (backend == "decode")


def test_xla_gradients_equal_contiguous_attention_over_gathered_pages(rng):
    """The paged path's VJP (q and both pools; shared pages sum) is that of the gathered call."""
    case = Case(rng, sq=3, page_size=4, pages=3)
    table = np.array(case.table)
    table[[0, 2], :2] = rng.integers(0, case.k.shape[0], size=2)  # 0 and 2 share two pages
    num_pages = case.k.shape[0]
    k = jnp.nan_to_num(case.k)
    v = jnp.nan_to_num(case.v)
    sequence = SequenceDescriptor.from_seqlens(case.q_len, case.kv_len)
    clipped = jnp.asarray(np.clip(table, 0, num_pages - 1))
    mask = "padding_causal_bottom_right"
    paged_config = case.config(backend="xla", mask=mask)
    dense_config = make_config(backend="xla", mask=mask)

    def paged(q, k, v):
        return fused_attn((q, k, v), config=paged_config, sequence=sequence,
                          page_table=jnp.asarray(table))

    def dense(q, k, v):
        gather = lambda pool: pool[clipped].reshape(case.b, -1, *pool.shape[2:])  # noqa: E731
        return fused_attn((q, gather(k), gather(v)), config=dense_config, sequence=sequence)

    cotangent = jnp.asarray(rng.standard_normal(case.q.shape[:3] + (case.v.shape[3],)),
                            jnp.float32)
    out_p, vjp_p = jax.vjp(paged, case.q, k, v)
    out_d, vjp_d = jax.vjp(dense, case.q, k, v)
    assert_close(out_p, out_d, tolerance(jnp.float32), "out")
    for name, got, want in zip(("dq", "dk", "dv"), vjp_p(cotangent), vjp_d(cotangent)):
        assert_close(got, want, tolerance(jnp.float32), name)
    assert float(jnp.abs(vjp_p(cotangent)[1]).max()) > 0


@needs_host
def test_decode_backward_raises_naming_xla(rng):
    case = Case(rng, sq=1)
    config = case.config(backend="decode", mask="padding")

    def loss(q):
        return fused_attn((q, case.k, case.v), config=config, sequence=case.sequence,
                          page_table=case.table).sum()

    with pytest.raises(ValueError, match="forward only.*backend='xla'"):
        jax.grad(loss)(case.q)


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("change,error,pattern", [
    ("no_table", ValueError, r"page_table: layout 'paged_kv_bshd_bshd_bshd' reads k and v"),
    ("float_table", TypeError, r"page_table: expected an int32 array"),
    ("table_rows", ValueError, r"page_table: expected shape \[b = 3, max_pages_per_seq"),
    ("no_sequence", ValueError, r"sequence: layout .*SequenceDescriptor.from_seqlens"),
    ("segment_ids", ValueError, r"needs the descriptor's 'seqlens' form"),
    ("two_arrays", ValueError, r"qkv: layout 'paged_kv_bshd_bshd_bshd' takes 3 arrays"),
    ("rank3_pool", ValueError, r"qkv: k must have shape \[num_pages, page_size, h_kv, d\]"),
    ("pool_mismatch", ValueError, r"must agree on \[num_pages, page_size, h_kv\]"),
    ("head_dim", ValueError, r"q head dim 16 differs from the k pool's 8"),
    ("gqa", ValueError, r"multiple of the k/v head count"),
    ("dtype", TypeError, r"must share one dtype"),
    ("bias", ValueError, r"bias: paged layouts take no bias"),
    ("dropout", ValueError, r"config.dropout_rate: paged layouts serve inference"),
])
def test_errors(rng, change, error, pattern):
    case = Case(rng, sq=2)
    q, k, v = case.q, case.k, case.v
    config = case.config(backend="xla", mask="padding")
    call = dict(config=config, sequence=case.sequence, page_table=case.table)
    qkv = (q, k, v)
    if change == "no_table":
        call["page_table"] = None
    elif change == "float_table":
        call["page_table"] = case.table.astype(jnp.float32)
    elif change == "table_rows":
        call["page_table"] = case.table[:2]
    elif change == "no_sequence":
        call["sequence"] = None
    elif change == "segment_ids":
        ids = jnp.ones(q.shape[:2], jnp.int32)
        call["sequence"] = SequenceDescriptor.from_segment_ids_and_pos(ids, ids)
    elif change == "two_arrays":
        qkv = (q, k)
    elif change == "rank3_pool":
        qkv = (q, k[0], v)
    elif change == "pool_mismatch":
        qkv = (q, k, v[:-1])
    elif change == "head_dim":
        qkv = (q, k[..., :8], v)
    elif change == "gqa":
        qkv = (q[:, :, :3], k, v)
    elif change == "dtype":
        qkv = (q, k.astype(jnp.bfloat16), v)
    elif change == "bias":
        config.bias = "post_scale_bias"
        call["bias"] = jnp.zeros((1, 1, 2, 20))
    elif change == "dropout":
        config.dropout_rate = 0.1
        call.update(is_training=True, dropout_rng=jax.random.key(0))
    with pytest.raises(error, match=pattern):
        fused_attn(qkv, **call)


def test_page_table_with_contiguous_layout_raises(rng):
    q = jnp.asarray(rng.standard_normal((1, 2, 2, 8)), jnp.float32)
    with pytest.raises(ValueError, match="page_table: only the paged layouts"):
        fused_attn((q, q, q), config=make_config(backend="xla"),
                   page_table=jnp.zeros((1, 1), jnp.int32))


def test_thd_table_rows_are_sequence_slots(rng):
    case = Case(rng, THD, b=2, m=3, sq=12)
    with pytest.raises(ValueError, match=r"page_table: expected shape \[b \* m = 2 \* 3"):
        fused_attn((case.q, case.k, case.v), config=case.config(backend="xla", mask="padding"),
                   sequence=case.sequence, page_table=case.table[:2])
