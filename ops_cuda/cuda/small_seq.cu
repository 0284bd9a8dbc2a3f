// Device build of the small-sequence op (CUDA, and HIP from the same source):
// one query token per segment, at most 16 keys, a huge batch. Contract and
// semantics: fusedattn/small_seq.h; the host build in ops_cuda/host does the
// same arithmetic in plain loops.
//
// One warp serves one (query token, K/V head) pair and all query heads of
// that group, so K and V stream from HBM once. The warp splits into teams of
// kLanesPerRow lanes, one key row per team per pass, each lane holding 16-byte
// vectors of the row; dot products reduce within a team, the weighted sums of
// V across teams. Compile-time specialised on the head dim and on the key
// bound (2, 4, 8, 16) so the score arrays live in registers.
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "fusedattn/gpu_runtime.h"  // first: the HIP runtime declares the device intrinsics
#include "fusedattn/ffi_args.h"
#include "fusedattn/layout.h"
#include "fusedattn/small_seq.h"
#include "fusedattn/small_seq_ffi.h"
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

// Loads the 16-byte vector at `src` (element index) as floats.
template <ElementType ET>
__device__ __forceinline__ void load_vec(const typename Element<ET>::Storage* src,
                                         float (&out)[VecTraits<ET>::kElems]) {
  unpack_vec<ET>(*reinterpret_cast<const uint4*>(src), out);
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

// ---- how a warp covers a head row --------------------------------------------

template <ElementType ET, int D, int MAX_KV>
struct Geometry {
  static constexpr int kVec = VecTraits<ET>::kElems;                           // elements per vector
  static constexpr int kVecsPerRow = D / kVec;
  static constexpr int kLanesPerRow = kVecsPerRow < kWarpSize ? kVecsPerRow : kWarpSize;
  static constexpr int kVecsPerLane = kVecsPerRow / kLanesPerRow;
  static constexpr int kRowsPerPass = kWarpSize / kLanesPerRow;                 // teams per warp
  static constexpr int kPasses = (MAX_KV + kRowsPerPass - 1) / kRowsPerPass;
  static constexpr int kRows = kPasses * kRowsPerPass;                         // score slots
  // Raw vectors per lane that one task's key and value rows take when held in registers.
  static constexpr int kTaskVecs = 2 * kPasses * kVecsPerLane;
  static_assert(D % kVec == 0 && kVecsPerRow % kLanesPerRow == 0, "head dim must fill whole vectors");
};

// A lane's slice of one head row: vectors sub, sub + kLanesPerRow, ...
template <ElementType ET, int D, int MAX_KV>
struct RowSlice {
  using G = Geometry<ET, D, MAX_KV>;
  float x[G::kVecsPerLane][G::kVec];

  __device__ __forceinline__ void load(const typename Element<ET>::Storage* row, int sub) {
#pragma unroll
    for (int t = 0; t < G::kVecsPerLane; ++t) load_vec<ET>(row + (sub + t * G::kLanesPerRow) * G::kVec, x[t]);
  }
  __device__ __forceinline__ void store(typename Element<ET>::Storage* row, int sub) const {
#pragma unroll
    for (int t = 0; t < G::kVecsPerLane; ++t) store_vec<ET>(row + (sub + t * G::kLanesPerRow) * G::kVec, x[t]);
  }
  __device__ __forceinline__ void fill(float value) {
#pragma unroll
    for (int t = 0; t < G::kVecsPerLane; ++t)
#pragma unroll
      for (int e = 0; e < G::kVec; ++e) x[t][e] = value;
  }
  __device__ __forceinline__ float dot(const RowSlice& other) const {
    float acc = 0.0f;
#pragma unroll
    for (int t = 0; t < G::kVecsPerLane; ++t)
#pragma unroll
      for (int e = 0; e < G::kVec; ++e) acc += x[t][e] * other.x[t][e];
    return acc;
  }
  // this += w * row, for a row slice held as raw vectors.
  __device__ __forceinline__ void add_scaled(float w, const uint4 (&raw)[G::kVecsPerLane]) {
#pragma unroll
    for (int t = 0; t < G::kVecsPerLane; ++t) {
      float r[G::kVec];
      unpack_vec<ET>(raw[t], r);
#pragma unroll
      for (int e = 0; e < G::kVec; ++e) x[t][e] += w * r[e];
    }
  }
  // this += w * row, reading the row's slice from memory.
  __device__ __forceinline__ void add_scaled(float w, const typename Element<ET>::Storage* row, int sub) {
    uint4 raw[G::kVecsPerLane];
#pragma unroll
    for (int t = 0; t < G::kVecsPerLane; ++t)
      raw[t] = *reinterpret_cast<const uint4*>(row + (sub + t * G::kLanesPerRow) * G::kVec);
    add_scaled(w, raw);
  }
  // The dot product with a row slice held as raw vectors (this lane's part).
  __device__ __forceinline__ float dot(const uint4 (&raw)[G::kVecsPerLane]) const {
    float acc = 0.0f;
#pragma unroll
    for (int t = 0; t < G::kVecsPerLane; ++t) {
      float r[G::kVec];
      unpack_vec<ET>(raw[t], r);
#pragma unroll
      for (int e = 0; e < G::kVec; ++e) acc += x[t][e] * r[e];
    }
    return acc;
  }
  // Sums the slices of all teams (lanes with the same `sub`).
  __device__ __forceinline__ void sum_across_teams() {
#pragma unroll
    for (int offset = G::kLanesPerRow; offset < kWarpSize; offset *= 2)
#pragma unroll
      for (int t = 0; t < G::kVecsPerLane; ++t)
#pragma unroll
        for (int e = 0; e < G::kVec; ++e) x[t][e] += warp_shfl_xor(x[t][e], offset);
  }
};

// Sums a per-lane partial within its team; every lane of the team gets the total.
template <int LANES_PER_ROW>
__device__ __forceinline__ float sum_within_team(float partial) {
#pragma unroll
  for (int offset = LANES_PER_ROW / 2; offset > 0; offset /= 2) partial += warp_shfl_xor(partial, offset);
  return partial;
}

// Everything a warp knows about its (query token, K/V head) task.
struct Task {
  int64_t token, b, i, kv_head, start;
  int32_t len;
  bool ok;
  int32_t live_rows;  // rows that may be read: len when ok, else 0
  uint32_t seed0, seed1;
  int64_t philox_b;
};

template <int MAX_KV>
__device__ __forceinline__ Task make_task(const SmallSeqParams& p, int64_t task_index, const int32_t* kv_start,
                                          const int32_t* kv_len, const uint32_t* seed) {
  Task t;
  t.token = task_index / p.kv_heads;
  t.kv_head = task_index % p.kv_heads;
  t.b = t.token / p.seqlen_q;
  t.i = t.token % p.seqlen_q;
  t.start = kv_start[t.token];
  t.len = kv_len[t.token];
  t.ok = small_seq_len_ok(t.len, p.max_keys) && t.len <= MAX_KV && t.start >= 0 &&
         t.start + t.len <= p.seqlen_kv;
  t.live_rows = t.ok ? t.len : 0;
  const int64_t seed_row = broadcast_row(t.b, p.batch, p.seed_rows);
  t.seed0 = seed[2 * seed_row];
  t.seed1 = seed[2 * seed_row + 1];
  t.philox_b = broadcast_inner(t.b, p.batch, p.seed_rows);
  return t;
}

template <ElementType ET, int D>
__device__ __forceinline__ const typename Element<ET>::Storage* kv_row(const typename Element<ET>::Storage* base,
                                                                       const SmallSeqParams& p, const Task& t,
                                                                       int64_t j) {
  return base + bshd_offset(t.b, t.start + j, t.kv_head, 0, p.seqlen_kv, p.kv_heads, D);
}

// The task's key (or value) rows of `base` as this lane sees them: row j = pass *
// kRowsPerPass + team, as raw vectors, zeros beyond the live rows. RESIDENT: the rows are
// loaded at construction, all loads in flight together, and every for_each reuses them.
// Otherwise each for_each streams them a batch of passes at a time (again all loads of a
// batch before any use), so a warp waits for memory once per batch instead of once per row.
template <ElementType ET, int D, int MAX_KV, bool RESIDENT>
class KeyRows {
  using G = Geometry<ET, D, MAX_KV>;
  using Storage = typename Element<ET>::Storage;
  using Raw = uint4[G::kVecsPerLane];

 public:
  __device__ __forceinline__ KeyRows(const Storage* base, const SmallSeqParams& p, const Task& t, int team,
                                     int sub)
      : base_(base), p_(p), t_(t), team_(team), sub_(sub) {
    if constexpr (RESIDENT) {
#pragma unroll
      for (int pass = 0; pass < G::kPasses; ++pass) load(pass, held_[pass]);
    }
  }

  // Calls f(pass, raw) for every pass.
  template <class F>
  __device__ __forceinline__ void for_each(F&& f) const {
    if constexpr (RESIDENT) {
#pragma unroll
      for (int pass = 0; pass < G::kPasses; ++pass) f(pass, held_[pass]);
    } else {
      // At most 16 raw vectors (64 registers) per lane in flight.
      constexpr int kBatch = G::kPasses < 16 / G::kVecsPerLane ? G::kPasses : 16 / G::kVecsPerLane;
#pragma unroll
      for (int first = 0; first < G::kPasses; first += kBatch) {
        uint4 raw[kBatch][G::kVecsPerLane];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          if (first + b < G::kPasses) load(first + b, raw[b]);
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          if (first + b < G::kPasses) f(first + b, raw[b]);
        }
      }
    }
  }

 private:
  __device__ __forceinline__ void load(int pass, Raw& raw) const {
    const int j = pass * G::kRowsPerPass + team_;
    const bool live = j < t_.live_rows;
    const Storage* row = kv_row<ET, D>(base_, p_, t_, live ? j : 0);
#pragma unroll
    for (int v = 0; v < G::kVecsPerLane; ++v) {
      raw[v] = live ? *reinterpret_cast<const uint4*>(row + (sub_ + v * G::kLanesPerRow) * G::kVec)
                    : make_uint4(0u, 0u, 0u, 0u);
    }
  }

  const Storage* base_;
  const SmallSeqParams& p_;
  const Task& t_;
  int team_, sub_;
  uint4 held_[RESIDENT ? G::kPasses : 1][G::kVecsPerLane];
};

