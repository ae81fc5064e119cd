// Integer-weight linear layers on the CPU, reading the quantized weights as stored:
// out[rows of group g] = x[rows of group g] @ W[g]^T, with W[g] one of
// - INT8 per output channel (weight-only): W = q * scale[n];
// - INT4 in groups of input columns with zero points (weight-only): W = (q - zero) * scale per group,
//   two codes per byte (low nibble = even column);
// - W8A8: x quantized per row to int8 here (the reference's rounding), then both scales.
// Every product is an integer one: x's rows become integer codes first (W8A8: int8, amax / 127; the
// weight-only methods: 16-bit fixed point, amax / 32767, whose error, at most amax / 65534 a value, is
// far under bf16's own rounding of a row's largest values). Widening every weight to fp32 instead cost
// more instructions than the weight's bytes saved (INT8 ran slower than bf16, issue 30). The paths:
// - AVX-512: vpdpwssd (AVX512-VNNI, 16-bit pairs summed into int32; INT4 codes unpacked to 16 bits less
//   their zero point) and vpdpbusd for W8A8 (unsigned x + 128 by signed weights, less 128 * sum(w));
// - AVX2: vpmaddwd (16-bit pairs) for all three;
// - scalar: plain integer C++;
// and on the Amx path INT8 and W8A8 calls of 16 rows or more run on the AMX-INT8 tiles (int_linear_amx.h),
// INT4 groups of 8 rows or more on the bf16 tiles after dequantizing their weight (int4_tiles.h).
// int32 lanes sum at most kChunk columns (W8A8, INT8) or one INT4 group before they are widened, so no
// sum can overflow. Decode reads each weight once: half (INT8) or a quarter (INT4) of bf16's bytes. Tiles
// of 3 weight rows x up to 4 input rows let each weight load feed several rows; groups without rows
// (idle experts) never touch their weights. `gated` ([gate; up] stacks) applies silu(gate) * up to each
// task's columns while they are in cache; the result is in x's dtype (fp32 or bf16, rounded once).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_isa.h"
#include "int4_tiles.h"
#include "int_linear_amx.h"
#include "prefetch.h"
#include "simd.h"

namespace {

namespace isa = moelaunch::isa;
#ifdef MOELAUNCH_HAS_AMX_INT8
namespace int_amx = moelaunch::int_amx;
#endif
#ifdef MOELAUNCH_HAS_AMX
namespace int4_tiles = moelaunch::int4_tiles;
#endif
using moelaunch::silu_mul_row;
using moelaunch::SpreadPrefetcher;

constexpr int kWeightTile = 3;
// Decode's one or two rows take twice the weight rows a tile: each (row, weight row) is one chain of
// dependent dot-product instructions (5 cycles each), and 3 chains left the core waiting on them.
constexpr int kFewRows = 2;
constexpr int kFewRowsWeightTile = 6;
constexpr int kRowTile = 4;
constexpr int64_t kTaskWeightRows = 60;  // weight rows per parallel task, a multiple of both weight tiles
// Columns an int32 lane sums before it is widened: 2048 / 16 vpmaddwd steps of 2 * 32767 * 128 < 2^31.
constexpr int64_t kChunk = 2048;
constexpr float kCodes16 = 32767.f;
constexpr float kCodes8 = 127.f;

// Weight rows up to this many bytes get the next tile prefetched: the hardware prefetcher follows long
// rows by itself but falls behind NR interleaved short streams (as in grouped_linear_cpu.cpp).
constexpr int64_t kPrefetchRowBytes = 4096;

// Runs kern.tile<MR, NR>(g, m, n, out, prefetch) over rows [m0, m1) of group g against weight rows
// [n, n + NR), while the next NR weight rows are prefetched, spread over the tiles' vector steps.
template <int NR, class Kern>
void rows_of(const Kern& kern, int64_t g, int64_t m0, int64_t m1, int64_t n, float* out) {
  SpreadPrefetcher prefetch;
  if (kern.row_bytes() <= kPrefetchRowBytes) {
    const int64_t passes = (m1 - m0 + kRowTile - 1) / kRowTile;
    prefetch = SpreadPrefetcher(kern.weight_rows_at(g, n + NR), NR * kern.row_bytes(), passes * kern.steps());
  }
  int64_t m = m0;
  for (; m + kRowTile <= m1; m += kRowTile) kern.template tile<kRowTile, NR>(g, m, n, out, prefetch);
  switch (m1 - m) {
    case 3:
      kern.template tile<3, NR>(g, m, n, out, prefetch);
      break;
    case 2:
      kern.template tile<2, NR>(g, m, n, out, prefetch);
      break;
    case 1:
      kern.template tile<1, NR>(g, m, n, out, prefetch);
      break;
    default:
      break;
  }
}

template <class Kern>
void weight_rows(const Kern& kern, int64_t g, int64_t m0, int64_t m1, int64_t n0, int64_t n1, float* out) {
  int64_t n = n0;
  if (m1 - m0 <= kFewRows) {
    for (; n + kFewRowsWeightTile <= n1; n += kFewRowsWeightTile) rows_of<kFewRowsWeightTile>(kern, g, m0, m1, n, out);
  }
  for (; n + kWeightTile <= n1; n += kWeightTile) rows_of<kWeightTile>(kern, g, m0, m1, n, out);
  for (; n < n1; ++n) rows_of<1>(kern, g, m0, m1, n, out);
}

// fp32 sums of [T, n_total] into out [T, n_out] of type O; gated: out = silu(gate) * up, n_out = n_total / 2.
template <typename O>
struct Sink {
  O* out;
  float* sums;  // [T, n_total]
  int64_t n_total;
  bool gated;
  bool direct;  // sums is out (fp32, not gated): nothing to finish

