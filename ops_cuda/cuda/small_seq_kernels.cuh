// The small_seq kernels (CUDA, and HIP from the same source) and their launchers,
// included once per head dim by small_seq_d{64,128,256,512}.cu, so a build compiles
// the head dims side by side; small_seq.cu holds the FFI handlers.
//
// Mapping: a team of kLanes lanes (a fraction of a warp) serves one task.
// Every lane of the team holds the same slice of q and of every key and value
// row: two 16-byte vectors (four for f32 d=512 on 32-lane warps), vector t of
// lane `sub` being vector sub + t * kLanes of the row, so each load
// instruction of a team covers contiguous bytes. Hence
// - a score is a lane-local partial dot product summed by log2(kLanes) xor
//   shuffles inside the team, after which every lane has every score;
// - the softmax runs redundantly in every lane;
// - o = sum_j P_j f_j v_j, dq, dk and dv are lane-local: no cross-lane sums,
//   each lane stores its own slice.
// Forward task: a (query token, query head), writing o and the scores'
// log-sum-exp; backward task: a (query token, K/V head) and all query heads of
// its group, whose shares of dk and dv it sums. With the lse each key's weight
// comes from its own score, so the backward takes key j and value j together,
// once, and is done with them: dq += dS_j k_j, dk_j = dS_j q, dv_j = P_j f_j dO.
// Shuffles never leave a team, so a team past the last task just exits.
// A task's rows stream in batches, every load of a batch issued before any
// is used (the q, dO and O loads before even the key range is known), so a
// lane waits for memory once per batch; with up to 4 keys all rows of the
// forward are one batch. On CUDA the backward's pairs instead stream through
// shared-memory slots filled by cp.async, several pairs ahead of their use,
// which keeps more bytes in flight than its registers could hold (HIP, without
// cp.async, uses the register batches). Compile-time specialised on the element type, head
// dim, key bound (2, 4, 8, 12, 16) and dropout, so the score arrays and row
// slices live in registers.
#ifndef FUSEDATTN_CUDA_SMALL_SEQ_KERNELS_CUH_
#define FUSEDATTN_CUDA_SMALL_SEQ_KERNELS_CUH_

#include <cstdint>
#include <type_traits>

#include "fusedattn/gpu_runtime.h"  // first: the HIP runtime declares the device intrinsics
#include "fusedattn/ffi_args.h"
#include "fusedattn/layout.h"
#include "fusedattn/small_seq.h"
#include "small_seq_launch.h"
#include "xla/ffi/api/ffi.h"

#if defined(__HIPCC__)
#include <hip/hip_fp16.h>
#else
#include <cuda_fp16.h>
#endif

namespace fusedattn {
namespace {

namespace ffi = xla::ffi;

// ---- 16-byte vectors of elements -------------------------------------------

template <ElementType ET>
struct VecTraits {
  using Storage = typename Element<ET>::Storage;
  static constexpr int kElems = 16 / sizeof(Storage);
};

__device__ __forceinline__ float element_to_float(std::integral_constant<ElementType, ElementType::kF32>,
                                                  uint32_t bits) {
  return __uint_as_float(bits);
}
__device__ __forceinline__ float element_to_float(std::integral_constant<ElementType, ElementType::kBF16>,
                                                  uint32_t bits) {
  return __uint_as_float(bits << 16);
}
__device__ __forceinline__ float element_to_float(std::integral_constant<ElementType, ElementType::kF16>,
                                                  uint32_t bits) {
  __half_raw raw;
  raw.x = static_cast<unsigned short>(bits);
  return __half2float(__half(raw));
}
__device__ __forceinline__ uint32_t float_to_element(std::integral_constant<ElementType, ElementType::kF32>,
                                                     float x) {
  return __float_as_uint(x);
}
__device__ __forceinline__ uint32_t float_to_element(std::integral_constant<ElementType, ElementType::kBF16>,
                                                     float x) {
  return float_to_bf16(x);
}
__device__ __forceinline__ uint32_t float_to_element(std::integral_constant<ElementType, ElementType::kF16>,
                                                     float x) {
  return static_cast<__half_raw>(__float2half_rn(x)).x;
}

// The elements of one raw 16-byte vector as floats.
template <ElementType ET>
__device__ __forceinline__ void unpack_vec(const uint4& raw, float (&out)[VecTraits<ET>::kElems]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
  constexpr std::integral_constant<ElementType, ET> tag{};
  if constexpr (ET == ElementType::kF32) {
#pragma unroll
    for (int e = 0; e < 4; ++e) out[e] = element_to_float(tag, words[e]);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      out[2 * e] = element_to_float(tag, words[e] & 0xffffu);
      out[2 * e + 1] = element_to_float(tag, words[e] >> 16);
    }
  }
}

// Stores floats as one 16-byte vector at `dst`.
template <ElementType ET>
__device__ __forceinline__ void store_vec(typename Element<ET>::Storage* dst,
                                          const float (&in)[VecTraits<ET>::kElems]) {
  constexpr std::integral_constant<ElementType, ET> tag{};
  uint32_t words[4];
  if constexpr (ET == ElementType::kF32) {
#pragma unroll
    for (int e = 0; e < 4; ++e) words[e] = float_to_element(tag, in[e]);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      words[e] = float_to_element(tag, in[2 * e]) | (float_to_element(tag, in[2 * e + 1]) << 16);
    }
  }
  *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
}