// Values of one slot per team gathered into every lane: out[pass * kRowsPerPass + r] is
// the team-reduced `partial` of team r in that pass.
template <class G>
__device__ __forceinline__ void gather_team_values(float partial, int pass, float (&out)[G::kRows]) {
  partial = sum_within_team<G::kLanesPerRow>(partial);
#pragma unroll
  for (int r = 0; r < G::kRowsPerPass; ++r) out[pass * G::kRowsPerPass + r] = warp_shfl(partial, r * G::kLanesPerRow);
}

// Scaled scores s[j] = scale * q.k_j of the task's keys (0 beyond len), for every lane.
template <ElementType ET, int D, int MAX_KV, class Keys>
__device__ __forceinline__ void scores(const SmallSeqParams& p, const RowSlice<ET, D, MAX_KV>& q, const Keys& keys,
                                       float (&s)[Geometry<ET, D, MAX_KV>::kRows]) {
  using G = Geometry<ET, D, MAX_KV>;
  keys.for_each([&](int pass, const uint4 (&raw)[G::kVecsPerLane]) {
    gather_team_values<G>(q.dot(raw) * p.scale, pass, s);
  });
}

// Dropout factors of keys 0..kRows-1 for head h: lane j draws key j, then all lanes share.
// DRAW is false only without dropout; a template argument because the Philox registers
// would otherwise lower the occupancy of every call, dropout or not (see Plan).
template <bool DRAW, int ROWS>
__device__ __forceinline__ void dropout_factors(const SmallSeqParams& p, const Task& t, int64_t h, int lane,
                                                float (&f)[ROWS]) {
  static_assert(ROWS <= kWarpSize, "one lane per key");
  if constexpr (!DRAW) {
#pragma unroll
    for (int j = 0; j < ROWS; ++j) f[j] = 1.0f;
    return;
  }
  const float mine = lane < t.len ? small_seq_dropout_factor(p, t.seed0, t.seed1, t.philox_b, h, t.i, t.start + lane)
                                  : 0.0f;
#pragma unroll
  for (int j = 0; j < ROWS; ++j) f[j] = warp_shfl(mine, j);
}