  void finish(int64_t m0, int64_t m1, int64_t n0, int64_t n1) const {
    if (direct) return;
    const int64_t n_out = gated ? n_total / 2 : n_total;
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = sums + m * n_total;
      if (gated) {
        silu_mul_row(row + n0, row + n_out + n0, n1 - n0, out + m * n_out + n0);
      } else {
        for (int64_t n = n0; n < n1; ++n) out[m * n_out + n] = O(row[n]);
      }
    }
  }
};

// Every (group, chunk of output columns) with rows as one parallel task; a gated task takes gate columns
// [n0, n1) and the up columns that pair with them. Groups marked in `skip` (another kernel's) are left.
template <class Kern, typename O>
void run_grouped(const Kern& kern, const int64_t* offsets, int64_t groups, const Sink<O>& sink,
                 const uint8_t* skip) {
  const int64_t n_out = sink.gated ? sink.n_total / 2 : sink.n_total;
  const int64_t tile = sink.gated ? kTaskWeightRows / 2 : kTaskWeightRows;
  const int64_t tasks_per_group = (n_out + tile - 1) / tile;
  at::parallel_for(0, groups * tasks_per_group, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / tasks_per_group;
      const int64_t m0 = offsets[g], m1 = offsets[g + 1];
      if (m0 == m1 || (skip != nullptr && skip[g])) continue;
      const int64_t n0 = (task % tasks_per_group) * tile, n1 = std::min(n_out, n0 + tile);
      weight_rows(kern, g, m0, m1, n0, n1, sink.sums);
      if (sink.gated) weight_rows(kern, g, m0, m1, n_out + n0, n_out + n1, sink.sums);
      sink.finish(m0, m1, n0, n1);
    }
  });
}

#ifdef MOELAUNCH_HAS_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
#endif

// The rows' codes are made on every call, from up to thousands of rows (prompts): vectorized where the
// path has AVX-512, in the same fp32 operations as the scalar loops.
template <typename T>
float amax_of(const T* row, int64_t k) {
  float amax = 0.f;
  int64_t t = 0;
#ifdef MOELAUNCH_HAS_AVX512
  __m512 lanes = _mm512_setzero_ps();
  for (; t + 16 <= k; t += 16) lanes = _mm512_max_ps(lanes, _mm512_abs_ps(load16(row + t)));
  amax = _mm512_reduce_max_ps(lanes);
#endif
  for (; t < k; ++t) amax = std::max(amax, std::fabs(static_cast<float>(row[t])));
  return amax;
}

// codes[t] = clamp(nearbyint(row[t] / s), -limit, limit) (round half to even), int8 or int16.
template <typename T, typename C>
void quantize_row(const T* row, int64_t k, float s, float limit, C* codes) {
  int64_t t = 0;
#ifdef MOELAUNCH_HAS_AVX512
  const __m512 step = _mm512_set1_ps(s), lo = _mm512_set1_ps(-limit), hi = _mm512_set1_ps(limit);
  for (; t + 16 <= k; t += 16) {
    const __m512 v = _mm512_roundscale_ps(_mm512_div_ps(load16(row + t), step), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i i = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, lo), hi));
    if constexpr (sizeof(C) == 1) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + t), _mm512_cvtsepi32_epi8(i));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + t), _mm512_cvtsepi32_epi16(i));
    }
  }
#endif
  for (; t < k; ++t) codes[t] = static_cast<C>(std::clamp(std::nearbyint(static_cast<float>(row[t]) / s), -limit, limit));
}

