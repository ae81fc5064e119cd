// Integer-weight linear layers for few rows on the CPU, reading the quantized weights as stored:
// out[rows of group g] = x[rows of group g] @ W[g]^T, with W[g] one of
// - INT8 per output channel (weight-only): W = q * scale[n]; the products run in fp32 on the int8 codes
//   widened in registers, the channel scale applied once per output;
// - INT4 in groups of input columns with zero points (weight-only): W = (q - zero) * scale per group;
//   codes unpacked and dequantized in registers (two per byte, low nibble = even column);
// - W8A8: x quantized per row to int8 here (the reference's rounding), int32 dot products (AVX512-VNNI
//   vpdpbusd, or AVX2 vpmaddwd), then both scales.
// Decode reads each weight once: a quarter (INT8) or an eighth (INT4) of the fp32 bytes. Like the float
// grouped-linear kernel, tiles of 3 weight rows x up to 4 input rows let each weight load feed several
// rows, and groups without rows (idle experts) never touch their weights.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_isa.h"

namespace {

namespace isa = moelaunch::isa;

constexpr int kWeightTile = 3;
constexpr int kRowTile = 4;
constexpr int64_t kTaskWeightRows = 60;  // weight rows per parallel task, a multiple of kWeightTile

// Runs kern.tile<MR, NR>(g, m, n) over every (group, row tile, weight tile) with rows, in parallel over
// groups x chunks of weight rows.
template <int NR, class Kern>
void rows_of(const Kern& kern, int64_t g, int64_t m0, int64_t m1, int64_t n) {
  int64_t m = m0;
  for (; m + kRowTile <= m1; m += kRowTile) kern.template tile<kRowTile, NR>(g, m, n);
  switch (m1 - m) {
    case 3:
      kern.template tile<3, NR>(g, m, n);
      break;
    case 2:
      kern.template tile<2, NR>(g, m, n);
      break;
    case 1:
      kern.template tile<1, NR>(g, m, n);
      break;
    default:
      break;
  }
}

template <class Kern>
void run_grouped(const Kern& kern, const int64_t* offsets, int64_t groups, int64_t n_total) {
  const int64_t tasks_per_group = (n_total + kTaskWeightRows - 1) / kTaskWeightRows;
  at::parallel_for(0, groups * tasks_per_group, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / tasks_per_group;
      const int64_t m0 = offsets[g], m1 = offsets[g + 1];
      if (m0 == m1) continue;
      const int64_t n_end = std::min(n_total, (task % tasks_per_group + 1) * kTaskWeightRows);
      int64_t n = (task % tasks_per_group) * kTaskWeightRows;
      for (; n + kWeightTile <= n_end; n += kWeightTile) rows_of<kWeightTile>(kern, g, m0, m1, n);
      for (; n < n_end; ++n) rows_of<1>(kern, g, m0, m1, n);
    }
  });
}

// INT8 weight-only: x [T, K] fp32, q [G, N, K] int8, scale [G, N].
template <class I>
struct Int8Kernel {
  const float* x;
  const int8_t* q;
  const float* scale;
  float* out;
  int64_t n_total, k;