// The score slot of this lane's team in a pass, selected without dynamic register indexing.
template <int ROWS_PER_PASS, int ROWS>
__device__ __forceinline__ float team_value(const float (&values)[ROWS], int pass, int team) {
  float w = 0.0f;
#pragma unroll
  for (int r = 0; r < ROWS_PER_PASS; ++r) w = team == r ? values[pass * ROWS_PER_PASS + r] : w;
  return w;
}

// Small blocks and an occupancy floor for the forward: the kernel is bound by how many
// loads are in flight, i.e. by warps per SM (at least 20 here, at most 102 registers).
constexpr int kForwardThreads = 128;
constexpr int kForwardMinBlocks = 5;
constexpr int kBackwardThreads = 128;
constexpr int kBackwardMinBlocks = 4;  // at least 16 warps per SM, at most 128 registers

// How the kernels treat a task, by the raw vectors per lane its key and value rows take;
// measured on the H200 (b=30720, h=16, bf16).
// - Whether KeyRows holds them in registers (RESIDENT). Forward: up to 4 (d=128, 2 and 4
//   keys: 0.40 -> 0.33 and 0.48 -> 0.45 ms); at 8 the registers cost as much as the loads
//   in flight gain, at 16 they spill. Backward, which reads the keys twice per head: up to
//   8 (its share of fwd+bwd 0.71 -> 0.57 ms at 2 keys, 1.88 -> 1.58 ms at 8); with dropout
//   the Philox registers make 8 spill.
// - Whether the backward is compiled to draw dropout factors (small_seq_dropout_factor then
//   tests p.dropout at run time). Beyond 16 (d 256 and 512 with 16 keys, d 512 with 8) ptxas
//   spills more without the draws than with them (d=256, 16 keys: 8.28 -> 9.04 ms fwd+bwd).
template <ElementType ET, int D, int MAX_KV, bool DROPOUT>
struct Plan {
  static constexpr int kTaskVecs = Geometry<ET, D, MAX_KV>::kTaskVecs;
  static constexpr bool kForwardResident = kTaskVecs <= 4;
  static constexpr bool kBackwardResident = kTaskVecs <= (DROPOUT ? 4 : 8);
  static constexpr bool kBackwardDraws = DROPOUT || kTaskVecs > 16;
};