// x's rows as 16-bit codes (x ~ code * scale[r]); `block` > 1 stores each whole block of `block` columns
// inside a group of `group` as its even columns, then its odd ones (the INT4 kernel's nibble order).
struct Rows16 {
  std::vector<int16_t> codes;
  std::vector<float> scale;

  template <typename T>
  Rows16(const T* x, int64_t rows, int64_t k, int64_t group = 1, int64_t block = 1)
      : codes(rows * k), scale(rows) {
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = x + r * k;
      const float s = std::max(amax_of(row, k), 1e-30f) / kCodes16;
      scale[r] = s;
      int16_t* out = codes.data() + r * k;
      quantize_row(row, k, s, kCodes16, out);
      if (block == 1) continue;
      std::vector<int16_t> natural(out, out + k);
      for (int64_t g0 = 0; g0 < k; g0 += group) {
        for (int64_t c = g0; c + block <= std::min(k, g0 + group); c += block) {
          for (int64_t l = 0; l < block / 2; ++l) {
            out[c + l] = natural[c + 2 * l];
            out[c + block / 2 + l] = natural[c + 2 * l + 1];
          }
        }
      }
    }
  }

  // The codes as two byte planes [T, K] one after the other: high bytes (signed), then low bytes
  // (unsigned), code = 256 * high + low (the AMX tiles multiply bytes).
  std::vector<uint8_t> byte_planes() const {
    const size_t n = codes.size();
    std::vector<uint8_t> planes(2 * n);
    for (size_t i = 0; i < n; ++i) {
      planes[i] = static_cast<uint8_t>(codes[i] >> 8);
      planes[n + i] = static_cast<uint8_t>(codes[i] & 0xff);
    }
    return planes;
  }
};

#ifdef MOELAUNCH_HAS_AVX512
int64_t reduce_i32(__m512i v) {
  return _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(v)),
                                                  _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1))));
}
#endif
#ifdef MOELAUNCH_HAS_AVX2
int64_t reduce_i32(__m256i v) {
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
  int64_t s = 0;
  for (int32_t l : lanes) s += l;
  return s;
}

float reduce_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// INT8 weight-only: sum_k code16[r][k] * q[n][k] exactly, then * x scale * channel scale.
template <isa::Path P>
struct Int8Kernel {
  const int16_t* x16;  // [T, K]
  const float* x_scale;
  const int8_t* q;  // [G, N, K]
  const float* scale;  // [G, N]
  int64_t n_total, k;

  const int8_t* weight_rows_at(int64_t g, int64_t n) const { return q + (g * n_total + n) * k; }
  int64_t row_bytes() const { return k; }
  int64_t steps() const { return k / (P == isa::kAvx512 ? 32 : 16); }  // of the vector loop below

  template <int MR, int NR>
  void tile(int64_t g, int64_t m, int64_t n, float* out, SpreadPrefetcher& prefetch) const {
    const int8_t* w = q + (g * n_total + n) * k;
    const int16_t* xm = x16 + m * k;
    int64_t dots[MR][NR] = {};
    int64_t i = 0;
#ifdef MOELAUNCH_HAS_AVX512
    if constexpr (P == isa::kAvx512) {
      while (i + 32 <= k) {
        const int64_t end = std::min(k, i + kChunk);
        __m512i acc[MR][NR];
        for (auto& row : acc)
          for (auto& a : row) a = _mm512_setzero_si512();
        for (; i + 32 <= end; i += 32) {
          prefetch.tick();
          __m512i wv[NR];
          for (int j = 0; j < NR; ++j) {
            wv[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * k + i)));
          }
          for (int r = 0; r < MR; ++r) {
            const __m512i xv = _mm512_loadu_si512(xm + r * k + i);
            for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_dpwssd_epi32(acc[r][j], xv, wv[j]);
          }
        }
        for (int r = 0; r < MR; ++r)
          for (int j = 0; j < NR; ++j) dots[r][j] += reduce_i32(acc[r][j]);
      }
    }
#endif
#ifdef MOELAUNCH_HAS_AVX2
    if constexpr (P == isa::kAvx2) {
      while (i + 16 <= k) {
        const int64_t end = std::min(k, i + kChunk);
        __m256i acc[MR][NR];
        for (auto& row : acc)
          for (auto& a : row) a = _mm256_setzero_si256();
        for (; i + 16 <= end; i += 16) {
          prefetch.tick();
          __m256i wv[NR];
          for (int j = 0; j < NR; ++j) {
            wv[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * k + i)));
          }
          for (int r = 0; r < MR; ++r) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm + r * k + i));
            for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_add_epi32(acc[r][j], _mm256_madd_epi16(xv, wv[j]));
          }
        }
        for (int r = 0; r < MR; ++r)
          for (int j = 0; j < NR; ++j) dots[r][j] += reduce_i32(acc[r][j]);
      }
    }