// ---- a team and its lanes' slices of a head row -------------------------------

template <ElementType ET, int D>
struct Team {
  static constexpr int kVec = VecTraits<ET>::kElems;  // elements per 16-byte vector
  static constexpr int kVecsPerRow = D / kVec;
  // Two vectors per lane: two loads in flight per row and lane, few enough registers per row
  // that a batch of rows fits; capped at the warp (then more vectors per lane).
  static constexpr int kLanes = kVecsPerRow / 2 < kWarpSize ? kVecsPerRow / 2 : kWarpSize;
  static constexpr int kVecsPerLane = kVecsPerRow / kLanes;
  static constexpr int kElems = kVecsPerLane * kVec;  // floats of a lane's slice
  static_assert(D % kVec == 0 && kVecsPerRow % kLanes == 0 && kWarpSize % kLanes == 0,
                "head dim must fill whole vectors");
};

// A lane's slice of one head row as raw 16-byte vectors: vectors sub, sub + kLanes, ...
template <ElementType ET, int D>
struct Slice {
  uint4 v[Team<ET, D>::kVecsPerLane];
};

// A key row and its value row, as one streamed unit of the backward.
template <ElementType ET, int D>
struct KeyValue {
  Slice<ET, D> k, v;
};

// The same slice as floats.
template <ElementType ET, int D>
using Floats = float[Team<ET, D>::kElems];

// The slice of `row` (element index of the row's start) that lane `sub` holds.
template <ElementType ET, int D>
__device__ __forceinline__ Slice<ET, D> load_slice(const typename Element<ET>::Storage* row, int sub) {
  using T = Team<ET, D>;
  Slice<ET, D> s;
#pragma unroll
  for (int t = 0; t < T::kVecsPerLane; ++t) {
    s.v[t] = *reinterpret_cast<const uint4*>(row + (sub + t * T::kLanes) * T::kVec);
  }
  return s;
}

// The same for a key or value row, zeros without any memory access when !live. On CUDA
// each vector is one predicated load in inline PTX rather than a branch around a load:
// ptxas -v shows fewer spills with it in several instantiations.
template <ElementType ET, int D>
__device__ __forceinline__ Slice<ET, D> load_slice_if(const typename Element<ET>::Storage* row, int sub,
                                                      bool live) {
  using T = Team<ET, D>;
  Slice<ET, D> s;
#pragma unroll
  for (int t = 0; t < T::kVecsPerLane; ++t) {
    const auto* src = row + (sub + t * T::kLanes) * T::kVec;
#if defined(__HIPCC__)
    s.v[t] = live ? *reinterpret_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
#else
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "setp.ne.b32 p, %5, 0;\n\t"
        "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"
        "@p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
        : "=&r"(s.v[t].x), "=&r"(s.v[t].y), "=&r"(s.v[t].z), "=&r"(s.v[t].w)  // written before %4 is read
        : "l"(src), "r"(static_cast<int>(live)));
#endif
  }
  return s;
}

// Stores a lane's slice given as floats, or NaN everywhere when !ok.
template <ElementType ET, int D>
__device__ __forceinline__ void store_slice(typename Element<ET>::Storage* row, int sub,
                                            const Floats<ET, D>& x, bool ok = true) {
  using T = Team<ET, D>;
#pragma unroll
  for (int t = 0; t < T::kVecsPerLane; ++t) {
    float out[T::kVec];
#pragma unroll
    for (int e = 0; e < T::kVec; ++e) out[e] = ok ? x[t * T::kVec + e] : NAN;
    store_vec<ET>(row + (sub + t * T::kLanes) * T::kVec, out);
  }
}

// This lane's part of the dot product of two rows.
template <ElementType ET, int D>
__device__ __forceinline__ float dot(const Slice<ET, D>& a, const Slice<ET, D>& b) {
  using T = Team<ET, D>;
  float acc = 0.0f;
#pragma unroll
  for (int t = 0; t < T::kVecsPerLane; ++t) {
    float x[T::kVec], y[T::kVec];
    unpack_vec<ET>(a.v[t], x);
    unpack_vec<ET>(b.v[t], y);
#pragma unroll
    for (int e = 0; e < T::kVec; ++e) acc += x[e] * y[e];
  }
  return acc;
}

// acc += w * row, lane-local.
template <ElementType ET, int D>
__device__ __forceinline__ void axpy(Floats<ET, D>& acc, float w, const Slice<ET, D>& row) {
  using T = Team<ET, D>;
#pragma unroll
  for (int t = 0; t < T::kVecsPerLane; ++t) {
    float r[T::kVec];
    unpack_vec<ET>(row.v[t], r);
#pragma unroll
    for (int e = 0; e < T::kVec; ++e) acc[t * T::kVec + e] += w * r[e];
  }
}

// Stores w * row for a row slice given raw: 0 + w * x per element, as the host's
// accumulation from zero rounds it.
template <ElementType ET, int D>
__device__ __forceinline__ void store_scaled(typename Element<ET>::Storage* dst, int sub, float w,
                                             const Slice<ET, D>& row) {
  using T = Team<ET, D>;
#pragma unroll
  for (int t = 0; t < T::kVecsPerLane; ++t) {
    float x[T::kVec];
    unpack_vec<ET>(row.v[t], x);
#pragma unroll
    for (int e = 0; e < T::kVec; ++e) x[e] = __fmaf_rn(w, x[e], 0.0f);
    store_vec<ET>(dst + (sub + t * T::kLanes) * T::kVec, x);
  }
}

