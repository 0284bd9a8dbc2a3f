// Portability layer shared by the host build (plain C++17) and the device
// builds (CUDA, HIP): the FA_HOST_DEVICE qualifier and IEEE float <-> bfloat16 /
// float16 conversions written with integer bit manipulation (round to nearest,
// ties to even), so host and device round identically.
#ifndef FUSEDATTN_PORTABILITY_H_
#define FUSEDATTN_PORTABILITY_H_

#include <cstdint>
#include <cstring>

#if defined(__HIPCC__)
#include <hip/hip_runtime.h>  // device memcpy and __umulhi; nvcc provides its own implicitly
#endif

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FA_HOST_DEVICE __host__ __device__
#define FA_DEVICE_COMPILE 1
#else
#define FA_HOST_DEVICE
#endif

#define FA_INLINE inline

namespace fusedattn {

FA_HOST_DEVICE FA_INLINE uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

FA_HOST_DEVICE FA_INLINE float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// bfloat16 (stored as its 16 bits) -> float: exact.
FA_HOST_DEVICE FA_INLINE float bf16_to_float(uint16_t h) {
  return bits_float(static_cast<uint32_t>(h) << 16);
}

// float -> bfloat16, round to nearest even; NaN stays a (quiet) NaN.
FA_HOST_DEVICE FA_INLINE uint16_t float_to_bf16(float f) {
  uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((x >> 16) | 0x0040u);
  }
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

// IEEE binary16 (stored as its 16 bits) -> float: exact, subnormals included.
FA_HOST_DEVICE FA_INLINE float fp16_to_float(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    if (mantissa == 0) return bits_float(sign);
    exponent = 113;  // 2^-14, the subnormal scale, as a float exponent
    while (!(mantissa & 0x400u)) {
      mantissa <<= 1;
      --exponent;
    }
    mantissa &= 0x3ffu;
    return bits_float(sign | (exponent << 23) | (mantissa << 13));
  }
  if (exponent == 31) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// float -> IEEE binary16, round to nearest even; overflow gives +-inf, NaN a
// quiet NaN, tiny values round into the subnormals (or to +-0).
FA_HOST_DEVICE FA_INLINE uint16_t float_to_fp16(float f) {
  const uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t a = x & 0x7fffffffu;
  if (a >= 0x7f800000u) {  // inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00u | (a > 0x7f800000u ? (0x200u | ((a >> 13) & 0x3ffu)) : 0u));
  }
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 -> inf
  if (a < 0x38800000u) {  // below 2^-14: a half subnormal or zero
    if (a < 0x33000000u) return static_cast<uint16_t>(sign);  // <= 2^-25 rounds to 0 (even)
    const uint32_t e = a >> 23;
    const uint32_t m = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14..24
    uint32_t result = m >> shift;
    const uint32_t rest = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (result & 1u))) ++result;
    return static_cast<uint16_t>(sign | result);
  }
  a += 0xc8000fffu + ((a >> 13) & 1u);  // rebias exponent (-112) and round
  return static_cast<uint16_t>(sign | (a >> 13));
}

// Element types of the op set, as the loads and stores of the kernels see them.
enum class ElementType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

template <ElementType T>
struct Element;

template <>
struct Element<ElementType::kF32> {
  using Storage = float;
  FA_HOST_DEVICE static FA_INLINE float load(float x) { return x; }
  FA_HOST_DEVICE static FA_INLINE float store(float x) { return x; }
};

template <>
struct Element<ElementType::kBF16> {
  using Storage = uint16_t;
  FA_HOST_DEVICE static FA_INLINE float load(uint16_t x) { return bf16_to_float(x); }
  FA_HOST_DEVICE static FA_INLINE uint16_t store(float x) { return float_to_bf16(x); }
};

template <>
struct Element<ElementType::kF16> {
  using Storage = uint16_t;
  FA_HOST_DEVICE static FA_INLINE float load(uint16_t x) { return fp16_to_float(x); }
  FA_HOST_DEVICE static FA_INLINE uint16_t store(float x) { return float_to_fp16(x); }
};

}  // namespace fusedattn

#endif  // FUSEDATTN_PORTABILITY_H_