template <ElementType ET, int D, int MAX_KV, bool DROPOUT>
__global__ void __launch_bounds__(kForwardThreads, kForwardMinBlocks)
    small_seq_forward(SmallSeqParams p, const typename Element<ET>::Storage* __restrict__ q,
                      const typename Element<ET>::Storage* __restrict__ k,
                      const typename Element<ET>::Storage* __restrict__ v, const int32_t* __restrict__ kv_start,
                      const int32_t* __restrict__ kv_len, const uint32_t* __restrict__ seed,
                      typename Element<ET>::Storage* __restrict__ o) {
  using G = Geometry<ET, D, MAX_KV>;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t task_index = static_cast<int64_t>(blockIdx.x) * (kForwardThreads / kWarpSize) + threadIdx.x / kWarpSize;
  if (task_index >= p.batch * p.seqlen_q * p.kv_heads) return;  // uniform per warp
  const int team = lane / G::kLanesPerRow, sub = lane % G::kLanesPerRow;
  const Task t = make_task<MAX_KV>(p, task_index, kv_start, kv_len, seed);
  using Rows = KeyRows<ET, D, MAX_KV, Plan<ET, D, MAX_KV, DROPOUT>::kForwardResident>;
  const Rows keys(k, p, t, team, sub), values(v, p, t, team, sub);
  const int64_t group = p.heads / p.kv_heads;
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = t.kv_head * group + g;
    const int64_t row = (t.token * p.heads + h) * D;
    RowSlice<ET, D, MAX_KV> acc;
    if (!t.ok) {
      acc.fill(NAN);
      if (team == 0) acc.store(o + row, sub);
      continue;
    }
    RowSlice<ET, D, MAX_KV> qs;
    qs.load(q + row, sub);
    float s[G::kRows];
    scores<ET, D, MAX_KV>(p, qs, keys, s);
    small_seq_softmax(s, t.len);
    float f[G::kRows];
    dropout_factors<DROPOUT>(p, t, h, lane, f);
    acc.fill(0.0f);
    values.for_each([&](int pass, const uint4 (&raw)[G::kVecsPerLane]) {
      acc.add_scaled(team_value<G::kRowsPerPass>(s, pass, team) * team_value<G::kRowsPerPass>(f, pass, team), raw);
    });
    acc.sum_across_teams();
    if (team == 0) acc.store(o + row, sub);
  }
}