// ---- the lanes of a team talking among themselves -------------------------------

// Shuffles and syncs restricted to one team, so teams of a warp never wait on each other
// and a team past the end of the grid may exit.
template <int LANES>
struct TeamComm {
#if defined(__HIPCC__)
  // The width argument confines the shuffles to the team's segment of the wavefront.
  __device__ __forceinline__ float sum(float x) const {
#pragma unroll
    for (int offset = LANES / 2; offset > 0; offset /= 2) x += __shfl_xor(x, offset, LANES);
    return x;
  }
  __device__ __forceinline__ float broadcast(float x, int src) const { return __shfl(x, src, LANES); }
  template <class V>
  __device__ __forceinline__ V own(V x, int sub) const { return __shfl(x, sub, LANES); }
  __device__ __forceinline__ void sync() const { warp_sync(); }
#else
  unsigned mask = LANES >= 32 ? 0xffffffffu : ((1u << (LANES % 32)) - 1u) << (threadIdx.x % 32 / LANES * LANES);
  __device__ __forceinline__ float sum(float x) const {
#pragma unroll
    for (int offset = LANES / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(mask, x, offset, LANES);
    return x;
  }
  // Lane `src` (0 .. LANES-1) of the team's value.
  __device__ __forceinline__ float broadcast(float x, int src) const { return __shfl_sync(mask, x, src, LANES); }
  // This lane's own x, through a shuffle: a value no optimiser can hoist out of a loop.
  template <class V>
  __device__ __forceinline__ V own(V x, int sub) const { return __shfl_sync(mask, x, sub, LANES); }
  __device__ __forceinline__ void sync() const { __syncwarp(mask); }
#endif
};

// ---- a query token's key range ---------------------------------------------------------

// Where a task's key (and value, dk, dv) rows are: row j at element offset first + j * stride,
// the first `live` rows readable. The forward's pass over the rows, and each load and use of
// a backward row, take a fresh() copy that the optimisers cannot see through: otherwise they
// compute each row's offset and bounds test once and keep them, two or three registers per
// row, from the first row (or the first head) to the last, and spill.
struct KeyRows {
  int64_t first, stride;  // stride: Hkv * D
  int32_t live;
  __device__ __forceinline__ int64_t operator()(int j) const { return first + j * stride; }
  template <int LANES>
  __device__ __forceinline__ KeyRows fresh(const TeamComm<LANES>& team, int sub) const {
    return {team.own(first, sub), team.own(stride, sub), team.own(live, sub)};
  }
};

// What a task knows of its query token (b, i) and key range, and its Philox coordinates.
struct Task {
  int64_t b, i, start;
  int32_t len;
  bool ok;       // the key range is servable; otherwise o and dq are NaN
  KeyRows rows;  // of the task's K/V head; live: len when ok, else 0 (no offset then used)
  uint32_t seed0, seed1;
  int64_t philox_b;
};

template <int N, bool DROPOUT>
__device__ __forceinline__ Task make_task(const SmallSeqParams& p, int64_t token, int64_t kv_head, int64_t D,
                                          const int32_t* kv_start, const int32_t* kv_len, const uint32_t* seed) {
  Task t;
  t.b = token / p.seqlen_q;
  t.i = token % p.seqlen_q;
  t.start = kv_start[token];
  t.len = kv_len[token];
  t.ok = small_seq_len_ok(t.len, p.max_keys) && t.len <= N && t.start >= 0 && t.start + t.len <= p.seqlen_kv;
  t.rows.first = bshd_offset(t.b, t.start, kv_head, 0, p.seqlen_kv, p.kv_heads, D);
  t.rows.stride = p.kv_heads * D;
  t.rows.live = t.ok ? t.len : 0;
  t.seed0 = t.seed1 = 0;
  t.philox_b = 0;
  if constexpr (DROPOUT) {  // without dropout no seed load, no Philox registers
    const int64_t seed_row = broadcast_row(t.b, p.batch, p.seed_rows);
    t.seed0 = seed[2 * seed_row];
    t.seed1 = seed[2 * seed_row + 1];
    t.philox_b = broadcast_inner(t.b, p.batch, p.seed_rows);
  }
  return t;
}

// The dropout factors of keys 0..N-1 for head h: 0 beyond the live keys, 1 without dropout.
// draw() has lane `sub` draw keys sub, sub + LANES, ...; factor(j) hands key j's draw to the
// whole team when it is needed, so the factors take N / LANES registers, not N.
template <bool DROPOUT, int N, int LANES>
class DropoutFactors {
 public:
  __device__ __forceinline__ void draw(const SmallSeqParams& p, const Task& t, int32_t live, int64_t h, int sub) {
    if constexpr (DROPOUT) {
#pragma unroll
      for (int m = 0; m < kDraws; ++m) {
        const int j = sub + m * LANES;
        mine_[m] = j < live ? small_seq_dropout_factor(p, t.seed0, t.seed1, t.philox_b, h, t.i, t.start + j)
                              : 0.0f;
      }
    }
  }
  __device__ __forceinline__ float factor(const TeamComm<LANES>& team, int j) const {
    if constexpr (DROPOUT) return team.broadcast(mine_[j / LANES], j % LANES);
    return 1.0f;
  }