  template <int MR, int NR>
  void tile(int64_t g, int64_t m, int64_t n) const {
    const float* xm = x + m * k;
    const int8_t* w = q + (g * n_total + n) * k;
    typename I::F acc[MR][NR];
    for (auto& row : acc)
      for (auto& a : row) a = I::zero();
    int64_t i = 0;
    for (; i + I::L <= k; i += I::L) {
      typename I::F wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = I::load_i8(w + j * k + i);
      for (int r = 0; r < MR; ++r) {
        const typename I::F xv = I::load(xm + r * k + i);
        for (int j = 0; j < NR; ++j) acc[r][j] = I::fma(xv, wv[j], acc[r][j]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      for (int j = 0; j < NR; ++j) {
        float d = I::sum(acc[r][j]);
        for (int64_t t = i; t < k; ++t) d += xm[r * k + t] * static_cast<float>(w[j * k + t]);
        out[(m + r) * n_total + n + j] = d * scale[g * n_total + n + j];
      }
    }
  }
};

// INT4 weight-only: packed [G, N, K/2] uint8, scale [G, N, ng] fp32, zero [G, N, ng] uint8 for groups of
// `gs` columns. `xp` is x with each group's columns reordered by chunks of 2L: the L even columns, then
// the L odd ones, matching the low and high nibbles of L packed bytes (a group's columns past its last
// whole chunk keep their order and take the scalar tail).
template <class I>
struct Int4Kernel {
  const float* xp;
  const uint8_t* packed;
  const float* scale;
  const uint8_t* zero;
  float* out;
  int64_t n_total, k, ng, gs;

  template <int MR, int NR>
  void tile(int64_t g, int64_t m, int64_t n) const {
    constexpr int L = I::L;
    const float* xm = xp + m * k;
    const int64_t half = k / 2;
    const uint8_t* w = packed + (g * n_total + n) * half;
    const float* s = scale + (g * n_total + n) * ng;
    const uint8_t* z = zero + (g * n_total + n) * ng;
    typename I::F acc[MR][NR];
    for (auto& row : acc)
      for (auto& a : row) a = I::zero();
    float tail[MR][NR] = {};
    for (int64_t grp = 0; grp < ng; ++grp) {
      const int64_t c1 = std::min(k, (grp + 1) * gs);
      typename I::F sv[NR], offset[NR];  // W = code * scale + (-zero * scale)
      for (int j = 0; j < NR; ++j) {
        const float sc = s[j * ng + grp];
        sv[j] = I::set1(sc);
        offset[j] = I::set1(-static_cast<float>(z[j * ng + grp]) * sc);
      }
      int64_t c = grp * gs;
      for (; c + 2 * L <= c1; c += 2 * L) {
        typename I::F lo[NR], hi[NR];
        for (int j = 0; j < NR; ++j) {
          I::load_u4(w + j * half + c / 2, lo[j], hi[j]);
          lo[j] = I::fma(lo[j], sv[j], offset[j]);
          hi[j] = I::fma(hi[j], sv[j], offset[j]);
        }
        for (int r = 0; r < MR; ++r) {
          const typename I::F even = I::load(xm + r * k + c), odd = I::load(xm + r * k + c + L);
          for (int j = 0; j < NR; ++j) acc[r][j] = I::fma(odd, hi[j], I::fma(even, lo[j], acc[r][j]));
        }
      }
      for (; c < c1; ++c) {
        for (int j = 0; j < NR; ++j) {
          const uint8_t byte = w[j * half + c / 2];
          const int code = c % 2 ? byte >> 4 : byte & 15;
          const float wt = static_cast<float>(code - z[j * ng + grp]) * s[j * ng + grp];
          for (int r = 0; r < MR; ++r) tail[r][j] += xm[r * k + c] * wt;
        }
      }
    }
    for (int r = 0; r < MR; ++r) {
      for (int j = 0; j < NR; ++j) out[(m + r) * n_total + n + j] = I::sum(acc[r][j]) + tail[r][j];
    }
  }
};

// The column order Int4Kernel<I> reads x in (see there).
std::vector<float> interleave_for_int4(const float* x, int64_t rows, int64_t k, int64_t gs, int lanes) {
  std::vector<float> xp(x, x + rows * k);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g0 = 0; g0 < k; g0 += gs) {
      const int64_t g1 = std::min(k, g0 + gs);
      for (int64_t c = g0; c + 2 * lanes <= g1; c += 2 * lanes) {
        for (int l = 0; l < lanes; ++l) {
          xp[r * k + c + l] = x[r * k + c + 2 * l];
          xp[r * k + c + lanes + l] = x[r * k + c + 2 * l + 1];
        }
      }
    }
  }
  return xp;
}

// W8A8: dots[r][j] = sum_k xq[r][k] * w[j][k] exactly, then out = dot * x_scale[r] * w_scale[n].
struct W8A8Rows {
  const int8_t* xq;     // [T, K]
  const uint8_t* xu;    // [T, K]: xq + 128 (AVX512-VNNI multiplies unsigned by signed bytes)
  const int16_t* x16;   // [T, K]: xq widened (AVX2)
  const float* x_scale;  // [T]
};

template <isa::Path P>
struct W8A8Kernel {
  W8A8Rows x;
  const int8_t* q;
  const float* scale;
  float* out;
  int64_t n_total, k;

