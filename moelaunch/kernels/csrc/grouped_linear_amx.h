// Grouped linear through the AMX tiles: bf16 rows against bf16 weights (the Amx path, cpu_isa.h).
//
// Same contract and numerics as the vdpbf16ps path (fp32 sums of bf16 products). The product is taken
// transposed, C^T = W . X^T, so that the weight is read in place: each A tile is 16 weight rows x 32
// values loaded straight from the weight as stored ([N, K], rows a row's stride apart), and the x rows
// are the B tiles, packed once per call as value pairs (amx::pack_pairs), 16 rows per chunk. A group
// with 1 to 16 rows reads its weight once from memory whatever the count; the columns of a chunk past
// its rows are zeros whose sums are dropped. On the vdpbf16ps path each (row, weight row) pair ends in
// a horizontal sum of 16 lanes, which at 8-16 rows per expert cost as much as the products: here one
// tile multiply makes 16 x 16 sums of 32 products.
//
// Rows may be bf16 or fp32 (rounded to bf16 as they are packed: no converted copy of x), grouped in
// order or one group per head of x [R, H, K] (the absorbed MLA products; no transposed copy either).
//
// gated: each group's weight is [gate; up]; a tile of 16 gate rows and the matching 16 up rows run as
// one pair of products, and the SiLU epilogue reads both sums while they are in L1.
// K must be a multiple of 32 and the output width of 16 (DeepSeek-V3's shapes); others take vdpbf16ps.
#pragma once

#include "cpu_isa.h"

#ifdef MOELAUNCH_HAS_AMX
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "amx.h"
#include "prefetch.h"
#include "scratch.h"
#include "simd.h"

namespace moelaunch::grouped_amx {

using BF16 = c10::BFloat16;
constexpr int64_t kBlock = amx::kTileRows;  // weight rows per A tile, x rows per chunk (B tile columns)
// Output columns per task: 4 A tiles of 16 weight rows (gated: 32 gate rows and their 32 up rows).
constexpr int64_t kTaskColumns = 64;

inline bool fits(int64_t n_out, int64_t k) { return k % amx::kSlice == 0 && n_out % kBlock == 0; }

// sums [16 weight rows][16 chunk rows] (a C tile, 64-byte aligned) into out's first `rows` rows, columns
// 0..15. From 3 rows through one in-register transpose (the scalar copy took more time than the tile
// products of the per-head decode products, whose K is 64: 2 tile slices).
inline void store_transposed(const float* sums, int64_t rows, float* out, int64_t ldo) {
  if (rows <= 2) {
    for (int64_t m = 0; m < rows; ++m) {
      for (int64_t j = 0; j < kBlock; ++j) out[m * ldo + j] = sums[j * kBlock + m];
    }
    return;
  }
  __m512 columns[16];
  amx::columns16(sums, columns);
  for (int64_t m = 0; m < rows; ++m) _mm512_storeu_ps(out + m * ldo, columns[m]);
}

// Where each group's rows are: group g's `rows[g]` rows of x start at x_first[g] (values), x_stride
// apart, and its outputs at out_first[g], out_stride apart.
struct Layout {
  std::vector<int64_t> rows, x_first, out_first;
  int64_t x_stride = 0, out_stride = 0;

  // Rows grouped in order: group g's are rows offsets[g]..offsets[g+1] of x [T, k] and out [T, n_out].
  static Layout grouped(const int64_t* offsets, int64_t groups, int64_t k, int64_t n_out) {
    Layout l{{}, {}, {}, k, n_out};
    for (int64_t g = 0; g < groups; ++g) {
      l.rows.push_back(offsets[g + 1] - offsets[g]);
      l.x_first.push_back(offsets[g] * k);
      l.out_first.push_back(offsets[g] * n_out);
    }
    return l;
  }