 private:
  static constexpr int kDraws = (N + LANES - 1) / LANES;
  float mine_[DROPOUT ? kDraws : 1];
};

// The softmax weights p_j from the lanes' partial dots q.k_j (in s): team sums, scale,
// softmax over the first `len` keys. Every lane ends with every weight; returns the
// scaled scores' log-sum-exp.
template <int N, int LANES>
__device__ __forceinline__ float attention_weights(const TeamComm<LANES>& team, float scale, int len,
                                                   float (&s)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) s[j] = team.sum(s[j]) * scale;
  return small_seq_softmax(s, len);
}

// ---- a task's rows, in the order a pass consumes them ------------------------------

// f(std::integral_constant<int, I>) for I = FIRST .. END-1: unrolled by construction, where
// a #pragma unroll of a large body may be refused (hipcc does, for the 16-key backward) and
// its indices into the score arrays would no longer be constants (local memory).
template <int FIRST, int END, class F>
__device__ __forceinline__ void static_for(F&& f) {
  if constexpr (FIRST < END) {
    f(std::integral_constant<int, FIRST>{});
    static_for<FIRST + 1, END>(f);
  }
}

// Calls load(r, slice) and use(r, slice) for rows r = 0 .. ROWS-1 in order (r an
// std::integral_constant), BATCH rows at a time: every load of a batch is issued before any
// of its rows is used, so a lane waits for memory once per batch, not once per row. The
// team sync between batches is for ptxas, which otherwise moves loads of later batches up
// (ptxas -v: fewer spills with it).
template <class S, int ROWS, int BATCH, int LANES, class Load, class Use>
__device__ __forceinline__ void stream_rows(const TeamComm<LANES>& team, Load&& load, Use&& use) {
  static_for<0, (ROWS + BATCH - 1) / BATCH>([&](auto batch_index) {
    constexpr int kFirst = decltype(batch_index)::value * BATCH;
    constexpr int kRows = ROWS - kFirst < BATCH ? ROWS - kFirst : BATCH;
    if constexpr (kFirst > 0) team.sync();
    S batch[kRows];
    static_for<0, kRows>([&](auto b) {
      load(std::integral_constant<int, kFirst + decltype(b)::value>{}, batch[b]);
    });
    static_for<0, kRows>([&](auto b) {
      use(std::integral_constant<int, kFirst + decltype(b)::value>{}, batch[b]);
    });
  });
}

// ---- rows staged through shared memory (CUDA) ---------------------------------------

// On CUDA (sm_80+) the backward's (K_j, V_j) pairs stream through a ring of shared-memory
// slots filled by cp.async: bytes in flight without registers holding them, so a lane has
// several pairs in flight while the registers hold only q, dO, O and the dq accumulator.
// HIP has no cp.async: there the pairs stream through registers (stream_rows).
#if defined(__HIPCC__)
constexpr bool kStagedPairs = false;
#else
constexpr bool kStagedPairs = true;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "the small_seq kernels need sm_80 or newer (cp.async)"
#endif