template <ElementType ET, int D, int MAX_KV, bool DROPOUT>
__global__ void __launch_bounds__(kBackwardThreads, kBackwardMinBlocks)
    small_seq_backward(SmallSeqParams p, const typename Element<ET>::Storage* __restrict__ q,
                       const typename Element<ET>::Storage* __restrict__ k,
                       const typename Element<ET>::Storage* __restrict__ v, const int32_t* __restrict__ kv_start,
                       const int32_t* __restrict__ kv_len, const uint32_t* __restrict__ seed,
                       const typename Element<ET>::Storage* __restrict__ o,
                       const typename Element<ET>::Storage* __restrict__ dout,
                       typename Element<ET>::Storage* __restrict__ dq, typename Element<ET>::Storage* __restrict__ dk,
                       typename Element<ET>::Storage* __restrict__ dv) {
  using G = Geometry<ET, D, MAX_KV>;
  using Slice = RowSlice<ET, D, MAX_KV>;
  // Per warp: the scaled dS and the dropped P of every head of the group, [group][kRows] each.
  extern __shared__ float shared[];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t task_index = static_cast<int64_t>(blockIdx.x) * (kBackwardThreads / kWarpSize) + warp;
  if (task_index >= p.batch * p.seqlen_q * p.kv_heads) return;  // uniform per warp
  const int team = lane / G::kLanesPerRow, sub = lane % G::kLanesPerRow;
  const Task t = make_task<MAX_KV>(p, task_index, kv_start, kv_len, seed);
  using P = Plan<ET, D, MAX_KV, DROPOUT>;
  using Rows = KeyRows<ET, D, MAX_KV, P::kBackwardResident>;
  const Rows keys(k, p, t, team, sub), values(v, p, t, team, sub);
  const int64_t group = p.heads / p.kv_heads;
  float* ds_shared = shared + warp * group * G::kRows * 2;
  float* pd_shared = ds_shared + group * G::kRows;

  // Phase 1, per query head: dS and dq.
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = t.kv_head * group + g;
    const int64_t row = (t.token * p.heads + h) * D;
    Slice acc;
    if (!t.ok) {
      acc.fill(NAN);
      if (team == 0) acc.store(dq + row, sub);
      continue;
    }
    Slice qs, dos, os;
    qs.load(q + row, sub);
    dos.load(dout + row, sub);
    os.load(o + row, sub);
    const float delta = sum_within_team<G::kLanesPerRow>(dos.dot(os));  // rowsum(dO * O)
    float s[G::kRows];
    scores<ET, D, MAX_KV>(p, qs, keys, s);
    small_seq_softmax(s, t.len);
    float f[G::kRows];
    dropout_factors<P::kBackwardDraws>(p, t, h, lane, f);
    float dp[G::kRows];
    values.for_each([&](int pass, const uint4 (&raw)[G::kVecsPerLane]) {
      gather_team_values<G>(dos.dot(raw), pass, dp);
    });
    float ds[G::kRows];
#pragma unroll
    for (int j = 0; j < G::kRows; ++j) {
      ds[j] = s[j] * (dp[j] * f[j] - delta) * p.scale;
      if (lane == j) {
        ds_shared[g * G::kRows + j] = ds[j];
        pd_shared[g * G::kRows + j] = s[j] * f[j];
      }
    }
    acc.fill(0.0f);
    keys.for_each([&](int pass, const uint4 (&raw)[G::kVecsPerLane]) {
      acc.add_scaled(team_value<G::kRowsPerPass>(ds, pass, team), raw);
    });
    acc.sum_across_teams();
    if (team == 0) acc.store(dq + row, sub);
  }
  warp_sync();

  // Phase 2, per key row: dk and dv summed over the group's heads.
  const int32_t len = t.live_rows;
  for (int pass = 0; pass < G::kPasses; ++pass) {
    const int j = pass * G::kRowsPerPass + team;
    if (j >= len) continue;
    Slice dk_acc, dv_acc;
    dk_acc.fill(0.0f);
    dv_acc.fill(0.0f);
    for (int64_t g = 0; g < group; ++g) {
      const int64_t row = (t.token * p.heads + t.kv_head * group + g) * D;
      dk_acc.add_scaled(ds_shared[g * G::kRows + j], q + row, sub);
      dv_acc.add_scaled(pd_shared[g * G::kRows + j], dout + row, sub);
    }
    const int64_t offset = bshd_offset(t.b, t.start + j, t.kv_head, 0, p.seqlen_kv, p.kv_heads, D);
    dk_acc.store(dk + offset, sub);
    dv_acc.store(dv + offset, sub);
  }
  // With one query per row this warp owns every key row of its head: zero the rest.
  if (p.seqlen_q == 1) {
    Slice zero;
    zero.fill(0.0f);
    for (int64_t j = team; j < p.seqlen_kv; j += G::kRowsPerPass) {
      if (j >= t.start && j < t.start + len) continue;
      const int64_t offset = bshd_offset(t.b, j, t.kv_head, 0, p.seqlen_kv, p.kv_heads, D);
      zero.store(dk + offset, sub);
      zero.store(dv + offset, sub);
    }
  }
}