#endif
    for (int r = 0; r < MR; ++r) {
      for (int j = 0; j < NR; ++j) {
        int64_t d = dots[r][j];
        for (int64_t t = i; t < k; ++t) d += int64_t{xm[r * k + t]} * w[j * k + t];
        out[(m + r) * n_total + n + j] = static_cast<float>(d) * x_scale[m + r] * scale[g * n_total + n + j];
      }
    }
  }
};

// The columns one INT4 vector step covers (half as many packed bytes).
constexpr int64_t int4_block(isa::Path p) { return p == isa::kAvx512 ? 64 : p == isa::kAvx2 ? 32 : 1; }

// INT4 weight-only: per group of `gs` columns, sum (code - zero) * code16 exactly, then * the group's scale;
// the groups' sums in fp32, then * x's scale. x16 holds each whole block of B columns (B = 64 on AVX-512,
// 32 on AVX2) as its even columns then its odd ones, the order of the low and high nibbles of B / 2 bytes.
template <isa::Path P>
struct Int4Kernel {
  const int16_t* x16;
  const float* x_scale;
  const uint8_t* packed;  // [G, N, K/2]
  const float* scale;     // [G, N, ng]
  const uint8_t* zero;    // [G, N, ng]
  int64_t n_total, k, ng, gs;

  static constexpr int64_t kBlock = int4_block(P);

  const uint8_t* weight_rows_at(int64_t g, int64_t n) const { return packed + (g * n_total + n) * (k / 2); }
  int64_t row_bytes() const { return k / 2; }
  int64_t steps() const { return k / kBlock; }

  template <int MR, int NR>
  void tile(int64_t g, int64_t m, int64_t n, float* out, SpreadPrefetcher& prefetch) const {
    const int64_t half = k / 2;
    const uint8_t* w = packed + (g * n_total + n) * half;
    const float* s = scale + (g * n_total + n) * ng;
    const uint8_t* z = zero + (g * n_total + n) * ng;
    const int16_t* xm = x16 + m * k;
    // Per group: exact int32 lane sums, then scaled into fp32 lanes (exact in fp32 for groups of up to
    // 256 columns: products of at most 15 * 32767).
    float sums[MR][NR] = {};
#ifdef MOELAUNCH_HAS_AVX512
    __m512 lanes[MR][NR];
    for (auto& row : lanes)
      for (auto& l : row) l = _mm512_setzero_ps();
#endif
#ifdef MOELAUNCH_HAS_AVX2
    __m256 lanes2[MR][NR];
    for (auto& row : lanes2)
      for (auto& l : row) l = _mm256_setzero_ps();
#endif
    for (int64_t grp = 0; grp < ng; ++grp) {
      const int64_t c1 = std::min(k, (grp + 1) * gs);
      int64_t c = grp * gs;
#ifdef MOELAUNCH_HAS_AVX512
      if constexpr (P == isa::kAvx512) {
        const __m256i low = _mm256_set1_epi8(15);
        __m512i zv[NR], acc[MR][NR];
        for (int j = 0; j < NR; ++j) zv[j] = _mm512_set1_epi16(z[j * ng + grp]);
        for (auto& row : acc)
          for (auto& a : row) a = _mm512_setzero_si512();
        for (; c + kBlock <= c1; c += kBlock) {
          prefetch.tick();
          __m512i lo[NR], hi[NR];
          for (int j = 0; j < NR; ++j) {
            const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * half + c / 2));
            lo[j] = _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(b, low)), zv[j]);
            hi[j] = _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(b, 4), low)), zv[j]);
          }
          for (int r = 0; r < MR; ++r) {
            const __m512i even = _mm512_loadu_si512(xm + r * k + c);
            const __m512i odd = _mm512_loadu_si512(xm + r * k + c + kBlock / 2);
            for (int j = 0; j < NR; ++j) {
              acc[r][j] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(acc[r][j], even, lo[j]), odd, hi[j]);
            }
          }
        }
        for (int j = 0; j < NR; ++j) {
          const __m512 sv = _mm512_set1_ps(s[j * ng + grp]);
          for (int r = 0; r < MR; ++r) lanes[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][j]), sv, lanes[r][j]);
        }
      }