// Starts copying 16 bytes from global `src` to shared `dst`; writes zeros, reading nothing,
// when !live.
__device__ __forceinline__ void copy_async(uint4* dst, const void* src, bool live) {
  const auto shared = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared), "l"(src), "r"(live ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most PENDING of this lane's committed groups of copies are unfinished.
template <int PENDING>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

// A lane's SLOTS slots of one (K_j, V_j) pair each, in shared memory. Vector t of slot s is
// at base[(s * kVectors + t) * stride] (stride: the block's threads), so a warp's accesses
// to one vector are contiguous. Only the lane that fills a slot reads it: no block syncs.
template <ElementType ET, int D, int SLOTS>
struct PairSlots {
  using T = Team<ET, D>;
  static constexpr int kVectors = 2 * T::kVecsPerLane;  // per slot: the k slice, then the v slice
  uint4* base;
  int stride;

  __device__ __forceinline__ uint4* at(int slot, int t) const { return base + (slot * kVectors + t) * stride; }
  // Starts filling `slot` with the lane's slices of rows k_row and v_row (zeros when !live).
  __device__ __forceinline__ void fill(int slot, const typename Element<ET>::Storage* k_row,
                                       const typename Element<ET>::Storage* v_row, int sub, bool live) const {
#pragma unroll
    for (int t = 0; t < T::kVecsPerLane; ++t) {
      const int offset = (sub + t * T::kLanes) * T::kVec;
      copy_async(at(slot, t), k_row + offset, live);
      copy_async(at(slot, T::kVecsPerLane + t), v_row + offset, live);
    }
  }
  __device__ __forceinline__ KeyValue<ET, D> take(int slot) const {
    KeyValue<ET, D> kv;
#pragma unroll
    for (int t = 0; t < T::kVecsPerLane; ++t) {
      kv.k.v[t] = *at(slot, t);
      kv.v.v[t] = *at(slot, T::kVecsPerLane + t);
    }
    return kv;
  }
};

// Calls fill(u, slot) and use(u, slot) for units u = 0 .. UNITS-1 (u an
// std::integral_constant) through SLOTS <= UNITS slots: the first SLOTS units start at once,
// and unit u + SLOTS starts in u's slot as soon as u is used. fill's copies are one group
// per unit; use(u) runs once u's group has landed.
template <int UNITS, int SLOTS, class Fill, class Use>
__device__ __forceinline__ void stream_staged(Fill&& fill, Use&& use) {
  static_assert(SLOTS >= 1 && SLOTS <= UNITS, "one slot per unit at most");
  static_for<0, SLOTS>([&](auto u) {
    fill(u, decltype(u)::value);
    commit_copies();
  });
  static_for<0, UNITS>([&](auto u) {
    constexpr int kU = decltype(u)::value;
    constexpr int kLater = UNITS - 1 - kU < SLOTS - 1 ? UNITS - 1 - kU : SLOTS - 1;  // units started after u
    wait_copies<kLater>();
    use(u, kU % SLOTS);
    if constexpr (kU + SLOTS < UNITS) {  // after use(u) has read the slot into registers
      fill(std::integral_constant<int, kU + SLOTS>{}, kU % SLOTS);
      commit_copies();
    }
  });
}
#endif

// ---- launch shapes ---------------------------------------------------------------------

// Blocks of 128 threads. The kernels are bound by the bytes in flight per SM: resident
// lanes times the rows each has in flight. So each instantiation gets the largest batch of
// rows (raw 16-byte vectors per lane, 4 registers each) and the occupancy floor (blocks per
// SM in __launch_bounds__: 4 allows 128 registers, 3 168, 2 255) that ptxas -v (sm_80,
// sm_90) shows fitting without spills; the floor only caps registers, ptxas often takes
// fewer and occupancy follows. "Wide": f32 d=512 on 32-lane warps, 4 vectors per row slice.
constexpr int kForwardThreads = 128;
constexpr int kBackwardThreads = 128;

// Forward rows: K_0..K_{N-1}, V_0..V_{N-1}, 8 rows per batch (so with up to 4 keys all at
// once: one memory round trip); wide: 4, and 1 with 16 keys. 12 keys take 3 batches where
// the 16-key kernels took 4: 0.788 against 0.846 ms (results/small_seq_sweep.json). 4
// blocks per SM (128 registers) unless ptxas -v (sm_90) showed spills there: 16 keys, and
// from 9 keys with dropout (8-24 bytes per lane), take 3; wide ones from 9 keys, or 8 with
// dropout, take 2.
template <ElementType ET, int D, int N, bool DROPOUT>
struct ForwardPlan {
  static constexpr bool kWide = Team<ET, D>::kVecsPerLane > 2;
  static constexpr int kBatch = (N < 16 ? 16 : kWide ? 4 : 16) / Team<ET, D>::kVecsPerLane;
  static constexpr bool kHeavy = N == 16 || (N > 8 && DROPOUT);  // spills under 128 registers
  static constexpr bool kWideHeavy = kWide && (N > 8 || (N == 8 && DROPOUT));
  static constexpr int kMinBlocks = kWideHeavy ? 2 : kHeavy ? 3 : 4;
};

// Backward rows per head: the pairs (K_j, V_j). On CUDA they stream through kSlots
// shared-memory slots per lane (stream_staged): 6 pairs of 2-vector slices in flight, 384
// bytes per lane, 48 KB per block of 128. On HIP, through registers, kPairs of them per
// batch: all of them up to 4 keys (one memory round trip), else 8 raw vectors per lane.
// Measured on the H200 (benchmarks/probes/small_seq_sweep.py, results/small_seq_sweep.json, bf16
// d=128, b=30720, h=16, fwd+bwd of the kernels, ms at 2, 4, 6, 8, 12, 16 keys): the slots
// 0.578, 0.938, 1.351, 1.701, 2.621, 3.289 against the register batches' 0.622, 0.945,
// 1.456, 1.821, 2.837, 3.541; 4 or 8 slots were within 2% either way. 4 blocks per SM
// (128 registers) were faster with 8 keys in two runs (6 keys: 1.329 and 1.321 against 1.351
// and 1.350; 8 keys: 1.688 and 1.678 against 1.701 and 1.698), not with 2, 4 or 16 keys.
// Registers (ptxas -v, sm_90) stay about 120-160 for one head without dropout: q, dO and the
// dq accumulator, not the pairs, hold them; the loop over a group's heads and dropout take
// 20-60 more, and d=512 (whole-warp teams) spills under 168, so only one head without
// dropout below d=512 gets 3 blocks per SM (4 with 8 keys).
template <ElementType ET, int D, int N, bool DROPOUT, bool GROUPED>
struct BackwardPlan {
  static constexpr int kVecsPerLane = Team<ET, D>::kVecsPerLane;
  static constexpr int kPairVectors = 2 * kVecsPerLane;  // raw vectors per lane of one pair
  static constexpr int kBatchVectors = N <= 4 ? 16 : 8;
  static constexpr int kPairs = kBatchVectors / kPairVectors < 1 ? 1
                                : kBatchVectors / kPairVectors < N ? kBatchVectors / kPairVectors : N;
  static constexpr int kSlotVectors = 24;
  static constexpr int kSlots = kSlotVectors / kPairVectors < 1 ? 1
                                : kSlotVectors / kPairVectors < N ? kSlotVectors / kPairVectors : N;
  static constexpr int kMinBlocks = kVecsPerLane > 2 || GROUPED || DROPOUT || D == 512 ? 2 : N == 8 ? 4 : 3;
  // Shared-memory vectors (uint4) per lane: the pair slots (kStagedPairs).
  static constexpr int64_t kLaneSharedVectors = kStagedPairs ? kSlots * kPairVectors : 0;
  // Shared memory per team with GROUPED: the scaled dS and the dropped P of every head,
  // [group][2][N] floats, for phase 2; after the block's slots.
  __host__ __device__ static constexpr int64_t team_shared_bytes(int64_t group) {
    return GROUPED ? group * 2 * N * int64_t{sizeof(float)} : 0;
  }
};

// One team per (query token, query head): without a loop over the heads of a group the
// kernel needs fewer registers, and with grouped-query attention the teams of one K/V head
// are neighbours in the grid, so its rows still come from HBM once (then from L1 or L2).
template <ElementType ET, int D, int N, bool DROPOUT>
__global__ void __launch_bounds__(kForwardThreads, (ForwardPlan<ET, D, N, DROPOUT>::kMinBlocks))
    small_seq_forward(SmallSeqParams p, const typename Element<ET>::Storage* __restrict__ q,
                      const typename Element<ET>::Storage* __restrict__ k,
                      const typename Element<ET>::Storage* __restrict__ v, const int32_t* __restrict__ kv_start,
                      const int32_t* __restrict__ kv_len, const uint32_t* __restrict__ seed,
                      typename Element<ET>::Storage* __restrict__ o, float* __restrict__ lse) {
  using T = Team<ET, D>;
  using S = Slice<ET, D>;
  using P = ForwardPlan<ET, D, N, DROPOUT>;
  const int64_t task = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / T::kLanes;
  if (task >= p.batch * p.seqlen_q * p.heads) return;  // a whole team: its shuffles are team-local
  const int sub = threadIdx.x % T::kLanes;
  const TeamComm<T::kLanes> team;
  const int64_t token = task / p.heads, h = task % p.heads;
  const int64_t row = task * D;  // of q and o: (token * H + h) * D
  // q does not depend on the key range: its load is in flight with kv_start and kv_len.
  const S qs = load_slice<ET, D>(q + row, sub);
  const Task t = make_task<N, DROPOUT>(p, token, h / (p.heads / p.kv_heads), D, kv_start, kv_len, seed);
  KeyRows kr;
  float w[N];
  float row_lse = 0.0f;
  float acc[T::kElems] = {};
  // Rows: keys 0..N-1 (scores), then values 0..N-1 (o += P_j f_j v_j).
  stream_rows<S, 2 * N, P::kBatch>(
      team,
      [&](auto r, S& s) {
        const int j = r % N;
        if (j == 0) kr = t.rows.fresh(team, sub);
        s = load_slice_if<ET, D>((r < N ? k : v) + kr(j), sub, j < kr.live);
      },
      [&](auto r, const S& kv) {
        const int j = r % N;
        if (r < N) {
          w[j] = dot<ET, D>(qs, kv);
          if (j == N - 1) {  // all scores: the weights P_j f_j
            row_lse = attention_weights(team, p.scale, kr.live, w);
            DropoutFactors<DROPOUT, N, T::kLanes> f;
            f.draw(p, t, kr.live, h, sub);
#pragma unroll
            for (int i = 0; i < N; ++i) w[i] *= f.factor(team, i);
          }
        } else {
          axpy<ET, D>(acc, w[j], kv);
        }
      });
  store_slice<ET, D>(o + row, sub, acc, t.ok);
  if (sub == 0) lse[task] = t.ok ? row_lse : NAN;
}

// One team per (query token, K/V head), for all query heads of the group: dk and dv sum over
// them. GROUPED (more than one head per K/V head) is a compile-time split: the loop over the
// heads costs registers that the common case, one head, need not pay.
template <ElementType ET, int D, int N, bool DROPOUT, bool GROUPED>
__global__ void __launch_bounds__(kBackwardThreads, (BackwardPlan<ET, D, N, DROPOUT, GROUPED>::kMinBlocks))
    small_seq_backward(SmallSeqParams p, const typename Element<ET>::Storage* __restrict__ q,
                       const typename Element<ET>::Storage* __restrict__ k,
                       const typename Element<ET>::Storage* __restrict__ v, const int32_t* __restrict__ kv_start,
                       const int32_t* __restrict__ kv_len, const uint32_t* __restrict__ seed,
                       const typename Element<ET>::Storage* __restrict__ o, const float* __restrict__ lse,
                       const typename Element<ET>::Storage* __restrict__ dout,
                       typename Element<ET>::Storage* __restrict__ dq, typename Element<ET>::Storage* __restrict__ dk,
                       typename Element<ET>::Storage* __restrict__ dv) {
  using T = Team<ET, D>;
  using S = Slice<ET, D>;
  using P = BackwardPlan<ET, D, N, DROPOUT, GROUPED>;
  extern __shared__ uint4 shared[];  // the block's pair slots, then its teams' staging
  const int64_t task = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / T::kLanes;
  if (task >= p.batch * p.seqlen_q * p.kv_heads) return;  // a whole team: its shuffles are team-local
  const int sub = threadIdx.x % T::kLanes;
  const TeamComm<T::kLanes> team;
  const int64_t group = GROUPED ? p.heads / p.kv_heads : 1;
  const int64_t token = task / p.kv_heads, kv_head = task % p.kv_heads;
  const int64_t head0 = token * p.heads + kv_head * group;  // (token, first head of the group)
  // The first head's q, dO, O and lse do not depend on the key range: in flight with it.
  S qs = load_slice<ET, D>(q + head0 * D, sub);
  S dos = load_slice<ET, D>(dout + head0 * D, sub);
  S os = load_slice<ET, D>(o + head0 * D, sub);
  float row_lse = lse[head0];
  const Task t = make_task<N, DROPOUT>(p, token, kv_head, D, kv_start, kv_len, seed);
  float* team_staged = reinterpret_cast<float*>(shared + blockDim.x * P::kLaneSharedVectors) +
                      (threadIdx.x / T::kLanes) * (P::team_shared_bytes(group) / sizeof(float));

  // Phase 1, per query head: dS and dq; with one head per K/V head also dk and dv.
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = kv_head * group + g;
    const int64_t row = (head0 + g) * D;
    if (g > 0) {
      qs = load_slice<ET, D>(q + row, sub);
      dos = load_slice<ET, D>(dout + row, sub);
      os = load_slice<ET, D>(o + row, sub);
      row_lse = lse[head0 + g];
    }
    DropoutFactors<DROPOUT, N, T::kLanes> f;
    f.draw(p, t, t.rows.live, h, sub);
    float delta = 0.0f;
    float dq_acc[T::kElems] = {};
    auto use = [&](auto j, const KeyValue<ET, D>& kv) {
      if (j == 0) delta = team.sum(dot<ET, D>(dos, os));  // rowsum(dO * O), once the first rows are in flight
      const KeyRows kr = t.rows.fresh(team, sub);
      const float score = team.sum(dot<ET, D>(qs, kv.k)) * p.scale;
      const float weight = j < kr.live ? small_seq_weight(score, row_lse) : 0.0f;
      const float fj = f.factor(team, j);
      const float dp = team.sum(dot<ET, D>(dos, kv.v)) * fj;
      const float ds = weight * (dp - delta) * p.scale;
      axpy<ET, D>(dq_acc, ds, kv.k);
      if constexpr (GROUPED) {  // staged for phase 2
        if (j % T::kLanes == sub) {
          team_staged[g * 2 * N + j] = ds;
          team_staged[g * 2 * N + N + j] = weight * fj;
        }
      } else if (j < kr.live) {  // this head's dk_j = dS_j q and dv_j = P_j f_j dO are the whole gradients
        store_scaled<ET, D>(dk + kr(j), sub, ds, qs);
        store_scaled<ET, D>(dv + kr(j), sub, weight * fj, dos);
      }
    };
#if defined(__HIPCC__)
    stream_rows<KeyValue<ET, D>, N, P::kPairs>(
        team,
        [&](auto j, KeyValue<ET, D>& kv) {
          const KeyRows kr = t.rows.fresh(team, sub);
          kv.k = load_slice_if<ET, D>(k + kr(j), sub, j < kr.live);
          kv.v = load_slice_if<ET, D>(v + kr(j), sub, j < kr.live);
        },
        use);
#else
    const PairSlots<ET, D, P::kSlots> slots{shared + threadIdx.x, static_cast<int>(blockDim.x)};
    stream_staged<N, P::kSlots>(
        [&](auto j, int slot) {
          const KeyRows kr = t.rows.fresh(team, sub);
          const bool live = j < kr.live;
          const int64_t offset = live ? kr(j) : 0;  // a dead row reads nothing: any valid address
          slots.fill(slot, k + offset, v + offset, sub, live);
        },
        [&](auto j, int slot) { use(j, slots.take(slot)); });
#endif
    store_slice<ET, D>(dq + row, sub, dq_acc, t.ok);
  }

  // Phase 2, GROUPED, per key row: dk and dv summed over the group's heads (their q and dO
  // rows again, from L1).
  if constexpr (GROUPED) {
    team.sync();
    for (int j = 0; j < t.rows.live; ++j) {
      float dk_acc[T::kElems] = {}, dv_acc[T::kElems] = {};
      for (int64_t g = 0; g < group; ++g) {
        const int64_t row = (head0 + g) * D;
        axpy<ET, D>(dk_acc, team_staged[g * 2 * N + j], load_slice<ET, D>(q + row, sub));
        axpy<ET, D>(dv_acc, team_staged[g * 2 * N + N + j], load_slice<ET, D>(dout + row, sub));
      }
      store_slice<ET, D>(dk + t.rows(j), sub, dk_acc);
      store_slice<ET, D>(dv + t.rows(j), sub, dv_acc);
    }
  }
  // With one query per row this team owns every key row of its head: zero the rest.
  if (p.seqlen_q == 1) {
    const float zero[T::kElems] = {};
    const int64_t row0 = bshd_offset(t.b, 0, kv_head, 0, p.seqlen_kv, p.kv_heads, D);
    for (int64_t j = 0; j < p.seqlen_kv; ++j) {
      if (j >= t.start && j < t.start + t.rows.live) continue;
      store_slice<ET, D>(dk + row0 + j * t.rows.stride, sub, zero);
      store_slice<ET, D>(dv + row0 + j * t.rows.stride, sub, zero);
    }
  }
}

