// The AMX tile registers, for kernels on the Amx path (cpu_isa.h).
#pragma once

#include "cpu_isa.h"

#ifdef MOELAUNCH_HAS_AMX
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

#include "prefetch.h"

namespace moelaunch::amx {

// Every tile these kernels use has the largest shape: 16 rows of 64 bytes (32 bf16 or 16 fp32 values).
constexpr int kTileRows = 16;
constexpr int kTileRowBytes = 64;

// This thread's eight tile registers for one scope: their shapes loaded (ldtilecfg) on entry and the
// tiles released (tilerelease) on exit, so the OS stops saving their 8 KB at every context switch.
class Tiles {
 public:
  Tiles() {
    Config config{};
    config.palette = 1;
    for (int i = 0; i < 8; ++i) {
      config.bytes_per_row[i] = kTileRowBytes;
      config.rows[i] = kTileRows;
    }
    _tile_loadconfig(&config);
  }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;

 private:
  // The 64-byte layout ldtilecfg reads (palette 1: eight tiles).
  struct alignas(64) Config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
  };
};

// bf16 values per tile row, and 32-bit values (bf16 pairs, or fp32) in one tile.
constexpr int64_t kSlice = 32;
constexpr int64_t kTileValues = kTileRows * kTileRowBytes / 4;

// 32 bf16 values from p; fp32 ones rounded to bf16 on the way (to nearest even, as torch's conversion;
// vcvtne2ps2bf16 reads denormals as zero, which the tile products do anyway).
inline __m512i load_slice(const c10::BFloat16* p) { return _mm512_loadu_si512(p); }
inline __m512i load_slice(const float* p) {
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
}

