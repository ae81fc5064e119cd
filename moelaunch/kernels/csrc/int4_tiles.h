// INT4 weights for groups with many rows, on the Amx path: each group's weight dequantized once
// per call to bf16 ((code - zero) * scale, rounded once), then multiplied on the bf16 tiles
// (grouped_linear_amx.h), x's rows rounded to bf16 as they pack them. Integer tile products would leave
// the tiles at every group of columns (128) to apply its scale, which costs more than the products; for
// few rows per group the vector kernel's 16-bit codes (int_linear_cpu.cpp) stay, as dequantizing each
// weight then costs more than its products. At 64 rows the vector kernel took 6x the bf16 weights' time.
#pragma once

#include "cpu_isa.h"

#ifdef MOELAUNCH_HAS_AMX
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "grouped_linear_amx.h"

namespace moelaunch::int4_tiles {

using BF16 = c10::BFloat16;

// Rows of a group from which the tiles take it: below, dequantizing its weight costs more than the
// vector kernel's products.
constexpr int64_t kRowsPerGroup = 8;

// tiled[g] = 1 for the groups the tiles take (rows offsets[g]..offsets[g + 1]), where the shape fits.
inline void mark(const int64_t* offsets, int64_t groups, int64_t n, int64_t k, uint8_t* tiled) {
  if (!grouped_amx::fits(n, k)) return;
  for (int64_t g = 0; g < groups; ++g) tiled[g] = offsets[g + 1] - offsets[g] >= kRowsPerGroup;
}

// w [n, k] bf16 = (code - zero) * scale for one group's packed [n, k / 2] and scale / zero [n, ng].
inline void dequantize(const uint8_t* packed, const float* scale, const uint8_t* zero, int64_t n, int64_t k,
                       int64_t gs, BF16* w) {
  const int64_t ng = (k + gs - 1) / gs;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const uint8_t* p = packed + row * (k / 2);
      BF16* out = w + row * k;
      for (int64_t grp = 0; grp < ng; ++grp) {
        const float s = scale[row * ng + grp];
        const int32_t z = zero[row * ng + grp];
        const int64_t c1 = std::min(k, (grp + 1) * gs);
        int64_t c = grp * gs;
        const __m512 vs = _mm512_set1_ps(s);
        const __m512i vz = _mm512_set1_epi32(z);
        for (; c + 16 <= c1; c += 16) {
          // 8 bytes as 16-bit lanes, each made [low nibble, high nibble]: 16 codes in column order.
          const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + c / 2)));
          const __m128i codes =
              _mm_or_si128(_mm_and_si128(bytes, _mm_set1_epi16(15)), _mm_slli_epi16(_mm_srli_epi16(bytes, 4), 8));
          const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(codes), vz)), vs);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
        }
        for (; c < c1; ++c) {
          const int code = c % 2 ? p[c / 2] >> 4 : p[c / 2] & 15;
          out[c] = BF16(static_cast<float>(code - z) * s);
        }
      }
    }
  });
}

// sums [T, n] fp32: per group marked in `tiled` (its rows offsets[g]..offsets[g + 1] of x [T, k]), x times
// its dequantized weight (packed [G, n, k / 2], scale / zero [G, n, ng]).
template <typename x_t>
void grouped_products(const x_t* x, const uint8_t* packed, const float* scale, const uint8_t* zero,
                      const int64_t* offsets, int64_t groups, int64_t n, int64_t k, int64_t gs, const uint8_t* tiled,
                      float* sums) {
  ++isa::amx_calls();
  const int64_t ng = (k + gs - 1) / gs;
  // Left uninitialized (new[] of a trivial type): every value is written before it is read, and zeroing a
  // dense layer's copy cost about as much as dequantizing it.
  const std::unique_ptr<BF16[]> w(new BF16[n * k]);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t m0 = offsets[g], rows = offsets[g + 1] - m0;
    if (!tiled[g]) continue;
    dequantize(packed + g * n * (k / 2), scale + g * n * ng, zero + g * n * ng, n, k, gs, w.get());
    const int64_t local[2] = {0, rows};
    grouped_amx::grouped_linear(x + m0 * k, w.get(), grouped_amx::Layout::grouped(local, 1, k, n), sums + m0 * n, n,
                                k, false);
  }
}

}  // namespace moelaunch::int4_tiles

#endif