// ---- launchers -------------------------------------------------------------------------

// Calls f(key bound, dropout) as compile-time constants.
template <typename F>
void with_bound_and_dropout(int64_t max_keys, bool dropout, F&& f) {
  auto with_dropout = [&](auto n_tag) {
    if (dropout) return f(n_tag, std::true_type{});
    return f(n_tag, std::false_type{});
  };
  if (max_keys <= 2) return with_dropout(std::integral_constant<int, 2>{});
  if (max_keys <= 4) return with_dropout(std::integral_constant<int, 4>{});
  if (max_keys <= 8) return with_dropout(std::integral_constant<int, 8>{});
  if (max_keys <= 12) return with_dropout(std::integral_constant<int, 12>{});
  return with_dropout(std::integral_constant<int, 16>{});
}

// Blocks of `threads` threads for one team of `lanes` lanes per task.
int64_t blocks_for(int64_t tasks, int threads, int lanes) {
  const int64_t teams = threads / lanes;
  return (tasks + teams - 1) / teams;
}

template <ElementType ET, int D>
void launch_forward(gpuStream_t stream, const SmallSeqParams& p, SmallSeqForwardBuffers b) {
  const int64_t tasks = p.batch * p.seqlen_q * p.heads;  // one per (query token, query head)
  if (tasks == 0) return;
  with_bound_and_dropout(p.max_keys, p.dropout, [&](auto n, auto dropout) {
    const int64_t blocks = blocks_for(tasks, kForwardThreads, Team<ET, D>::kLanes);
    small_seq_forward<ET, D, decltype(n)::value, decltype(dropout)::value><<<blocks, kForwardThreads, 0, stream>>>(
        p, elements<ET>(b.q), elements<ET>(b.k), elements<ET>(b.v), b.kv_start.typed_data<int32_t>(),
        b.kv_len.typed_data<int32_t>(), b.seed.typed_data<uint32_t>(), elements<ET>(b.o),
        b.lse->typed_data<float>());
  });
}