  template <int MR, int NR>
  void tile(int64_t g, int64_t m, int64_t n) const {
    const int8_t* w = q + (g * n_total + n) * k;
    int32_t dots[MR][NR] = {};
    int64_t i = 0;
#ifdef MOELAUNCH_HAS_AVX512
    if constexpr (P == isa::kAvx512) {
      // vpdpbusd takes unsigned x: (xq + 128) . w, less 128 * sum(w), which the same instruction gives.
      __m512i acc[MR][NR], bias_sum[NR];
      const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
      for (int j = 0; j < NR; ++j) {
        bias_sum[j] = _mm512_setzero_si512();
        for (int r = 0; r < MR; ++r) acc[r][j] = _mm512_setzero_si512();
      }
      for (; i + 64 <= k; i += 64) {
        __m512i wv[NR];
        for (int j = 0; j < NR; ++j) {
          wv[j] = _mm512_loadu_si512(w + j * k + i);
          bias_sum[j] = _mm512_dpbusd_epi32(bias_sum[j], bias, wv[j]);
        }
        for (int r = 0; r < MR; ++r) {
          const __m512i xv = _mm512_loadu_si512(x.xu + (m + r) * k + i);
          for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], xv, wv[j]);
        }
      }
      for (int r = 0; r < MR; ++r) {
        for (int j = 0; j < NR; ++j) {
          dots[r][j] = _mm512_reduce_add_epi32(_mm512_sub_epi32(acc[r][j], bias_sum[j]));
        }
      }
    }
#endif
#ifdef MOELAUNCH_HAS_AVX2
    if constexpr (P == isa::kAvx2) {
      __m256i acc[MR][NR];
      for (auto& row : acc)
        for (auto& a : row) a = _mm256_setzero_si256();
      for (; i + 16 <= k; i += 16) {
        __m256i wv[NR];
        for (int j = 0; j < NR; ++j) {
          wv[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * k + i)));
        }
        for (int r = 0; r < MR; ++r) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.x16 + (m + r) * k + i));
          for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_add_epi32(acc[r][j], _mm256_madd_epi16(xv, wv[j]));
        }
      }
      for (int r = 0; r < MR; ++r) {
        for (int j = 0; j < NR; ++j) {
          alignas(32) int32_t lanes[8];
          _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[r][j]);
          for (int32_t v : lanes) dots[r][j] += v;
        }
      }
    }
#endif
    for (int r = 0; r < MR; ++r) {
      for (int j = 0; j < NR; ++j) {
        int32_t d = dots[r][j];
        for (int64_t t = i; t < k; ++t) d += int32_t{x.xq[(m + r) * k + t]} * int32_t{w[j * k + t]};
        out[(m + r) * n_total + n + j] =
            static_cast<float>(d) * x.x_scale[m + r] * scale[g * n_total + n + j];
      }
    }
  }
};

// The integer kernels have no bf16 products: the bf16 path runs their AVX-512 code.
isa::Path resolve(int64_t path) { return std::min(isa::resolve(path), isa::kAvx512); }

void check_common(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& offsets) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x must be [T, K] fp32");
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous(), "weight must be a contiguous [G, N, ...] stack");
  TORCH_CHECK(offsets.scalar_type() == torch::kInt64 && offsets.dim() == 1 && offsets.size(0) == w.size(0) + 1 &&
                  offsets.is_contiguous(),
              "offsets must be int64 [G + 1]");
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[w.size(0)] == x.size(0), "offsets must start at 0 and end at x's row count");
}

}  // namespace

// x [T, K] fp32 (rows grouped by offsets [G + 1]); q [G, N, K] int8; scale [G, N] fp32 -> [T, N] fp32.
torch::Tensor int8_linear_cpu(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor offsets,
                              int64_t path) {
  check_common(x, q, offsets);
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.size(2) == x.size(1), "q must be int8 [G, N, K]");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.numel() == q.size(0) * q.size(1),
              "scale must be fp32 [G, N]");
  const int64_t n = q.size(1), k = q.size(2);
  auto out = torch::empty({x.size(0), n}, x.options());
  auto go = [&](auto traits) {
    using I = decltype(traits);
    Int8Kernel<I> kern{x.data_ptr<float>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), out.data_ptr<float>(), n, k};
    run_grouped(kern, offsets.data_ptr<int64_t>(), q.size(0), n);
  };
  switch (resolve(path)) {
#ifdef MOELAUNCH_HAS_AVX512
    case isa::kAvx512:
      go(isa::Avx512{});
      break;
#endif
#ifdef MOELAUNCH_HAS_AVX2
    case isa::kAvx2:
      go(isa::Avx2{});
      break;
#endif
    default:
      go(isa::Scalar{});
  }
  return out;
}

