"""Counter-based dropout: Philox4x32-10 in jax.numpy, bit-identical to the kernels.

The same definition lives in ops_cuda/include/fusedattn/philox.h; every backend
of this project draws its dropout mask from it, so masks match bit for bit
across the XLA backend, the host build and the device kernels.

Element (b, h, i, j) of the [b, h, sq, skv] attention weights is kept when

    draw(philox4x32_10(counter=(j // 8, i, h, b), key=(seed[0], seed[1])), j % 8) >= threshold

where draw(x, s) = (x[s // 2] >> 16 (s % 2)) & 0xffff (eight 16-bit draws a counter) and
threshold = min(floor(rate * 2**16), 2**16 - 1); kept weights are scaled by 1 / (1 - rate).
The rate is thus applied in steps of 2**-16 (the drop probability is threshold / 2**16).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_M0 = np.uint32(0xD2511F53)
_M1 = np.uint32(0xCD9E8D57)
_W0 = np.uint32(0x9E3779B9)
_W1 = np.uint32(0xBB67AE85)
_ROUNDS = 10


def _mulhilo(a: jax.Array, m: np.uint32) -> tuple[jax.Array, jax.Array]:
    """(high, low) 32-bit words of the 64-bit product a * m, in uint32 arithmetic."""
    mask16 = np.uint32(0xFFFF)
    a0, a1 = a & mask16, a >> 16
    m0, m1 = m & mask16, m >> np.uint32(16)
    p00, p01, p10, p11 = a0 * m0, a0 * m1, a1 * m0, a1 * m1
    middle = (p00 >> 16) + (p01 & mask16) + (p10 & mask16)
    high = p11 + (p01 >> 16) + (p10 >> 16) + (middle >> 16)
    return high, a * m


def philox4x32(counter: tuple[jax.Array, ...], key: tuple[jax.Array, jax.Array]):
    """Philox4x32-10 of four uint32 counter words under a two-word key."""
    c0, c1, c2, c3 = (jnp.asarray(c, jnp.uint32) for c in counter)
    k0, k1 = (jnp.asarray(k, jnp.uint32) for k in key)
    for round_index in range(_ROUNDS):
        if round_index:
            k0, k1 = k0 + _W0, k1 + _W1
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def keep_threshold(rate: float) -> int:
    """The 16-bit value below which a draw drops its element."""
    return min(int(np.floor(rate * 2.0**16)), 2**16 - 1)


def dropout_keep_mask(seed: jax.Array, rate: float, shape: tuple[int, int, int, int],
                      q_index: jax.Array | None = None, kv_index: jax.Array | None = None
                      ) -> jax.Array:
    """Boolean [b, h, sq, skv] mask of kept attention weights for Philox key `seed` (uint32 [2]).

    q_index [sq] / kv_index [skv]: the query and key coordinates of the mask's rows and
    columns in the whole call (default 0..sq-1, 0..skv-1), so a block of a larger call
    (context parallelism) draws exactly that call's bits for its tokens.
    """
    b, h, sq, skv = shape
    q_index = jnp.arange(sq) if q_index is None else q_index
    kv_index = jnp.arange(skv) if kv_index is None else kv_index
    bi = jnp.arange(b, dtype=jnp.uint32)[:, None, None, None]
    hi = jnp.arange(h, dtype=jnp.uint32)[None, :, None, None]
    qi = jnp.asarray(q_index).astype(jnp.uint32)[None, None, :, None]
    kj = jnp.asarray(kv_index).astype(jnp.uint32)[None, None, None, :]
    words = philox4x32((kj >> 3, qi, hi, bi), (seed[0], seed[1]))
    slot = kj & np.uint32(7)
    word = jnp.select([slot >> 1 == 0, slot >> 1 == 1, slot >> 1 == 2], list(words[:3]), words[3])
    draw = (word >> ((slot & np.uint32(1)) * np.uint32(16))) & np.uint32(0xFFFF)
    return draw >= np.uint32(keep_threshold(rate))


def seed_from_key(key: jax.Array) -> jax.Array:
    """The uint32 [2] Philox key for a JAX PRNG key (raw uint32 or typed)."""
    return jax.random.bits(key, (2,), jnp.uint32)