#endif
#ifdef MOELAUNCH_HAS_AVX2
      if constexpr (P == isa::kAvx2) {
        const __m128i low = _mm_set1_epi8(15);
        __m256i zv[NR], acc[MR][NR];
        for (int j = 0; j < NR; ++j) zv[j] = _mm256_set1_epi16(z[j * ng + grp]);
        for (auto& row : acc)
          for (auto& a : row) a = _mm256_setzero_si256();
        for (; c + kBlock <= c1; c += kBlock) {
          prefetch.tick();
          __m256i lo[NR], hi[NR];
          for (int j = 0; j < NR; ++j) {
            const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * half + c / 2));
            lo[j] = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(b, low)), zv[j]);
            hi[j] = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), low)), zv[j]);
          }
          for (int r = 0; r < MR; ++r) {
            const __m256i even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm + r * k + c));
            const __m256i odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm + r * k + c + kBlock / 2));
            for (int j = 0; j < NR; ++j) {
              acc[r][j] = _mm256_add_epi32(acc[r][j], _mm256_add_epi32(_mm256_madd_epi16(even, lo[j]),
                                                                       _mm256_madd_epi16(odd, hi[j])));
            }
          }
        }
        for (int j = 0; j < NR; ++j) {
          const __m256 sv = _mm256_set1_ps(s[j * ng + grp]);
          for (int r = 0; r < MR; ++r) lanes2[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][j]), sv, lanes2[r][j]);
        }
      }
#endif
      for (int j = 0; j < NR; ++j) {  // columns past the group's last whole block, in their natural order
        int64_t dots[MR] = {};
        for (int64_t t = c; t < c1; ++t) {
          const uint8_t byte = w[j * half + t / 2];
          const int code = (t % 2 ? byte >> 4 : byte & 15) - z[j * ng + grp];
          for (int r = 0; r < MR; ++r) dots[r] += int64_t{xm[r * k + t]} * code;
        }
        for (int r = 0; r < MR; ++r) sums[r][j] += static_cast<float>(dots[r]) * s[j * ng + grp];
      }
    }
    for (int r = 0; r < MR; ++r) {
      for (int j = 0; j < NR; ++j) {
        float total = sums[r][j];
#ifdef MOELAUNCH_HAS_AVX512
        if constexpr (P == isa::kAvx512) total += _mm512_reduce_add_ps(lanes[r][j]);
#endif
#ifdef MOELAUNCH_HAS_AVX2
        if constexpr (P == isa::kAvx2) total += reduce_ps(lanes2[r][j]);
#endif
        out[(m + r) * n_total + n + j] = total * x_scale[m + r];
      }
    }
  }
};

// W8A8: x's rows as int8 codes in the forms each path multiplies.
struct Rows8 {
  std::vector<int8_t> q;      // [T, K]
  std::vector<uint8_t> u;     // [T, K]: q + 128 (vpdpbusd multiplies unsigned by signed bytes), AVX-512 only
  std::vector<int16_t> wide;  // [T, K]: q widened, AVX2 only
  std::vector<float> scale;   // [T]

  // amax: each row's amax to quantize with (a tensor-parallel slice takes the whole row's), or null.
  // reader: the vector path that multiplies the codes, for its form of them (the tiles and the scalar
  // code read q).
  template <typename T>
  Rows8(const T* x, int64_t rows, int64_t k, const float* amax, isa::Path reader) : q(rows * k), scale(rows) {
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = x + r * k;
      int8_t* codes = q.data() + r * k;
      // As int8_reference._quantize_rows: the same fp32 operations, so the same codes.
      const float s = std::max(amax != nullptr ? amax[r] : amax_of(row, k), 1e-8f) / kCodes8;
      scale[r] = s;
      quantize_row(row, k, s, kCodes8, codes);
    }
    if (reader == isa::kAvx512) {
      u.resize(q.size());
      for (size_t i = 0; i < q.size(); ++i) u[i] = static_cast<uint8_t>(q[i] + 128);
    } else if (reader == isa::kAvx2) {
      wide.assign(q.begin(), q.end());
    }
  }
};

// W8A8: dots[r][j] = sum_k xq[r][k] * w[j][k] exactly, then out = dot * x_scale[r] * w_scale[n].
template <isa::Path P>
struct W8A8Kernel {
  const int8_t* xq;
  const uint8_t* xu;
  const int16_t* x16;
  const float* x_scale;
  const int8_t* q;
  const float* scale;
  int64_t n_total, k;

  const int8_t* weight_rows_at(int64_t g, int64_t n) const { return q + (g * n_total + n) * k; }
  int64_t row_bytes() const { return k; }
  int64_t steps() const { return k / (P == isa::kAvx512 ? 64 : 16); }  // of the vector loop below