// The 16 columns of a 16 x 16 block of 32-bit values, one row per vector in `rows` (overwritten), as 16
// vectors: interleaves of 32-bit, 64-bit and 128-bit units, 48 shuffles.
inline void transpose16(__m512 rows[16], __m512 columns[16]) {
  __m512* a = rows;
  __m512 b[16];
  for (int i = 0; i < 16; i += 2) {
    b[i] = _mm512_unpacklo_ps(a[i], a[i + 1]);
    b[i + 1] = _mm512_unpackhi_ps(a[i], a[i + 1]);
  }
  const auto pd = [](__m512 v) { return _mm512_castps_pd(v); };
  for (int i = 0; i < 16; i += 4) {
    a[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(b[i]), pd(b[i + 2])));
    a[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(b[i]), pd(b[i + 2])));
    a[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(b[i + 1]), pd(b[i + 3])));
    a[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(b[i + 1]), pd(b[i + 3])));
  }
  for (int i = 0; i < 16; i += 8) {
    for (int j = 0; j < 4; ++j) {
      b[i + j] = _mm512_shuffle_f32x4(a[i + j], a[i + j + 4], 0x88);
      b[i + j + 4] = _mm512_shuffle_f32x4(a[i + j], a[i + j + 4], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {
    columns[j] = _mm512_shuffle_f32x4(b[j], b[j + 8], 0x88);
    columns[j + 8] = _mm512_shuffle_f32x4(b[j], b[j + 8], 0xdd);
  }
}

// The same for a block in memory (row-major, 64-byte aligned).
inline void columns16(const float* block, __m512 columns[16]) {
  __m512 rows[16];
  for (int i = 0; i < 16; ++i) rows[i] = _mm512_load_ps(block + 16 * i);
  transpose16(rows, columns);
}

// Up to 16 rows as B tiles, one 64-byte slice of a row at a time (load(i, s): row i's slice s): per slice
// s, tile row j holds each source row's 32-bit element j of the slice, one source row per column (one
// 16 x 16 transpose per slice: scattering each row's elements into the columns took ~10 % of MLA decode);
// columns past `rows` are zeros.
template <class Load>
inline void pack_columns(int64_t rows, int64_t slices, const Load& load, uint32_t* tiles) {
  for (int64_t s = 0; s < slices; ++s) {
    __m512 slice_rows[kTileRows], columns[kTileRows];
    for (int64_t i = 0; i < kTileRows; ++i) {
      slice_rows[i] = i < rows ? _mm512_castsi512_ps(load(i, s)) : _mm512_setzero_ps();
    }
    transpose16(slice_rows, columns);
    for (int64_t j = 0; j < kTileRows; ++j) {
      _mm512_storeu_si512(tiles + s * kTileValues + j * kTileRows, _mm512_castps_si512(columns[j]));
    }
  }
}

// Up to 16 rows of k values (`rows` of them, row i at src + i * stride; bf16, or fp32 rounded to bf16) as
// B tiles of bf16 pairs: per 32-value slice s, tile row j holds each row's values 2j and 2j + 1 of the
// slice. k is a multiple of 32.
template <typename src_t>
inline void pack_pairs(const src_t* src, int64_t rows, int64_t stride, int64_t k, uint32_t* tiles) {
  pack_columns(rows, k / kSlice, [&](int64_t i, int64_t s) { return load_slice(src + i * stride + s * kSlice); },
               tiles);
}

// Bytes per tile row of 8-bit values, the int8 products' K slice.
constexpr int64_t kByteSlice = kTileRowBytes;

// Up to 16 rows of k bytes (row i at src + i * k) as B tiles of byte quads: per 64-byte slice, tile row j
// holds each row's bytes 4j..4j + 3. k is a multiple of 64.
inline void pack_quads(const uint8_t* src, int64_t rows, int64_t k, uint32_t* tiles) {
  pack_columns(rows, k / kByteSlice, [&](int64_t i, int64_t s) { return _mm512_loadu_si512(src + i * k + s * kByteSlice); },
               tiles);
}

// The tile multiplies of pair_products for bf16 pairs summed into fp32 (TDPBF16PS): sums 0 and 1 from the
// A tiles in registers 2 and 3 by B in 4 (even slices), or in 5 and 6 by B in 7 (odd ones). Literal
// register numbers: the intrinsics paste their arguments into the instruction's text.
struct Bf16Products {
  static void even() {
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 3, 4);
  }
  static void odd() {
    _tile_dpbf16ps(0, 5, 7);
    _tile_dpbf16ps(1, 6, 7);
  }
};

// Two products against the same packed B tiles, 16 x 16 sums each (fp32 for bf16 values, int32 for int8
// ones, as `Products` multiplies), stored at c0 and c1 (64-byte rows): C = sum over the 64-byte slices of
// A (16 rows from a0 or a1, a row `a_stride` bytes apart) x B (slice s at b + s * kTileValues). Tile
// registers are not renamed, so a load waits for the multiply reading its register: even slices use
// registers 2-4, odd ones 5-7, and the two sums (0 and 1) run at once (with one register set the
// multiplies waited on loads a third of the time). `prefetch`, when given, ticks once per two slices.
template <class Products = Bf16Products, typename value_t, typename sum_t>
inline void pair_products(const value_t* a0, const value_t* a1, int64_t a_stride, const uint32_t* b, int64_t slices,
                          sum_t* c0, sum_t* c1, SpreadPrefetcher* prefetch = nullptr) {
  const auto* rows0 = reinterpret_cast<const char*>(a0);
  const auto* rows1 = reinterpret_cast<const char*>(a1);
  _tile_zero(0);
  _tile_zero(1);
  int64_t s = 0;
  for (; s + 2 <= slices; s += 2) {
    if (prefetch) prefetch->tick();
    _tile_loadd(4, b + s * kTileValues, kTileRowBytes);
    _tile_loadd(2, rows0 + s * kTileRowBytes, a_stride);
    _tile_loadd(3, rows1 + s * kTileRowBytes, a_stride);
    Products::even();
    _tile_loadd(7, b + (s + 1) * kTileValues, kTileRowBytes);
    _tile_loadd(5, rows0 + (s + 1) * kTileRowBytes, a_stride);
    _tile_loadd(6, rows1 + (s + 1) * kTileRowBytes, a_stride);
    Products::odd();
  }
  if (s < slices) {
    _tile_loadd(4, b + s * kTileValues, kTileRowBytes);
    _tile_loadd(2, rows0 + s * kTileRowBytes, a_stride);
    _tile_loadd(3, rows1 + s * kTileRowBytes, a_stride);
    Products::even();
  }
  _tile_stored(0, c0, kTileRowBytes);
  _tile_stored(1, c1, kTileRowBytes);
}

}  // namespace moelaunch::amx

#endif