template <ElementType ET, int D>
void launch_backward(gpuStream_t stream, const SmallSeqParams& p, SmallSeqBackwardBuffers b) {
  const int64_t tasks = p.batch * p.seqlen_q * p.kv_heads;  // one per (query token, K/V head)
  if (tasks == 0) return;
  const int64_t group = p.heads / p.kv_heads;
  with_bound_and_dropout(p.max_keys, p.dropout, [&](auto n, auto dropout) {
    constexpr int kN = decltype(n)::value;
    constexpr bool kDropout = decltype(dropout)::value;
    constexpr int kLanes = Team<ET, D>::kLanes;
    auto launch = [&](auto grouped) {
      constexpr bool kGrouped = decltype(grouped)::value;
      using Plan = BackwardPlan<ET, D, kN, kDropout, kGrouped>;
      const int64_t team_bytes = Plan::team_shared_bytes(group);
      int threads = kBackwardThreads;
      while (threads > kLanes && (threads / kLanes) * team_bytes > kSmallSeqMaxStagingBytes) threads /= 2;
      // The pair slots (at most 48 KB a block) and the staging: beyond 48 KB a kernel must
      // ask for its shared memory.
      const int64_t shared_bytes =
          threads * Plan::kLaneSharedVectors * int64_t{sizeof(uint4)} + (threads / kLanes) * team_bytes;
      auto* kernel = small_seq_backward<ET, D, kN, kDropout, kGrouped>;
      if (shared_bytes > 48 * 1024 &&
          gpuFuncSetAttribute(reinterpret_cast<const void*>(kernel), gpuFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(shared_bytes)) != gpuSuccess) {
        return;  // the handler's launch status reports the error
      }
      kernel<<<blocks_for(tasks, threads, kLanes), threads, shared_bytes, stream>>>(
          p, elements<ET>(b.q), elements<ET>(b.k), elements<ET>(b.v), b.kv_start.typed_data<int32_t>(),
          b.kv_len.typed_data<int32_t>(), b.seed.typed_data<uint32_t>(), elements<ET>(b.o),
          b.lse.typed_data<float>(), elements<ET>(b.dout), elements<ET>(b.dq), elements<ET>(b.dk),
          elements<ET>(b.dv));
    };
    if (group == 1) return launch(std::false_type{});
    launch(std::true_type{});
  });
}

}  // namespace