  template <int MR, int NR>
  void tile(int64_t g, int64_t m, int64_t n, float* out, SpreadPrefetcher& prefetch) const {
    const int8_t* w = q + (g * n_total + n) * k;
    int64_t dots[MR][NR] = {};
    int64_t i = 0;
#ifdef MOELAUNCH_HAS_AVX512
    if constexpr (P == isa::kAvx512) {
      const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
      while (i + 64 <= k) {
        const int64_t end = std::min(k, i + kChunk);
        __m512i acc[MR][NR], bias_sum[NR];
        for (int j = 0; j < NR; ++j) {
          bias_sum[j] = _mm512_setzero_si512();
          for (int r = 0; r < MR; ++r) acc[r][j] = _mm512_setzero_si512();
        }
        for (; i + 64 <= end; i += 64) {
          prefetch.tick();
          __m512i wv[NR];
          for (int j = 0; j < NR; ++j) {
            wv[j] = _mm512_loadu_si512(w + j * k + i);
            bias_sum[j] = _mm512_dpbusd_epi32(bias_sum[j], bias, wv[j]);
          }
          for (int r = 0; r < MR; ++r) {
            const __m512i xv = _mm512_loadu_si512(xu + (m + r) * k + i);
            for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], xv, wv[j]);
          }
        }
        for (int r = 0; r < MR; ++r)
          for (int j = 0; j < NR; ++j) dots[r][j] += _mm512_reduce_add_epi32(_mm512_sub_epi32(acc[r][j], bias_sum[j]));
      }
    }
#endif
#ifdef MOELAUNCH_HAS_AVX2
    if constexpr (P == isa::kAvx2) {
      while (i + 16 <= k) {
        const int64_t end = std::min(k, i + kChunk);
        __m256i acc[MR][NR];
        for (auto& row : acc)
          for (auto& a : row) a = _mm256_setzero_si256();
        for (; i + 16 <= end; i += 16) {
          prefetch.tick();
          __m256i wv[NR];
          for (int j = 0; j < NR; ++j) {
            wv[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * k + i)));
          }
          for (int r = 0; r < MR; ++r) {
            const __m256i xv =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x16 + (m + r) * k + i));
            for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_add_epi32(acc[r][j], _mm256_madd_epi16(xv, wv[j]));
          }
        }
        for (int r = 0; r < MR; ++r)
          for (int j = 0; j < NR; ++j) dots[r][j] += reduce_i32(acc[r][j]);
      }
    }
#endif
    for (int r = 0; r < MR; ++r) {
      for (int j = 0; j < NR; ++j) {
        int64_t d = dots[r][j];
        for (int64_t t = i; t < k; ++t) d += int64_t{xq[(m + r) * k + t]} * w[j * k + t];
        out[(m + r) * n_total + n + j] =
            static_cast<float>(d) * x_scale[m + r] * scale[g * n_total + n + j];
      }
    }
  }
};

// The integer kernels have no bf16 products: the paths above AVX-512 run its code.
isa::Path resolve(int64_t path) { return std::min(isa::resolve(path), isa::kAvx512); }

void check_common(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& offsets, bool gated) {
  TORCH_CHECK((x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16) && x.dim() == 2 &&
                  x.is_contiguous(),
              "x must be a contiguous [T, K] fp32 or bf16");
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous(), "weight must be a contiguous [G, N, ...] stack");
  TORCH_CHECK(!gated || w.size(1) % 2 == 0, "a gated weight stacks [gate; up]: N must be even");
  TORCH_CHECK(offsets.scalar_type() == torch::kInt64 && offsets.dim() == 1 && offsets.size(0) == w.size(0) + 1 &&
                  offsets.is_contiguous(),
              "offsets must be int64 [G + 1]");
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[w.size(0)] == x.size(0), "offsets must start at 0 and end at x's row count");
}

void check_channel_scales(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.size(2) == x.size(1), "q must be int8 [G, N, K]");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.numel() == q.size(0) * q.size(1),
              "scale must be fp32 [G, N]");
}

// f(x's data) for x's dtype (fp32 or bf16).
template <class F>
auto on_rows(const torch::Tensor& x, const F& f) {
  if (x.scalar_type() == torch::kBFloat16) return f(reinterpret_cast<const c10::BFloat16*>(x.data_ptr()));
  return f(x.data_ptr<float>());
}

// A fresh [T, N] (gated: [T, N / 2]) in x's dtype from fill(sink), which writes the fp32 sums [T, N] to
// sink.sums and finishes them into sink.out (sink.finish).
template <class Fill>
torch::Tensor with_sink(const torch::Tensor& x, int64_t n, bool gated, const Fill& fill) {
  auto out = torch::empty({x.size(0), gated ? n / 2 : n}, x.options());
  const bool direct = !gated && x.scalar_type() == torch::kFloat32;  // the sums are the result
  auto sums = direct ? out : torch::empty({x.size(0), n}, x.options().dtype(torch::kFloat32));
  if (x.scalar_type() == torch::kBFloat16) {
    fill(Sink<c10::BFloat16>{reinterpret_cast<c10::BFloat16*>(out.data_ptr()), sums.data_ptr<float>(), n, gated, direct});
  } else {
    fill(Sink<float>{out.data_ptr<float>(), sums.data_ptr<float>(), n, gated, direct});
  }
  return out;
}

