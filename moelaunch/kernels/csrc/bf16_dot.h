// bf16 x bf16 dot products through vdpbf16ps (AVX512-BF16): one instruction multiplies 32 pairs of bf16
// values and adds each two adjacent products into one of 16 fp32 sums. The products of two bf16 values
// are exact in fp32 and the sums are fp32, as on the widening path (simd.h); the order of the additions
// differs, and the instruction reads denormal inputs as zero (bf16 activations and weights near 1e-38
// contribute nothing either way). Compiled only where the build targets the instructions (cpu_isa.h).
#pragma once

#include "cpu_isa.h"
#include "widen16.h"

#ifdef MOELAUNCH_HAS_AVX512_BF16
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace moelaunch::bf16 {

// bf16 values per vdpbf16ps operand.
constexpr int64_t kStep = 32;

inline __m512bh load(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }

// p[0:n] (n < kStep) with the lanes past n zero: a tail of K adds nothing to the sums.
inline __m512bh load_first(const c10::BFloat16* p, int64_t n) {
  return (__m512bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((uint64_t{1} << n) - 1), p);
}

// The lane sums of up to 16 vectors (widen16.h), shared with the 16-lane widening kernels.
using widen16::lane_sums;

// out[col] = acc[where col sits] * inv for col < c_dim, acc holding each chunk of 32 columns c..c+31 as
// two 16-lane vectors that vpunpck{l,h}wd of two bf16 rows fed: within each 128-bit lane L, vpunpcklwd
// takes columns c+8L..c+8L+3 into the first vector's lanes 4L..4L+3, vpunpckhwd columns c+8L+4..c+8L+7
// into the second's.
inline void write_interleaved_columns(const float* acc, float inv, int64_t c_dim, float* out) {
  const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second_half = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 scale = _mm512_set1_ps(inv);
  int64_t c = 0;
  for (; c + 32 <= c_dim; c += 32) {  // whole chunks: two permutes of the lo and hi vectors
    const __m512 lo = _mm512_loadu_ps(acc + c), hi = _mm512_loadu_ps(acc + c + 16);
    _mm512_storeu_ps(out + c, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first_half, hi), scale));
    _mm512_storeu_ps(out + c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second_half, hi), scale));
  }
  for (; c < c_dim; c += 32) {
    const float* lo = acc + c;
    const float* hi = lo + 16;
    for (int lane = 0; lane < 4; ++lane) {
      for (int i = 0; i < 4; ++i) {
        const int64_t col = c + 8 * lane + i;
        if (col < c_dim) out[col] = lo[4 * lane + i] * inv;
        if (col + 4 < c_dim) out[col + 4] = hi[4 * lane + i] * inv;
      }
    }
  }
}

}  // namespace moelaunch::bf16

#endif