// ---- dispatch ------------------------------------------------------------------

// Calls f(element type, head dim, key bound, dropout) as compile-time constants.
template <typename F>
bool dispatch(ffi::DataType dtype, int64_t head_dim, int64_t max_keys, bool dropout, F&& f) {
  auto with_dropout = [&](auto et_tag, auto d_tag, auto n_tag) {
    if (dropout) return f(et_tag, d_tag, n_tag, std::true_type{});
    return f(et_tag, d_tag, n_tag, std::false_type{});
  };
  auto with_bound = [&](auto et_tag, auto d_tag) {
    if (max_keys <= 2) return with_dropout(et_tag, d_tag, std::integral_constant<int, 2>{}), true;
    if (max_keys <= 4) return with_dropout(et_tag, d_tag, std::integral_constant<int, 4>{}), true;
    if (max_keys <= 8) return with_dropout(et_tag, d_tag, std::integral_constant<int, 8>{}), true;
    return with_dropout(et_tag, d_tag, std::integral_constant<int, 16>{}), true;
  };
  auto with_dim = [&](auto et_tag) {
    switch (head_dim) {
      case 64: return with_bound(et_tag, std::integral_constant<int, 64>{});
      case 128: return with_bound(et_tag, std::integral_constant<int, 128>{});
      case 256: return with_bound(et_tag, std::integral_constant<int, 256>{});
      case 512: return with_bound(et_tag, std::integral_constant<int, 512>{});
      default: return false;
    }
  };
  return with_element_type(dtype, with_dim);
}

ffi::Error unsupported_head_dim(const char* op, int64_t d) {
  return invalid(op, "head dim must be 64, 128, 256 or 512, got " + std::to_string(d));
}

int64_t blocks_for(const SmallSeqParams& p, int threads) {
  const int64_t warps = threads / kWarpSize;
  return (p.batch * p.seqlen_q * p.kv_heads + warps - 1) / warps;
}