// Runs make_kernel(path tag)'s vector kernel over the groups into `sink` (but those marked in `skip`).
template <class MakeKernel, typename O>
void run_vector(const Sink<O>& sink, const torch::Tensor& offsets, int64_t groups, isa::Path path,
                const MakeKernel& make_kernel, const uint8_t* skip = nullptr) {
  auto on = [&](auto tag) { run_grouped(make_kernel(tag), offsets.data_ptr<int64_t>(), groups, sink, skip); };
  switch (path) {
#ifdef MOELAUNCH_HAS_AVX512
    case isa::kAvx512:
      on(std::integral_constant<isa::Path, isa::kAvx512>{});
      break;
#endif
#ifdef MOELAUNCH_HAS_AVX2
    case isa::kAvx2:
      on(std::integral_constant<isa::Path, isa::kAvx2>{});
      break;
#endif
    default:
      on(std::integral_constant<isa::Path, isa::kScalar>{});
  }
}

// Every row's sums finished, for kernels that fill all of them before.
template <typename O>
void finish_all(const Sink<O>& sink, int64_t rows) {
  const int64_t n_out = sink.gated ? sink.n_total / 2 : sink.n_total;
  at::parallel_for(0, rows, kRowTile, [&](int64_t begin, int64_t end) { sink.finish(begin, end, 0, n_out); });
}

#ifdef MOELAUNCH_HAS_AMX_INT8
// Calls with at least this many rows take the AMX tiles; below, the vector kernels keep up with the
// weight stream (decode) and a tile would multiply mostly zero columns.
constexpr int64_t kAmxRows = 16;

bool amx_takes(const torch::Tensor& x, const torch::Tensor& q, int64_t path) {
  return isa::resolve(path) >= isa::kAmx && x.size(0) >= kAmxRows && int_amx::fits(q.size(1), q.size(2));
}

// The INT8 weights' products through the tiles, x's codes as `codes`' byte planes.
template <bool kSplit>
torch::Tensor run_amx(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                      const torch::Tensor& offsets, bool gated, const int_amx::Codes& codes) {
  const int64_t rows = x.size(0), n = q.size(1);
  return with_sink(x, n, gated, [&](const auto& sink) {
    int_amx::grouped_products<kSplit>(codes, q.data_ptr<int8_t>(), scale.data_ptr<float>(),
                                      offsets.data_ptr<int64_t>(), q.size(0), n, q.size(2), sink.sums);
    finish_all(sink, rows);
  });
}
#endif

}  // namespace

// x [T, K] fp32 or bf16 (rows grouped by offsets [G + 1]); q [G, N, K] int8; scale [G, N] fp32 -> [T, N]
// (gated: [T, N / 2]) in x's dtype.
torch::Tensor int8_linear_cpu(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor offsets,
                              bool gated, int64_t path) {
  check_common(x, q, offsets, gated);
  check_channel_scales(x, q, scale);
  const int64_t n = q.size(1), k = q.size(2);
  const Rows16 x16 = on_rows(x, [&](const auto* xp) { return Rows16(xp, x.size(0), k); });
#ifdef MOELAUNCH_HAS_AMX_INT8
  if (amx_takes(x, q, path)) {
    const std::vector<uint8_t> planes = x16.byte_planes();
    const int_amx::Codes codes{{planes.data(), planes.data() + x16.codes.size()}, true, x16.scale.data()};
    return run_amx<true>(x, q, scale, offsets, gated, codes);
  }
#endif
  return with_sink(x, n, gated, [&](const auto& sink) {
    run_vector(sink, offsets, q.size(0), resolve(path), [&](auto tag) {
      return Int8Kernel<decltype(tag)::value>{x16.codes.data(), x16.scale.data(), q.data_ptr<int8_t>(),
                                              scale.data_ptr<float>(), n, k};
    });
  });
}

// x [T, K] fp32 or bf16; packed [G, N, K/2] uint8; scale [G, N, ng] fp32; zero [G, N, ng] uint8,
// ng = ceil(K / gs) -> [T, N] (gated: [T, N / 2]) in x's dtype.
torch::Tensor int4_linear_cpu(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor zero,
                              torch::Tensor offsets, int64_t group_size, bool gated, int64_t path) {
  check_common(x, packed, offsets, gated);
  const int64_t k = x.size(1), n = packed.size(1), ng = (k + group_size - 1) / group_size;
  TORCH_CHECK(k % 2 == 0 && packed.scalar_type() == torch::kUInt8 && packed.size(2) == k / 2,
              "packed must be uint8 [G, N, K/2]");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() &&
                  scale.numel() == packed.size(0) * n * ng,
              "scale must be fp32 [G, N, ceil(K / group_size)]");
  TORCH_CHECK(zero.scalar_type() == torch::kUInt8 && zero.is_contiguous() && zero.numel() == scale.numel(),
              "zero must be uint8 shaped like scale");
  const int64_t groups = packed.size(0);
  const int64_t* off = offsets.data_ptr<int64_t>();
  // Groups with many rows go to the tiles on the Amx path (int4_tiles.h), the others to the vector kernel.
  std::vector<uint8_t> tiled(groups, 0);
