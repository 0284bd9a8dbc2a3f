// Compares kept_top_bits (fusedattn/philox.h: both draws of a word against the threshold at
// once) with draw16(word, half) >= threshold, for every 16-bit draw in each half of a word
// and thresholds at and around the top-bit boundary plus pseudo-random ones; prints the
// number of comparisons and of mismatches. Then kept_byte against draw16 >= threshold on
// pseudo-random counters ("byte" line), and transpose_step's three steps over eight emulated
// lanes against the transpose of pseudo-random 8 x 8 bit matrices ("transpose" line), the
// backward's exchange of dropout flags. Built and run by tests/test_philox.py.
#include <cstdint>
#include <cstdio>

#include "fusedattn/philox.h"

int main() {
  uint32_t thresholds[96] = {0u, 1u, 2u, 0x3fffu, 0x7ffeu, 0x7fffu, 0x8000u, 0x8001u, 0xc000u, 0xfffeu, 0xffffu,
                             fusedattn::dropout_threshold(0.1), fusedattn::dropout_threshold(0.5)};
  uint32_t state = 12345u;
  for (int i = 13; i < 96; ++i) {
    state = state * 1664525u + 1013904223u;
    thresholds[i] = state >> 16;
  }
  long long checked = 0, mismatches = 0;
  for (uint32_t threshold : thresholds) {
    for (uint32_t low = 0; low < 0x10000u; ++low) {
      const uint32_t high = (low * 40503u + threshold) & 0xffffu;
      const uint32_t word = low | (high << 16);
      const uint32_t flags = fusedattn::kept_top_bits(word, threshold);
      for (int half = 0; half < 2; ++half) {
        const bool expected = fusedattn::draw16(word, half) >= threshold;
        const bool got = (flags >> (15 + 16 * half)) & 1u;
        mismatches += expected != got;
        ++checked;
      }
    }
  }
  std::printf("%lld %lld\n", checked, mismatches);

  long long bytes = 0, byte_mismatches = 0, matrices = 0, transpose_mismatches = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    fusedattn::Philox4 draws;
    for (uint32_t& word : draws.x) word = state = state * 1664525u + 1013904223u;
    const uint32_t threshold = thresholds[trial % 96];
    const uint32_t byte = fusedattn::kept_byte(draws, threshold);
    for (int j = 0; j < 8; ++j) {
      byte_mismatches += ((byte >> j) & 1u) != (fusedattn::draw16(draws, j) >= threshold ? 1u : 0u);
      ++bytes;
    }
    uint32_t rows[8];
    for (uint32_t& row : rows) row = (state = state * 1664525u + 1013904223u) >> 24;
    uint32_t lanes[8];
    for (int r = 0; r < 8; ++r) lanes[r] = rows[r];
    for (int span = 4; span > 0; span /= 2) {
      uint32_t next[8];
      for (int r = 0; r < 8; ++r) next[r] = fusedattn::transpose_step(lanes[r], lanes[r ^ span], r, span);
      for (int r = 0; r < 8; ++r) lanes[r] = next[r];
    }
    for (int r = 0; r < 8; ++r) {
      for (int k = 0; k < 8; ++k) transpose_mismatches += ((lanes[r] >> k) & 1u) != ((rows[k] >> r) & 1u);
      transpose_mismatches += (lanes[r] >> 8) != 0u;  // nothing above the byte
    }
    ++matrices;
  }
  std::printf("byte %lld %lld\n", bytes, byte_mismatches);
  std::printf("transpose %lld %lld\n", matrices, transpose_mismatches);
  return 0;
}