template <int D>
void launch_small_seq_forward(gpuStream_t stream, const SmallSeqParams& p, xla::ffi::DataType dtype,
                              SmallSeqForwardBuffers buffers) {
  with_element_type(dtype, [&](auto et) { launch_forward<decltype(et)::value, D>(stream, p, buffers); });
}

template <int D>
void launch_small_seq_backward(gpuStream_t stream, const SmallSeqParams& p, xla::ffi::DataType dtype,
                               SmallSeqBackwardBuffers buffers) {
  with_element_type(dtype, [&](auto et) { launch_backward<decltype(et)::value, D>(stream, p, buffers); });
}

}  // namespace fusedattn

// The launchers of head dim D, for the translation unit of that head dim.
#define FA_SMALL_SEQ_HEAD_DIM(D)                                                                      \
  template void fusedattn::launch_small_seq_forward<D>(gpuStream_t, const fusedattn::SmallSeqParams&, \
                                                       xla::ffi::DataType, fusedattn::SmallSeqForwardBuffers); \
  template void fusedattn::launch_small_seq_backward<D>(gpuStream_t, const fusedattn::SmallSeqParams&, \
                                                        xla::ffi::DataType, fusedattn::SmallSeqBackwardBuffers);

#endif  // FUSEDATTN_CUDA_SMALL_SEQ_KERNELS_CUH_
