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

}  // namespace moelaunch::widen16

#endif
