// INT8 weights through the AMX-INT8 tiles (TDPBSSD / TDPBSUD), for calls with many rows (the Amx path,
// cpu_isa.h): the vector kernels' integer products (int_linear_cpu.cpp) 16 x 16 x 64 at a time, where
// at 64 rows they ran 5x slower than the bf16 weights' tiles.
//
// As grouped_linear_amx.h, the product is taken transposed, C^T = W . X^T: each A tile is 16 weight rows x
// 64 bytes read in place from the int8 weight ([N, K]), and x's integer codes are the B tiles, packed once
// per call as byte quads (amx::pack_quads), 16 rows per chunk. The codes are the vector kernels':
// - W8A8: x's int8 codes (signed), one product (TDPBSSD);
// - weight-only INT8: x's 16-bit codes split into a signed high byte and an unsigned low byte,
//   code = 256 * high + low, two products (TDPBSSD, TDPBSUD) summed exactly per K slice.
// The int32 sums cannot overflow below K = 65536. K must be a multiple of 64 and N of 16.
#pragma once

#include "cpu_isa.h"

#if defined(MOELAUNCH_HAS_AMX) && defined(__AMX_INT8__)
#define MOELAUNCH_HAS_AMX_INT8 1
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "amx.h"
#include "scratch.h"

namespace moelaunch::int_amx {

constexpr int64_t kBlock = amx::kTileRows;  // weight rows per A tile, x rows per chunk
constexpr int64_t kTaskColumns = 64;        // output columns per parallel task

inline bool fits(int64_t n, int64_t k) { return k % amx::kByteSlice == 0 && n % kBlock == 0; }

// x's codes as byte planes [T, K]: one (W8A8's int8 codes) or two (the 16-bit codes' high bytes, signed,
// then low bytes, unsigned), and each row's scale.
struct Codes {
  const uint8_t* planes[2];
  bool split;
  const float* scale;
};

// amx::pair_products' tile multiplies for signed int8 quads summed into int32 (TDPBSSD), in the registers
// of amx::Bf16Products: W8A8's two weight tiles against the same int8 codes.
struct Int8Products {
  static void even() {
    _tile_dpbssd(0, 2, 4);
    _tile_dpbssd(1, 3, 4);
  }
  static void odd() {
    _tile_dpbssd(0, 5, 7);
    _tile_dpbssd(1, 6, 7);
  }
};

// As amx::pair_products for split codes: four sums, c[0] = A0 . B_high, c[1] = A0 . B_low (unsigned B),
// c[2] = A1 . B_high, c[3] = A1 . B_low; four chains, so the registers need no second set of operands
// (one weight tile's two chains a time ran at half this speed).
inline void split_pair_products(const int8_t* a0, const int8_t* a1, int64_t a_stride, const uint32_t* const* b,
                                int64_t slices, int32_t* const* c) {
  constexpr int64_t kValues = amx::kTileValues, kRow = amx::kTileRowBytes, kSlice = amx::kByteSlice;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < slices; ++s) {
    _tile_loadd(4, a0 + s * kSlice, a_stride);
    _tile_loadd(5, a1 + s * kSlice, a_stride);
    _tile_loadd(6, b[0] + s * kValues, kRow);
    _tile_loadd(7, b[1] + s * kValues, kRow);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbsud(1, 4, 7);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbsud(3, 5, 7);
  }
  _tile_stored(0, c[0], kRow);
  _tile_stored(1, c[1], kRow);
  _tile_stored(2, c[2], kRow);
  _tile_stored(3, c[3], kRow);
}

// sums [T, n_total] fp32: per group (rows offsets[g]..offsets[g + 1]), x's codes times q[g] ([n_total, K]
// int8), then x's row scale and the weight's channel scale w_scale[g] ([n_total]).
template <bool kSplit>
void grouped_products(const Codes& x, const int8_t* q, const float* w_scale, const int64_t* offsets,
                      int64_t groups, int64_t n_total, int64_t k, float* out) {
  ++isa::amx_calls();
  const int64_t slices = k / amx::kByteSlice;
  const int64_t chunk_values = slices * amx::kTileValues;
  const int planes = kSplit ? 2 : 1;
  // Chunk c of group g is its rows 16 c onward, packed at first_chunk[g] + c in each plane.
  std::vector<int64_t> first_chunk(groups + 1, 0);
  for (int64_t g = 0; g < groups; ++g) {
    first_chunk[g + 1] = first_chunk[g] + (offsets[g + 1] - offsets[g] + kBlock - 1) / kBlock;
  }
  Scratch<uint32_t> packed(planes * first_chunk[groups] * chunk_values);
  const int64_t plane_values = first_chunk[groups] * chunk_values;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t m = offsets[g], c = first_chunk[g]; m < offsets[g + 1]; m += kBlock, ++c) {
        for (int p = 0; p < planes; ++p) {
          amx::pack_quads(x.planes[p] + m * k, std::min(kBlock, offsets[g + 1] - m), k,
                          packed.data() + p * plane_values + c * chunk_values);
        }
      }
    }
  });

  const int64_t tasks_per_group = (n_total + kTaskColumns - 1) / kTaskColumns;
  at::parallel_for(0, groups * tasks_per_group, 1, [&](int64_t begin, int64_t end) {
    amx::Tiles tiles;
    alignas(64) int32_t sums[4][kBlock * kBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / tasks_per_group;
      const int64_t m0 = offsets[g], m1 = offsets[g + 1];
      if (m0 == m1) continue;  // an idle expert's weight is never read
      const int64_t n_begin = (task % tasks_per_group) * kTaskColumns;
      const int64_t n_end = std::min(n_total, n_begin + kTaskColumns);
      // Two weight tiles at a time, rows n.. and n + 16.. (the last of an odd count pairs with itself, its
      // second sums unused).
      for (int64_t n = n_begin; n < n_end; n += 2 * kBlock) {
        const bool second = n + kBlock < n_end;
        const int8_t* a0 = q + (g * n_total + n) * k;
        const int8_t* a1 = second ? a0 + kBlock * k : a0;
        const float* ws = w_scale + g * n_total + n;
        for (int64_t m = m0, c = first_chunk[g]; m < m1; m += kBlock, ++c) {
          const uint32_t* b[2] = {packed.data() + c * chunk_values, packed.data() + plane_values + c * chunk_values};
          if constexpr (kSplit) {
            int32_t* out4[4] = {sums[0], sums[1], sums[2], sums[3]};
            split_pair_products(a0, a1, k, b, slices, out4);
          } else {
            amx::pair_products<Int8Products>(a0, a1, k, b[0], slices, sums[0], sums[2]);
          }
          for (int64_t r = 0; r < std::min(kBlock, m1 - m); ++r) {
            const float xs = x.scale[m + r];
            float* row = out + (m + r) * n_total + n;
            for (int t = 0; t < (second ? 2 : 1); ++t) {
              for (int64_t j = 0; j < kBlock; ++j) {
                const int64_t at = j * kBlock + r;  // C^T: weight row j, x row r
                // Split: 256 * high + low is the exact dot, rounded once as the vector kernels' float(dot).
                const float dot = kSplit ? 256.f * static_cast<float>(sums[2 * t][at]) + static_cast<float>(sums[2 * t + 1][at])
                                         : static_cast<float>(sums[2 * t][at]);
                row[t * kBlock + j] = dot * xs * ws[t * kBlock + j];
              }
            }
          }
        }
      }
    }
  });
}

}  // namespace moelaunch::int_amx

#endif