// x [T, K] fp32; packed [G, N, K/2] uint8; scale [G, N, ng] fp32; zero [G, N, ng] uint8, ng = ceil(K / gs).
torch::Tensor int4_linear_cpu(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor zero,
                              torch::Tensor offsets, int64_t group_size, int64_t path) {
  check_common(x, packed, offsets);
  const int64_t k = x.size(1), n = packed.size(1), ng = (k + group_size - 1) / group_size;
  TORCH_CHECK(k % 2 == 0 && packed.scalar_type() == torch::kUInt8 && packed.size(2) == k / 2,
              "packed must be uint8 [G, N, K/2]");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() &&
                  scale.numel() == packed.size(0) * n * ng,
              "scale must be fp32 [G, N, ceil(K / group_size)]");
  TORCH_CHECK(zero.scalar_type() == torch::kUInt8 && zero.is_contiguous() && zero.numel() == scale.numel(),
              "zero must be uint8 shaped like scale");
  auto out = torch::empty({x.size(0), n}, x.options());
  auto go = [&](auto traits) {
    using I = decltype(traits);
    const std::vector<float> xp = interleave_for_int4(x.data_ptr<float>(), x.size(0), k, group_size, I::L);
    Int4Kernel<I> kern{xp.data(), packed.data_ptr<uint8_t>(), scale.data_ptr<float>(), zero.data_ptr<uint8_t>(),
                       out.data_ptr<float>(), n, k, ng, group_size};
    run_grouped(kern, offsets.data_ptr<int64_t>(), packed.size(0), n);
  };
  isa::Path p = resolve(path);
  // A vector step covers 2 x lanes columns inside one group: groups must hold whole steps.
  if (p == isa::kAvx512 && group_size % 32) p = isa::kAvx2;
  if (p == isa::kAvx2 && group_size % 16) p = isa::kScalar;
  switch (p) {
#ifdef MOELAUNCH_HAS_AVX512
    case isa::kAvx512:
      go(isa::Avx512{});
      break;
#endif
#ifdef MOELAUNCH_HAS_AVX2
    case isa::kAvx2:
      go(isa::Avx2{});
      break;
#endif
    default:
      go(isa::Scalar{});
  }
  return out;
}

// W8A8: x [T, K] fp32 quantized per row (amax / 127, round half to even), q [G, N, K] int8, scale [G, N].
// row_amax [T] fp32, when given, is each row's amax to use instead of its own (a tensor-parallel slice
// quantized with the whole row's scale).
torch::Tensor w8a8_linear_cpu(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor offsets,
                              int64_t path, c10::optional<torch::Tensor> row_amax) {
  check_common(x, q, offsets);
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.size(2) == x.size(1), "q must be int8 [G, N, K]");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.numel() == q.size(0) * q.size(1),
              "scale must be fp32 [G, N]");
  const int64_t rows = x.size(0), n = q.size(1), k = q.size(2);
  const bool given = row_amax.has_value() && row_amax->defined();
  TORCH_CHECK(!given || (row_amax->scalar_type() == torch::kFloat32 && row_amax->is_contiguous() &&
                         row_amax->numel() == rows),
              "row_amax must be a contiguous fp32 [T]");
  const float* given_amax = given ? row_amax->data_ptr<float>() : nullptr;
  const float* xf = x.data_ptr<float>();
  std::vector<int8_t> xq(rows * k);
  std::vector<uint8_t> xu(rows * k);
  std::vector<int16_t> x16(rows * k);
  std::vector<float> xs(rows);
  for (int64_t r = 0; r < rows; ++r) {
    float amax = 0.f;
    if (given_amax != nullptr) {
      amax = given_amax[r];
    } else {
      for (int64_t t = 0; t < k; ++t) amax = std::max(amax, std::fabs(xf[r * k + t]));
    }
    // As int8_reference._quantize_rows: the same fp32 operations, so the same codes.
    xs[r] = std::max(amax, 1e-8f) / 127.f;
    for (int64_t t = 0; t < k; ++t) {
      const float v = std::clamp(std::nearbyint(xf[r * k + t] / xs[r]), -127.f, 127.f);
      xq[r * k + t] = static_cast<int8_t>(v);
      xu[r * k + t] = static_cast<uint8_t>(static_cast<int>(v) + 128);
      x16[r * k + t] = static_cast<int16_t>(v);
    }
  }
  auto out = torch::empty({rows, n}, x.options());
  const W8A8Rows xr{xq.data(), xu.data(), x16.data(), xs.data()};
  auto go = [&](auto kernel_tag) {
    decltype(kernel_tag) kern{xr, q.data_ptr<int8_t>(), scale.data_ptr<float>(), out.data_ptr<float>(), n, k};
    run_grouped(kern, offsets.data_ptr<int64_t>(), q.size(0), n);
  };
  switch (resolve(path)) {
    case isa::kAvx512:
      go(W8A8Kernel<isa::kAvx512>{});
      break;
    case isa::kAvx2:
      go(W8A8Kernel<isa::kAvx2>{});
      break;
    default:
      go(W8A8Kernel<isa::kScalar>{});
  }
  return out;
}
