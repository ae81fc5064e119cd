// Eight-lane fp32 vectors through GCC/Clang vector extensions: the compiler maps them to one AVX register
// under -march=native on AVX machines and to pairs of SSE registers elsewhere, so the kernels need no
// per-ISA intrinsics. Loads are unaligned-safe (memcpy); bf16 is widened by a 16-bit shift.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace moelaunch {

constexpr int64_t kLanes = 8;
using vec8 = float __attribute__((vector_size(32)));
using u16x8 = uint16_t __attribute__((vector_size(16)));
using u32x8 = uint32_t __attribute__((vector_size(32)));
using i32x8 = int32_t __attribute__((vector_size(32)));
// Sixteen lanes, for kernels that keep one value per attention head of a 16-head group.
using vec16 = float __attribute__((vector_size(64)));
using i32x16 = int32_t __attribute__((vector_size(64)));
using u32x16 = uint32_t __attribute__((vector_size(64)));

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vec8 load8(const c10::BFloat16* p) {
  u16x8 half;
  std::memcpy(&half, p, sizeof half);
  const u32x8 wide = __builtin_convertvector(half, u32x8) << 16;
  vec8 v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

// v, pinned to a register at this point. GCC otherwise turns a loaded value used by several FMAs back
// into one memory operand per FMA, which doubles a register tile's loads and leaves it load-bound.
inline vec8 in_register(vec8 v) {
#if defined(__AVX__)  // a 32-byte vector fits one x86 register only with AVX
  asm("" : "+x"(v));
#endif
  return v;
}

inline void store8(float* p, vec8 v) { std::memcpy(p, &v, sizeof v); }

inline float hsum(vec8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// The lane sums of up to eight vectors at once, [sum(v[0]), ..., sum(v[n-1]), 0...]: three levels of
// pairwise adds share each shuffle between vectors, about a third of the work of n separate sums.
inline vec8 lane_sums(const vec8* v, int n) {
  vec8 in[8];
  for (int i = 0; i < 8; ++i) in[i] = i < n ? v[i] : vec8{};
  // pairs(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7]
  auto pairs = [](vec8 a, vec8 b) {
    return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
  };
  // quarter sums: [v0 low half, v1 low, v2 low, v3 low, v0 high half, v1 high, v2 high, v3 high]
  const vec8 q0123 = pairs(pairs(in[0], in[1]), pairs(in[2], in[3]));
  const vec8 q4567 = pairs(pairs(in[4], in[5]), pairs(in[6], in[7]));
  return __builtin_shufflevector(q0123, q4567, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(q0123, q4567, 4, 5, 6, 7, 12, 13, 14, 15);
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// e^x for x <= 0 (softmax weights after subtracting the max), relative error ~2e-7: x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its Taylor series to degree 7, 2^n built in the exponent bits. Below -87 the
// result is clamped to ~1e-38 instead of flushing to zero, which no softmax sum can notice. V is a float
// vector type, I and U the int32 and uint32 vectors of its width.
template <typename V, typename I, typename U>
inline V exp_lanes(V x) {
  constexpr float kLog2e = 1.44269504f, kLn2 = 0.69314718f;
  x = x < -87.f ? -87.f : x;
  const V t = x * kLog2e + 0.5f;
  V n = __builtin_convertvector(__builtin_convertvector(t, I), V);  // toward zero
  n = n > t ? n - 1.f : n;                                           // floor: round to nearest
  const V r = x - n * kLn2;
  V p = r * (1.f / 5040.f) + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const U bits = __builtin_convertvector(__builtin_convertvector(n, I) + 127, U) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline vec8 exp8(vec8 x) { return exp_lanes<vec8, i32x8, u32x8>(x); }
inline vec16 exp16(vec16 x) { return exp_lanes<vec16, i32x16, u32x16>(x); }

// v rounded to bf16 (to nearest, ties to even; finite values), stored.
inline void store8(c10::BFloat16* p, vec8 v) {
  u32x8 bits;
  std::memcpy(&bits, &v, sizeof bits);
  const u16x8 half = __builtin_convertvector((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16, u16x8);
  std::memcpy(p, &half, sizeof half);
}

// o[0:n] = silu(g[0:n]) * u[0:n], sigmoid(g) from e^-|g| (never overflows): 1 / (1 + e) for g >= 0,
// e / (1 + e) below. One definition for the SiLU gate kernel and the grouped GEMM's gated epilogue.
// T, O: float, or bf16 (widened, computed in fp32, the product rounded once).
template <typename T, typename O = T>
inline void silu_mul_row(const T* g, const T* u, int64_t n, O* o) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vec8 v = load8(g + i);
    const vec8 e = exp8(v < 0.f ? v : -v);
    const vec8 sig = (v < 0.f ? e : vec8{} + 1.f) / (e + 1.f);
    store8(o + i, v * sig * load8(u + i));
  }
  for (; i < n; ++i) {
    const float gi = to_float(g[i]);
    o[i] = O(gi / (1.f + std::exp(-gi)) * to_float(u[i]));
  }
}

}  // namespace moelaunch
