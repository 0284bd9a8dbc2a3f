"""Philox4x32-10 dropout: known-answer vectors and bit-identity across builds.

The compiled op set exposes two small FFI handlers for this (host build:
platform "cpu"; CUDA build: platform "CUDA"):

  fusedattn_philox(counters U32 [..., 4], keys U32 [..., 2]) -> U32 [..., 4]
  fusedattn_dropout_mask(seed U32 [..., 2]; dropout_rate f64) -> bool [..., h, sq, skv]

Both are compared with the jnp definition in fusedattn/ops/philox.py.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_host_program
from fusedattn.ops import _library, philox

# Random123's kat_vectors for philox4x32 with 10 rounds: (counter, key, expected).
KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]

RATES = [0.0, 0.1, 0.5, 1.0 - 2.0**-30]

# The jnp definition, compiled once per (rate, shape) instead of op by op.
_jnp_mask = jax.jit(philox.dropout_keep_mask, static_argnums=(1, 2))


def _on_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


def _needs(platform: str):
    reason = _library.available(platform)
    if reason is not None:
        pytest.skip(f"op library for {platform} unavailable: {reason}")


def _philox_call(counters: np.ndarray, keys: np.ndarray, device=None) -> np.ndarray:
    call = jax.ffi.ffi_call("fusedattn_philox",
                            jax.ShapeDtypeStruct(counters.shape, jnp.uint32),
                            vmap_method="broadcast_all")
    c, k = jnp.asarray(counters, jnp.uint32), jnp.asarray(keys, jnp.uint32)
    if device is not None:
        c, k = jax.device_put(c, device), jax.device_put(k, device)
    return np.asarray(jax.jit(call)(c, k))


def _mask_call(seed, rate: float, shape, device=None) -> np.ndarray:
    call = jax.ffi.ffi_call("fusedattn_dropout_mask", jax.ShapeDtypeStruct(shape, jnp.bool_),
                            vmap_method="broadcast_all")
    seed = jnp.asarray(seed, jnp.uint32)
    if device is not None:
        seed = jax.device_put(seed, device)
    return np.asarray(call(seed, dropout_rate=np.float64(rate)))


def _kat_arrays():
    counters = np.array([c for c, _, _ in KAT], np.uint32)
    keys = np.array([k for _, k, _ in KAT], np.uint32)
    expected = np.array([e for _, _, e in KAT], np.uint32)
    return counters, keys, expected


def test_jnp_philox_known_answers():
    for counter, key, expected in KAT:
        words = philox.philox4x32(counter, key)
        assert [int(w) for w in words] == list(expected)


def test_host_philox_known_answers():
    _needs("cpu")
    counters, keys, expected = _kat_arrays()
    np.testing.assert_array_equal(_philox_call(counters, keys, jax.devices("cpu")[0]), expected)


def test_host_philox_matches_jnp_on_random_words():
    _needs("cpu")
    rng = np.random.default_rng(7)
    counters = rng.integers(0, 2**32, (257, 4), dtype=np.uint64).astype(np.uint32)
    keys = rng.integers(0, 2**32, (257, 2), dtype=np.uint64).astype(np.uint32)
    got = _philox_call(counters, keys, jax.devices("cpu")[0])
    want = np.stack([np.asarray(w) for w in philox.philox4x32(
        tuple(counters.T), tuple(keys.T))], axis=-1)
    np.testing.assert_array_equal(got, want)


def test_kept_top_bits_match_draw_comparisons(tmp_path):
    """kept_top_bits (philox.h), the sm90 forward's compare of a word's two draws at once,
    equals draw16(word, half) >= threshold for every draw value in both halves, at thresholds
    around the top-bit boundary (0x7fff, 0x8000), the extremes and pseudo-random ones; so do
    kept_byte's gathered flags, and transpose_step transposes eight lanes' flag bytes."""
    root = Path(__file__).resolve().parents[1]
    out = run_host_program(root / "tests" / "philox_kept_bits.cc", tmp_path, [root / "ops_cuda/include"])
    lines = out.splitlines()
    checked, mismatches = map(int, lines[0].split())
    assert checked == 96 * 65536 * 2
    assert mismatches == 0
    # kept_byte and transpose_step (the sm90 backward's dropout flags): none differs.
    assert lines[1].split() == ["byte", str(20000 * 8), "0"], out
    assert lines[2].split() == ["transpose", "20000", "0"], out


def test_keep_threshold():
    assert philox.keep_threshold(0.0) == 0
    assert philox.keep_threshold(0.5) == 2**15
    assert philox.keep_threshold(0.1) == 6553
    assert philox.keep_threshold(1.0) == 2**16 - 1


def test_keep_mask_reads_sixteen_bit_draws():
    """Element (b, h, i, j) reads half j % 2 of word (j % 8) // 2 of counter (j // 8, i, h, b)."""
    seed = jnp.asarray([0x12345678, 0x9ABCDEF0], jnp.uint32)
    shape = (2, 2, 3, 20)
    for rate in (0.3, 0.7):
        got = np.asarray(_jnp_mask(seed, rate, shape))
        threshold = philox.keep_threshold(rate)
        for b, h, i, j in np.ndindex(*shape):
            words = philox.philox4x32((j // 8, i, h, b), (int(seed[0]), int(seed[1])))
            draw = (int(words[(j % 8) // 2]) >> (16 * (j % 2))) & 0xFFFF
            assert got[b, h, i, j] == (draw >= threshold), (b, h, i, j)


@pytest.mark.parametrize("rate", RATES)
@pytest.mark.parametrize("shape", [(2, 3, 5, 9), (1, 2, 3, 7), (3, 2, 4, 16)])
def test_host_dropout_mask_matches_jnp(rate, shape):
    _needs("cpu")
    seed = np.array([0x12345678, 0x9ABCDEF0], np.uint32)
    got = _mask_call(seed, rate, shape, jax.devices("cpu")[0])
    want = np.asarray(_jnp_mask(jnp.asarray(seed), rate, shape))
    np.testing.assert_array_equal(got, want)
    if rate == 0.0:
        assert got.all()


def test_host_dropout_mask_keep_rate():
    _needs("cpu")
    got = _mask_call(np.array([3, 4], np.uint32), 0.25, (4, 4, 32, 32), jax.devices("cpu")[0])
    assert abs(got.mean() - 0.75) < 0.01


def test_host_dropout_mask_vmapped_seeds_equal_loop():
    """vmap over seeds folds into the batch; each example draws its unbatched mask."""
    _needs("cpu")
    seeds = jnp.asarray(np.array([[1, 2], [3, 4], [1, 2]], np.uint32))
    shape = (2, 3, 4, 6)
    call = jax.ffi.ffi_call("fusedattn_dropout_mask", jax.ShapeDtypeStruct(shape, jnp.bool_),
                            vmap_method="broadcast_all")
    with jax.default_device(jax.devices("cpu")[0]):
        got = np.asarray(jax.vmap(lambda s: call(s, dropout_rate=np.float64(0.3)))(
            jax.device_put(seeds, jax.devices("cpu")[0])))
    for n in range(seeds.shape[0]):
        want = np.asarray(_jnp_mask(seeds[n], 0.3, shape))
        np.testing.assert_array_equal(got[n], want)
    np.testing.assert_array_equal(got[0], got[2])
    assert not np.array_equal(got[0], got[1])


def test_host_dropout_mask_rejects_bad_seed():
    _needs("cpu")
    call = jax.ffi.ffi_call("fusedattn_dropout_mask", jax.ShapeDtypeStruct((1, 1, 2, 2), jnp.bool_))
    cpu = jax.devices("cpu")[0]
    with pytest.raises(Exception, match="seed must have shape"):
        jax.block_until_ready(call(jax.device_put(jnp.zeros((3,), jnp.uint32), cpu),
                                   dropout_rate=np.float64(0.1)))
    with pytest.raises(Exception, match="dropout_rate must be in"):
        jax.block_until_ready(call(jax.device_put(jnp.zeros((2,), jnp.uint32), cpu),
                                   dropout_rate=np.float64(1.0)))


@pytest.mark.gpu
def test_cuda_philox_known_answers():
    if not _on_gpu():
        pytest.skip("needs a GPU")
    _needs("cuda")
    counters, keys, expected = _kat_arrays()
    np.testing.assert_array_equal(_philox_call(counters, keys, jax.devices()[0]), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("rate", RATES)
def test_cuda_dropout_mask_matches_host_and_jnp(rate):
    if not _on_gpu():
        pytest.skip("needs a GPU")
    _needs("cuda")
    shape = (3, 4, 33, 67)
    seed = np.array([0xDEADBEEF, 0x01234567], np.uint32)
    got = _mask_call(seed, rate, shape, jax.devices()[0])
    want = np.asarray(_jnp_mask(jnp.asarray(seed), rate, shape))
    np.testing.assert_array_equal(got, want)
    if _library.available("cpu") is None:
        np.testing.assert_array_equal(got, _mask_call(seed, rate, shape, jax.devices("cpu")[0]))
