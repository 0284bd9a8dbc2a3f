// Compares kept_top_bits (fusedattn/philox.h: both draws of a word against the threshold at
// once) with draw16(word, half) >= threshold, for every 16-bit draw in each half of a word
// and thresholds at and around the top-bit boundary plus pseudo-random ones; prints the
// number of comparisons and of mismatches. Built and run by tests/test_philox.py.
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
  return 0;
}
