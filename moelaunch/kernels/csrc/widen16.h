// 16-lane fp32 loads for the widening paths on AVX-512: fp32 as stored, bf16 widened by a 16-bit shift,
// and a masked load for a tail (zero past n), so that a product over it adds nothing.
#pragma once

#include "cpu_isa.h"

#ifdef MOELAUNCH_HAS_AVX512
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace moelaunch::widen16 {

constexpr int64_t kStep = 16;

inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }

// v, pinned to a register here, as simd.h's in_register for 8 lanes: a value several FMAs read is
// otherwise reloaded as each one's memory operand, and a register tile becomes load-bound.
inline __m512 in_register(__m512 v) {
  asm("" : "+v"(v));
  return v;
}
inline __m512 load(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// p[0:n], n < kStep.
inline __m512 load_first(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
inline __m512 load_first(const c10::BFloat16* p, int64_t n) {
  const __m256i half = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// The lane sums of up to 16 vectors at once, [sum(v[0]), ..., sum(v[n-1]), 0...]: four levels of
// halving adds, each shuffle shared by two vectors (30 permutes and 15 adds for 16 sums). Inlined, so
// that a constant n folds the levels over zero vectors away and the inputs stay in registers.
__attribute__((always_inline)) inline __m512 lane_sums(const __m512* v, int n) {
  __m512 in[16];
  for (int i = 0; i < 16; ++i) in[i] = i < n ? v[i] : _mm512_setzero_ps();
  // Each level adds the two halves of every block of 2b lanes, x's blocks then y's: a vector that
  // held s partial sums of each of its vectors holds s / 2 of twice as many.
  auto by8 = [](__m512 x, __m512 y) {
    return __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  };
  auto by4 = [](__m512 x, __m512 y) {
    return __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  };
  auto by2 = [](__m512 x, __m512 y) {
    return __builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  };
  auto by1 = [](__m512 x, __m512 y) {
    return __builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  };
  __m512 halves[8], quarters[4], eighths[2];
  for (int i = 0; i < 8; ++i) halves[i] = by8(in[2 * i], in[2 * i + 1]);
  for (int i = 0; i < 4; ++i) quarters[i] = by4(halves[2 * i], halves[2 * i + 1]);
  for (int i = 0; i < 2; ++i) eighths[i] = by2(quarters[2 * i], quarters[2 * i + 1]);
  return by1(eighths[0], eighths[1]);
}

}  // namespace moelaunch::widen16

#endif