  // One group per head: x [R, H, k] with strides (row_stride, head_stride, 1), out [R, H, n] contiguous.
  static Layout heads(int64_t rows, int64_t heads, int64_t row_stride, int64_t head_stride, int64_t n) {
    Layout l{std::vector<int64_t>(heads, rows), {}, {}, row_stride, heads * n};
    for (int64_t h = 0; h < heads; ++h) {
      l.x_first.push_back(h * head_stride);
      l.out_first.push_back(h * n);
    }
    return l;
  }
};

// Each group's rows (bf16, or fp32 rounded to bf16 when packed) times its weight (weight [G, n_total, K])
// into out fp32: n_out = n_total columns, or n_total / 2 when gated.
template <typename x_t>
void grouped_linear(const x_t* x, const BF16* weight, const Layout& layout, float* out, int64_t n_total, int64_t k,
                    bool gated) {
  const int64_t groups = static_cast<int64_t>(layout.rows.size());
  const int64_t slices = k / amx::kSlice;
  const int64_t chunk_values = slices * amx::kTileValues;  // 32-bit pairs in one chunk's B tiles
  // Chunk c of group g is its rows 16 c onward, packed at first_chunk[g] + c.
  std::vector<int64_t> first_chunk(groups + 1, 0);
  for (int64_t g = 0; g < groups; ++g) first_chunk[g + 1] = first_chunk[g] + (layout.rows[g] + kBlock - 1) / kBlock;
  Scratch<uint32_t> packed(first_chunk[groups] * chunk_values);
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t m = 0, c = first_chunk[g]; m < layout.rows[g]; m += kBlock, ++c) {
        amx::pack_pairs(x + layout.x_first[g] + m * layout.x_stride, std::min(kBlock, layout.rows[g] - m),
                        layout.x_stride, k, packed.data() + c * chunk_values);
      }
    }
  });

  const int64_t n_out = gated ? n_total / 2 : n_total;
  const int64_t tasks_per_group = (n_out + kTaskColumns - 1) / kTaskColumns;
  const int64_t a_stride = k * static_cast<int64_t>(sizeof(BF16));
  const int64_t ldo = layout.out_stride;
  at::parallel_for(0, groups * tasks_per_group, 1, [&](int64_t begin, int64_t end) {
    amx::Tiles tiles;
    alignas(64) float sums0[kBlock * kBlock], sums1[kBlock * kBlock], gated_sums[kBlock * kBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / tasks_per_group;
      const int64_t group_rows = layout.rows[g];
      if (group_rows == 0) continue;  // an idle expert's weight is never read
      const int64_t n_begin = (task % tasks_per_group) * kTaskColumns;
      const int64_t n_end = std::min(n_out, n_begin + kTaskColumns);
      const BF16* w = weight + g * n_total * k;
      const int64_t chunks = first_chunk[g + 1] - first_chunk[g];
      // Gated: gate rows n.. with up rows n_out + n..; plain: rows n.. with n + 16.. (the last tile of an
      // odd count pairs with itself, its second sums unused).
      const int64_t step = gated ? kBlock : 2 * kBlock;
      for (int64_t n = n_begin; n < n_end; n += step) {
        const bool second = !gated && n + kBlock < n_end;
        const BF16* a0 = w + n * k;
        const BF16* a1 = gated ? w + (n_out + n) * k : second ? a0 + kBlock * k : a0;
        // The next tiles' weight rows, spread over this one's multiplies: 16 or 32 rows read a slice at
        // a time are more streams than the hardware prefetcher follows.
        const int64_t ticks = chunks * ((slices + 1) / 2);
        const int64_t next = n + step < n_out ? std::min(step, n_out - n - step) : 0;
        SpreadPrefetcher next0(a0 + step * k, next * a_stride, ticks);
        SpreadPrefetcher next1(gated ? a1 + step * k : nullptr, gated ? next * a_stride : 0, ticks);
        // Chunks after the first find this weight tile in L1/L2.
        for (int64_t m = 0, c = first_chunk[g]; m < group_rows; m += kBlock, ++c) {
          const int64_t rows = std::min(kBlock, group_rows - m);
          amx::pair_products(a0, a1, a_stride, packed.data() + c * chunk_values, slices, sums0, sums1, &next0);
          if (gated) next1.tick();
          float* o = out + layout.out_first[g] + m * ldo + n;
          if (gated) {
            for (int64_t j = 0; j < kBlock; ++j) {
              silu_mul_row(sums0 + j * kBlock, sums1 + j * kBlock, kBlock, gated_sums + j * kBlock);
            }
            store_transposed(gated_sums, rows, o, ldo);
            continue;
          }
          store_transposed(sums0, rows, o, ldo);
          if (second) store_transposed(sums1, rows, o + kBlock, ldo);
        }
      }
    }
  });
}

}  // namespace moelaunch::grouped_amx

#endif