#ifdef MOELAUNCH_HAS_AMX
  if (isa::resolve(path) >= isa::kAmx) int4_tiles::mark(off, groups, n, k, tiled.data());
#endif
  bool any_tiled = false, any_vector = false;
  for (int64_t g = 0; g < groups; ++g) {
    any_tiled |= tiled[g] != 0;
    any_vector |= !tiled[g] && off[g + 1] > off[g];
  }
  // A vector step covers one block of columns inside a group: groups must hold whole blocks.
  isa::Path p = resolve(path);
  if (p == isa::kAvx512 && group_size % int4_block(isa::kAvx512)) p = isa::kAvx2;
  if (p == isa::kAvx2 && group_size % int4_block(isa::kAvx2)) p = isa::kScalar;
  const int64_t block = int4_block(p);
  const Rows16 x16 = on_rows(x, [&](const auto* xp) { return Rows16(xp, any_vector ? x.size(0) : 0, k, group_size, block); });
  return with_sink(x, n, gated, [&](const auto& sink) {
#ifdef MOELAUNCH_HAS_AMX
    if (any_tiled) {
      on_rows(x, [&](const auto* xp) {
        int4_tiles::grouped_products(xp, packed.data_ptr<uint8_t>(), scale.data_ptr<float>(), zero.data_ptr<uint8_t>(),
                                     off, groups, n, k, group_size, tiled.data(), sink.sums);
        return 0;
      });
      for (int64_t g = 0; g < groups; ++g) {
        if (tiled[g]) sink.finish(off[g], off[g + 1], 0, gated ? n / 2 : n);
      }
    }
#endif
    if (!any_vector) return;
    run_vector(
        sink, offsets, groups, p,
        [&](auto tag) {
          return Int4Kernel<decltype(tag)::value>{x16.codes.data(),       x16.scale.data(),
                                                  packed.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                                                  zero.data_ptr<uint8_t>(), n, k, ng, group_size};
        },
        tiled.data());
  });
}

// W8A8: x [T, K] fp32 or bf16 quantized per row (amax / 127, round half to even), q [G, N, K] int8,
// scale [G, N] -> [T, N] (gated: [T, N / 2]) in x's dtype. row_amax [T] fp32, when given, is each row's
// amax to use instead of its own (a tensor-parallel slice quantized with the whole row's scale).
torch::Tensor w8a8_linear_cpu(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor offsets,
                              bool gated, int64_t path, c10::optional<torch::Tensor> row_amax) {
  check_common(x, q, offsets, gated);
  check_channel_scales(x, q, scale);
  const int64_t rows = x.size(0), n = q.size(1), k = q.size(2);
  const bool given = row_amax.has_value() && row_amax->defined();
  TORCH_CHECK(!given || (row_amax->scalar_type() == torch::kFloat32 && row_amax->is_contiguous() &&
                         row_amax->numel() == rows),
              "row_amax must be a contiguous fp32 [T]");
  const float* amax = given ? row_amax->data_ptr<float>() : nullptr;
  const isa::Path p = resolve(path);
#ifdef MOELAUNCH_HAS_AMX_INT8
  if (amx_takes(x, q, path)) {
    const Rows8 x8 = on_rows(x, [&](const auto* xp) { return Rows8(xp, rows, k, amax, isa::kScalar); });
    const auto* plane = reinterpret_cast<const uint8_t*>(x8.q.data());
    return run_amx<false>(x, q, scale, offsets, gated, int_amx::Codes{{plane, nullptr}, false, x8.scale.data()});
  }
#endif
  const Rows8 x8 = on_rows(x, [&](const auto* xp) { return Rows8(xp, rows, k, amax, p); });
  return with_sink(x, n, gated, [&](const auto& sink) {
    run_vector(sink, offsets, q.size(0), p, [&](auto tag) {
      return W8A8Kernel<decltype(tag)::value>{x8.q.data(),          x8.u.data(),           x8.wide.data(), x8.scale.data(),
                                              q.data_ptr<int8_t>(), scale.data_ptr<float>(), n,              k};
    });
  });
}
