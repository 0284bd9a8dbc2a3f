// Philox4x32-10 counter-based dropout, the definition of fusedattn/ops/philox.py.
//
// Element (b, h, i, j) of the [b, h, sq, skv] attention weights is kept iff
//
//   draw(philox4x32_10(counter = (j / 8, i, h, b), key = (seed0, seed1)), j % 8) >= threshold
//
// where draw(x, s) = (x[s / 2] >> 16 (s % 2)) & 0xffff (eight 16-bit draws a counter) and
// threshold = min(floor(rate * 2^16), 2^16 - 1); kept weights are scaled by 1 / (1 - rate).
// Host and device builds share this code, so masks match bit for bit across the XLA
// backend, the host build and the device kernels.
#ifndef FUSEDATTN_PHILOX_H_
#define FUSEDATTN_PHILOX_H_

#include <cmath>
#include <cstdint>

#include "fusedattn/portability.h"

namespace fusedattn {

struct Philox4 {
  uint32_t x[4];
};

FA_HOST_DEVICE FA_INLINE void mulhilo32(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  *hi = __umulhi(a, b);
  *lo = a * b;
#else
  const uint64_t product = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(product >> 32);
  *lo = static_cast<uint32_t>(product);
#endif
}

// Philox4x32 with 10 rounds (Random123's philox4x32_R(10, ...)).
FA_HOST_DEVICE FA_INLINE Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                              uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    if (round) {
      k0 += kW0;
      k1 += kW1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(c0, kM0, &hi0, &lo0);
    mulhilo32(c2, kM1, &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0;
    const uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  Philox4 out;
  out.x[0] = c0;
  out.x[1] = c1;
  out.x[2] = c2;
  out.x[3] = c3;
  return out;
}

// The draws of one counter: keys 8 (j / 8) .. 8 (j / 8) + 7 of a row.
constexpr int kDrawsPerCounter = 8;

// The value below which a draw drops its element: min(floor(rate * 2^16), 2^16 - 1).
// `rate` is a double so that it equals Python's keep_threshold(rate) exactly.
FA_HOST_DEVICE FA_INLINE uint32_t dropout_threshold(double rate) {
  if (!(rate > 0.0)) return 0u;
  const double t = floor(rate * 65536.0);
  return t >= 65535.0 ? 0xffffu : static_cast<uint32_t>(t);
}

// The counter of keys 8 (j / 8) .. 8 (j / 8) + 7 of row (b, h, i).
FA_HOST_DEVICE FA_INLINE Philox4 dropout_draws(uint32_t seed0, uint32_t seed1, uint32_t b, uint32_t h,
                                               uint32_t i, uint32_t j_div_8) {
  return philox4x32_10(j_div_8, i, h, b, seed0, seed1);
}

// Draw `slot` (0 .. 7: key 8 (j / 8) + slot) of a counter: the 16-bit halves of its words.
FA_HOST_DEVICE FA_INLINE uint32_t draw16(uint32_t word, int half) { return (word >> (16 * half)) & 0xffffu; }
FA_HOST_DEVICE FA_INLINE uint32_t draw16(const Philox4& draws, int slot) {
  return draw16(draws.x[slot / 2], slot % 2);
}

// The keep flags of a word's two draws, SIMD within the word: bit 15 is set iff the low
// draw (draw16(word, 0)) >= threshold, bit 31 iff the high one is; the other bits are
// garbage. Both draws' low 15 bits are compared by one addition (x + 2^15 - t has bit 15
// set iff x >= t; no carry crosses into the high draw), their top bits by the majority of
// (draw, that sum, the complement of the threshold's top bit).
FA_HOST_DEVICE FA_INLINE uint32_t kept_top_bits(uint32_t word, uint32_t threshold) {
  constexpr uint32_t kTops = 0x80008000u;
  const uint32_t sum = (word & ~kTops) + (0x8000u - (threshold & 0x7fffu)) * 0x10001u;
  const uint32_t below = threshold & 0x8000u ? 0u : kTops;  // the threshold's top bit clear
  return (word & sum) | ((word | sum) & below);
}

// The keep flags of a counter's eight draws as one byte: bit j set iff draw16(draws, j) >=
// threshold (kept_top_bits' flags, gathered).
FA_HOST_DEVICE FA_INLINE uint32_t kept_byte(const Philox4& draws, uint32_t threshold) {
  uint32_t byte = 0;
  for (int w = 0; w < 4; ++w) {
    const uint32_t tops = kept_top_bits(draws.x[w], threshold);
    byte |= (((tops >> 15) & 1u) << (2 * w)) | ((tops >> 31) << (2 * w + 1));
  }
  return byte;
}

// One step of the transpose of an 8 x 8 bit matrix held a row (a byte) per lane by eight
// lanes r = 0 .. 7: lane r, given the row of lane r ^ span as `other`, swaps the off-diagonal
// span x span blocks (its bits j with (j & span) != (r & span) become the partner's bits
// j ^ span). Steps with span 4, 2 and 1 leave column r in lane r.
FA_HOST_DEVICE FA_INLINE uint32_t transpose_step(uint32_t row, uint32_t other, int r, int span) {
  const uint32_t same = span == 4 ? 0x0fu : span == 2 ? 0x33u : 0x55u;  // columns j with (j & span) == 0
  const uint32_t high = ~same & 0xffu;
  return (r & span) ? (row & high) | ((other & high) >> span) : (row & same) | ((other & same) << span);
}

// Whether element (b, h, i, j) is kept.
FA_HOST_DEVICE FA_INLINE bool dropout_keep(uint32_t seed0, uint32_t seed1, uint32_t threshold,
                                           uint32_t b, uint32_t h, uint32_t i, uint32_t j) {
  const Philox4 draws = dropout_draws(seed0, seed1, b, h, i, j >> 3);
  return draw16(draws, static_cast<int>(j & 7u)) >= threshold;
}

}  // namespace fusedattn

#endif  // FUSEDATTN_PHILOX_H_