ffi::Error SmallSeqFwdImpl(gpuStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer kv_start, ffi::AnyBuffer kv_len, ffi::AnyBuffer seed,
                           ffi::Result<ffi::AnyBuffer> o, float scale, double dropout_rate, int64_t max_keys) {
  constexpr const char* kOp = "fusedattn_small_seq_fwd (" FA_FFI_PLATFORM ")";
  SmallSeqParams p;
  if (auto e = parse_small_seq_call(kOp, q, k, v, kv_start, kv_len, seed, scale, dropout_rate, max_keys, &p);
      e.failure()) {
    return e;
  }
  const int64_t blocks = blocks_for(p, kForwardThreads);
  if (blocks == 0) return ffi::Error::Success();
  const bool known = dispatch(q.element_type(), p.head_dim, p.max_keys, p.dropout,
                              [&](auto et, auto d, auto n, auto dropout) {
    constexpr ElementType kET = decltype(et)::value;
    small_seq_forward<kET, decltype(d)::value, decltype(n)::value, decltype(dropout)::value>
        <<<blocks, kForwardThreads, 0, stream>>>(p, elements<kET>(q), elements<kET>(k), elements<kET>(v),
                                                 kv_start.typed_data<int32_t>(), kv_len.typed_data<int32_t>(),
                                                 seed.typed_data<uint32_t>(), elements<kET>(o));
  });
  if (!known) return unsupported_head_dim(kOp, p.head_dim);
  return launch_status(kOp);
}

ffi::Error SmallSeqBwdImpl(gpuStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer kv_start, ffi::AnyBuffer kv_len, ffi::AnyBuffer seed, ffi::AnyBuffer o,
                           ffi::AnyBuffer dout, ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                           ffi::Result<ffi::AnyBuffer> dv, float scale, double dropout_rate, int64_t max_keys) {
  constexpr const char* kOp = "fusedattn_small_seq_bwd (" FA_FFI_PLATFORM ")";
  SmallSeqParams p;
  if (auto e = parse_small_seq_call(kOp, q, k, v, kv_start, kv_len, seed, scale, dropout_rate, max_keys, &p);
      e.failure()) {
    return e;
  }
  const int64_t group = p.heads / p.kv_heads;
  constexpr int64_t kMaxSharedBytes = 48 * 1024;
  const int64_t shared_bytes = (kBackwardThreads / kWarpSize) * group * kSmallSeqMaxKeys * 2 * sizeof(float);
  if (shared_bytes > kMaxSharedBytes) {
    return invalid(kOp, "at most " + std::to_string(kMaxSharedBytes / ((kBackwardThreads / kWarpSize) *
                                                                         kSmallSeqMaxKeys * 2 * sizeof(float))) +
                            " query heads per K/V head, got " + std::to_string(group));
  }
  if (p.seqlen_q != 1) {  // keys between segments belong to no query: zero them up front
    for (auto* buffer : {&dk, &dv}) {
      if (gpuMemsetAsync((*buffer)->untyped_data(), 0, (*buffer)->size_bytes(), stream) != gpuSuccess) {
        return launch_status(kOp);
      }
    }
  }
  const int64_t blocks = blocks_for(p, kBackwardThreads);
  if (blocks == 0) return ffi::Error::Success();
  const bool known = dispatch(q.element_type(), p.head_dim, p.max_keys, p.dropout,
                              [&](auto et, auto d, auto n, auto dropout) {
    constexpr ElementType kET = decltype(et)::value;
    small_seq_backward<kET, decltype(d)::value, decltype(n)::value, decltype(dropout)::value>
        <<<blocks, kBackwardThreads, shared_bytes, stream>>>(
            p, elements<kET>(q), elements<kET>(k), elements<kET>(v), kv_start.typed_data<int32_t>(),
            kv_len.typed_data<int32_t>(), seed.typed_data<uint32_t>(), elements<kET>(o), elements<kET>(dout),
            elements<kET>(dq), elements<kET>(dk), elements<kET>(dv));
  });
  if (!known) return unsupported_head_dim(kOp, p.head_dim);
  return launch_status(kOp);
}

}  // namespace
}  // namespace fusedattn

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnSmallSeqFwdGpu, fusedattn::SmallSeqFwdImpl,
                              fusedattn::bind_small_seq<fusedattn::Pass::kForward>(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<gpuStream_t>>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnSmallSeqBwdGpu, fusedattn::SmallSeqBwdImpl,
                              fusedattn::bind_small_seq<fusedattn::Pass::kBackward>(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<gpuStream_t>>()));
