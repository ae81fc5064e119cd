// Grouped linear for few rows on the CPU: out[rows of group g] = x[rows of group g] @ weight[g]^T.
//
// Decode steps multiply a handful of rows by weights that are far larger than the cache, so the time is
// the weight stream from memory. A BLAS GEMM first packs the weight into its own layout (an extra read
// and write of every weight) and is tuned for many rows; here each weight is read once, in the layout
// it is stored in ([N, K], rows contiguous), by tiles of 3 (4 on the 16-lane path) weight rows x 4 input
// rows, each weight load feeding 4 FMAs and each input load 3 (4), both held in registers. Groups with
// no rows never touch their weights (idle experts).
//
// Three paths compute the tiles (chosen per call, cpu_isa.h): bf16 rows against a bf16 weight take
// vdpbf16ps where the CPU has AVX512-BF16 (32 products per instruction, the weight's [N, K] rows are
// already the adjacent K pairs it multiplies); everything else widens bf16 to fp32 and runs 16-lane FMAs
// where the CPU has AVX-512, 8-lane ones elsewhere. A decode row reads weights from the cache at about
// 27 GB/s on one core of the Xeon measured (docs/benchmarks.md, issue 30): the 16-lane path, with two FMA
// chains per product for a lone row, reaches that (1.25-1.35x the 8-lane one at 1-2 rows).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>

#include "bf16_dot.h"
#include "cpu_isa.h"
#include "grouped_linear_amx.h"
#include "prefetch.h"
#include "simd.h"
#include "widen16.h"

namespace {

using moelaunch::in_register;
using moelaunch::lane_sums;
using moelaunch::kLanes;
using moelaunch::load8;
using moelaunch::silu_mul_row;
using moelaunch::SpreadPrefetcher;
using moelaunch::to_float;
using moelaunch::vec8;
namespace isa = moelaunch::isa;

// Weight rows per tile where the Dot does not choose: 12 accumulators, 3 weights and an input vector
// fill the 16 registers of AVX2.
constexpr int64_t kWeightTile = 3;
constexpr int64_t kRowTile = 4;
// Weight rows per parallel task: large enough to amortize the task, small enough to split a matrix.
constexpr int64_t kTaskWeightRows = 60;  // a multiple of each Dot's weight tile (3, 4)

// The widening path: fp32 rows, fp32 or bf16 weights (widened in registers), 8-lane FMAs.
struct WidenDot {
  using x_t = float;
  static constexpr int64_t kStep = kLanes;
  static constexpr int kWeightTile = ::kWeightTile;

  // out[m * ldo + j] = x[m] . w[j] over k values, for MR input rows and NR weight rows; one prefetch
  // tick per step.
  template <int MR, int NR, typename weight_t>
  static void tile(const float* x, int64_t ldx, const weight_t* w, int64_t k, float* out, int64_t ldo,
                   SpreadPrefetcher& prefetch) {
    vec8 acc[MR][NR] = {};
    int64_t i = 0;
    for (; i + kLanes <= k; i += kLanes) {
      prefetch.tick();
      vec8 wv[NR];
      // Pinned only when reused: a lone row streams faster with each weight load folded into its FMA.
      for (int j = 0; j < NR; ++j) wv[j] = MR > 1 ? in_register(load8(w + j * k + i)) : load8(w + j * k + i);
      for (int m = 0; m < MR; ++m) {
        const vec8 xv = NR > 1 ? in_register(load8(x + m * ldx + i)) : load8(x + m * ldx + i);
        for (int j = 0; j < NR; ++j) acc[m][j] += xv * wv[j];
      }
    }
    for (int first = 0; first < MR * NR; first += 8) {
      const int count = std::min(8, MR * NR - first);
      const vec8 sums = lane_sums(&acc[0][0] + first, count);
      for (int c = 0; c < count; ++c) {
        const int m = (first + c) / NR, j = (first + c) % NR;
        float s = sums[c];
        for (int64_t t = i; t < k; ++t) s += x[m * ldx + t] * to_float(w[j * k + t]);
        out[m * ldo + j] = s;
      }
    }
  }
};

#ifdef MOELAUNCH_HAS_AVX512
namespace widen16 = moelaunch::widen16;

// The widening path at 16 lanes (AVX-512): fp32 rows, fp32 or bf16 weights. A lone input row's tile has
// only NR (4) products, fewer independent FMA chains than the FMA latency needs, so it runs each product
// as two chains over alternate steps of K; the tail of K is a masked load (zero past K).
struct Widen16Dot {
  using x_t = float;
  static constexpr int64_t kStep = widen16::kStep;
  // 4 weight rows x 4 input rows: 16 accumulators, 4 weight vectors and an input vector of the 32
  // registers (3 x 4 left the FMAs a quarter idle: 8 rows an expert 1,224 -> 1,071 us, fp32 experts).
  static constexpr int kWeightTile = 4;

  template <int MR, int NR, typename weight_t>
  static void tile(const float* x, int64_t ldx, const weight_t* w, int64_t k, float* out, int64_t ldo,
                   SpreadPrefetcher& prefetch) {
    constexpr int kChains = MR == 1 ? 2 : 1;
    __m512 acc[kChains][MR * NR];
    for (auto& chain : acc)
      for (auto& a : chain) a = _mm512_setzero_ps();
    auto step = [&](__m512* sums, int64_t i, auto load_at) {
      __m512 wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = MR > 1 ? widen16::in_register(load_at(w + j * k + i)) : load_at(w + j * k + i);
      for (int m = 0; m < MR; ++m) {
        const __m512 xv = NR > 1 ? widen16::in_register(load_at(x + m * ldx + i)) : load_at(x + m * ldx + i);
        for (int j = 0; j < NR; ++j) sums[m * NR + j] = _mm512_fmadd_ps(xv, wv[j], sums[m * NR + j]);
      }
    };
    const auto whole = [](const auto* p) { return widen16::load(p); };
    int64_t i = 0;
    for (; i + kChains * kStep <= k; i += kChains * kStep) {
      for (int c = 0; c < kChains; ++c) {
        prefetch.tick();
        step(acc[c], i + c * kStep, whole);
      }
    }
    for (; i + kStep <= k; i += kStep) {
      prefetch.tick();
      step(acc[0], i, whole);
    }
    if (i < k) step(acc[0], i, [n = k - i](const auto* p) { return widen16::load_first(p, n); });
    if constexpr (kChains == 2) {
      for (int c = 0; c < MR * NR; ++c) acc[0][c] = _mm512_add_ps(acc[0][c], acc[1][c]);
    }
    alignas(64) float sums[16];
    _mm512_store_ps(sums, widen16::lane_sums(acc[0], MR * NR));
    for (int c = 0; c < MR * NR; ++c) out[(c / NR) * ldo + c % NR] = sums[c];
  }
};
#endif

#ifdef MOELAUNCH_HAS_AVX512_BF16
namespace bf16 = moelaunch::bf16;

// The bf16 path: bf16 rows and weights, 32 products per vdpbf16ps into 16 fp32 sums per (row, weight
// row); the last step of K is a masked load, zero past K.
struct Bf16Dot {
  using x_t = c10::BFloat16;
  static constexpr int64_t kStep = bf16::kStep;
  static constexpr int kWeightTile = ::kWeightTile;

  template <int MR, int NR>
  static void tile(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t k, float* out, int64_t ldo,
                   SpreadPrefetcher& prefetch) {
    static_assert(MR * NR <= 16, "one lane_sums call per tile");
    __m512 acc[MR * NR];
    for (auto& a : acc) a = _mm512_setzero_ps();
    auto step = [&](int64_t i, auto load) {
      __m512bh wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = load(w + j * k + i);
      for (int m = 0; m < MR; ++m) {
        const __m512bh xv = load(x + m * ldx + i);
        for (int j = 0; j < NR; ++j) acc[m * NR + j] = _mm512_dpbf16_ps(acc[m * NR + j], xv, wv[j]);
      }
    };
    int64_t i = 0;
    for (; i + kStep <= k; i += kStep) {
      prefetch.tick();
      step(i, [](const c10::BFloat16* p) { return bf16::load(p); });
    }
    if (i < k) step(i, [n = k - i](const c10::BFloat16* p) { return bf16::load_first(p, n); });
    alignas(64) float sums[16];
    _mm512_store_ps(sums, bf16::lane_sums(acc, MR * NR));
    for (int c = 0; c < MR * NR; ++c) out[(c / NR) * ldo + c % NR] = sums[c];
  }
};
#endif

// One group's rows [m0, m1) against weight rows [n, n + NR), by passes of kRowTile rows; the first pass
// streams the weights in, the others find them in L1. Meanwhile the next weight tile is prefetched:
// with short weight rows (up to a page) the hardware prefetcher sees NR interleaved streams that each
// end soon and falls behind. Long rows it follows by itself, and extra prefetches only take load slots.
template <class Dot, int NR, typename weight_t>
inline void rows_by_weight_tile(const typename Dot::x_t* x, const weight_t* w, float* out, int64_t m0, int64_t m1,
                                int64_t k, int64_t n_total, int64_t n) {
  constexpr int64_t kPage = 4096;
  SpreadPrefetcher prefetch;
  const int64_t row_bytes = k * static_cast<int64_t>(sizeof(weight_t));
  if (row_bytes <= kPage) {
    const int64_t passes = (m1 - m0 + kRowTile - 1) / kRowTile;
    prefetch = SpreadPrefetcher(w + NR * k, NR * row_bytes, passes * (k / Dot::kStep));
  }
  int64_t m = m0;
  for (; m + kRowTile <= m1; m += kRowTile) {
    Dot::template tile<kRowTile, NR>(x + m * k, k, w, k, out + m * n_total + n, n_total, prefetch);
  }
  const auto* xm = x + m * k;
  float* om = out + m * n_total + n;
  switch (m1 - m) {
    case 3:
      Dot::template tile<3, NR>(xm, k, w, k, om, n_total, prefetch);
      break;
    case 2:
      Dot::template tile<2, NR>(xm, k, w, k, om, n_total, prefetch);
      break;
    case 1:
      Dot::template tile<1, NR>(xm, k, w, k, om, n_total, prefetch);
      break;
    default:
      break;
  }
}

// weight rows [n_begin, n_end) of group g's weight against the group's rows, into out (row width n_total).
template <class Dot, typename weight_t>
void weight_rows(const typename Dot::x_t* x, const weight_t* w, float* out, int64_t m0, int64_t m1, int64_t k, int64_t n_total,
                 int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  constexpr int64_t tile = Dot::kWeightTile;
  for (; n + tile <= n_end; n += tile) {
    rows_by_weight_tile<Dot, tile>(x, w + n * k, out, m0, m1, k, n_total, n);
  }
  for (; n < n_end; ++n) rows_by_weight_tile<Dot, 1>(x, w + n * k, out, m0, m1, k, n_total, n);
}

// gated: weight [G, 2I, K] holds each group's [gate; up] and out is [T, I] = silu(gate) * up. A task then
// takes gate columns [j, j + tile) with the matching up columns, so its epilogue finds both in `scratch`
// ([T, 2I]) while they are still in cache: the gate never makes a pass of its own.
template <class Dot, typename weight_t>
void grouped_linear(const typename Dot::x_t* x, const weight_t* weight, const int64_t* offsets, float* out, float* scratch,
                    int64_t groups, int64_t n_total, int64_t k, bool gated) {
  const int64_t n_out = gated ? n_total / 2 : n_total;
  const int64_t tile = gated ? kTaskWeightRows / 2 : kTaskWeightRows;  // the same weight rows per task
  const int64_t tasks_per_group = (n_out + tile - 1) / tile;
  at::parallel_for(0, groups * tasks_per_group, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / tasks_per_group;
      const int64_t m0 = offsets[g], m1 = offsets[g + 1];
      if (m0 == m1) continue;
      const int64_t n_begin = (task % tasks_per_group) * tile;
      const int64_t n_end = std::min(n_out, n_begin + tile);
      const weight_t* w = weight + g * n_total * k;
      if (!gated) {
        weight_rows<Dot>(x, w, out, m0, m1, k, n_total, n_begin, n_end);
        continue;
      }
      weight_rows<Dot>(x, w, scratch, m0, m1, k, n_total, n_begin, n_end);
      weight_rows<Dot>(x, w, scratch, m0, m1, k, n_total, n_out + n_begin, n_out + n_end);
      for (int64_t m = m0; m < m1; ++m) {
        const float* row = scratch + m * n_total;
        silu_mul_row(row + n_begin, row + n_out + n_begin, n_end - n_begin, out + m * n_out + n_begin);
      }
    }
  });
}

// fp32 rows x against an fp32 or bf16 weight through a widening Dot.
template <class Dot>
void widened(const torch::Tensor& x, const torch::Tensor& weight, const int64_t* offsets, torch::Tensor& out,
             float* scratch, int64_t groups, int64_t n, int64_t k, bool gated) {
  if (weight.scalar_type() == torch::kFloat32) {
    grouped_linear<Dot>(x.data_ptr<float>(), weight.data_ptr<float>(), offsets, out.data_ptr<float>(), scratch,
                        groups, n, k, gated);
  } else {
    grouped_linear<Dot>(x.data_ptr<float>(), reinterpret_cast<const c10::BFloat16*>(weight.data_ptr()), offsets,
                        out.data_ptr<float>(), scratch, groups, n, k, gated);
  }
}

#ifdef MOELAUNCH_HAS_AMX
// The AMX tiles over x's rows as they are (bf16, or fp32 rounded to bf16 as they are packed) into out.
void tile_products(const torch::Tensor& x, const c10::BFloat16* weight, const moelaunch::grouped_amx::Layout& layout,
                   torch::Tensor& out, int64_t n, int64_t k, bool gated) {
  ++isa::amx_calls();
  if (x.scalar_type() == torch::kBFloat16) {
    moelaunch::grouped_amx::grouped_linear(reinterpret_cast<const c10::BFloat16*>(x.data_ptr()), weight, layout,
                                           out.data_ptr<float>(), n, k, gated);
  } else {
    moelaunch::grouped_amx::grouped_linear(x.data_ptr<float>(), weight, layout, out.data_ptr<float>(), n, k, gated);
  }
}
#endif

}  // namespace

// x [T, K] fp32 or bf16 with rows grouped; weight [G, N, K] fp32 or bf16; offsets [G + 1] int64,
// non-decreasing, offsets[0] = 0 and offsets[G] = T; path: cpu_isa.h's (-1: the best built). Returns
// [T, N] fp32, or with gated (N even: each group's [gate; up]) [T, N / 2] = silu(x @ gate^T) * (x @ up^T).
// A bf16 weight runs the AMX tiles on the Amx path (shapes that fit: grouped_linear_amx.h; fp32 rows
// rounded to bf16); bf16 x with a bf16 weight runs vdpbf16ps on the AVX512-BF16 path; other bf16 rows are
// widened first.
torch::Tensor grouped_linear_cpu(torch::Tensor x, torch::Tensor weight, torch::Tensor offsets, bool gated,
                                 int64_t path) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "x must be fp32 or bf16");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 3 && offsets.dim() == 1, "x [T, K], weight [G, N, K], offsets [G+1]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && offsets.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(offsets.scalar_type() == torch::kInt64 && offsets.size(0) == weight.size(0) + 1,
              "offsets must be int64 with one more entry than groups");
  TORCH_CHECK(weight.size(2) == x.size(1), "x and weight disagree on K");
  TORCH_CHECK(!gated || weight.size(1) % 2 == 0, "a gated weight stacks [gate; up]: N must be even");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 || weight.scalar_type() == torch::kBFloat16,
              "weight dtype must be fp32 or bf16, got ", weight.scalar_type());
  const int64_t groups = weight.size(0), n = weight.size(1), k = weight.size(2);
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[groups] == x.size(0), "offsets must start at 0 and end at x's row count");
  const auto fp32 = x.options().dtype(torch::kFloat32);
  auto out = torch::empty({x.size(0), gated ? n / 2 : n}, fp32);
  const auto* w16 = reinterpret_cast<const c10::BFloat16*>(weight.data_ptr());
#ifdef MOELAUNCH_HAS_AMX
  if (weight.scalar_type() == torch::kBFloat16 && isa::resolve(path) >= isa::kAmx &&
      moelaunch::grouped_amx::fits(gated ? n / 2 : n, k)) {
    tile_products(x, w16, moelaunch::grouped_amx::Layout::grouped(off, groups, k, out.size(1)), out, n, k, gated);
    return out;
  }
#endif
  const bool bf16_dot = x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16 &&
                        isa::resolve(path) >= isa::kAvx512Bf16;
  if (!bf16_dot) x = x.to(torch::kFloat32);  // no copy when it already is
  auto scratch = gated ? torch::empty({x.size(0), n}, fp32) : torch::Tensor();
  float* sp = gated ? scratch.data_ptr<float>() : nullptr;
#ifdef MOELAUNCH_HAS_AVX512_BF16
  if (bf16_dot) {
    ++isa::bf16_dot_calls();
    grouped_linear<Bf16Dot>(reinterpret_cast<const c10::BFloat16*>(x.data_ptr()), w16, off, out.data_ptr<float>(),
                            sp, groups, n, k, gated);
    return out;
  }
#endif
#ifdef MOELAUNCH_HAS_AVX512
  if (isa::resolve(path) >= isa::kAvx512) {
    widened<Widen16Dot>(x, weight, off, out, sp, groups, n, k, gated);
    return out;
  }
#endif
  widened<WidenDot>(x, weight, off, out, sp, groups, n, k, gated);
  return out;
}

// x [R, H, K] (fp32 or bf16, rows with unit stride) times stack[h]^T ([H, N, K] bf16) for each head h ->
// [R, H, N] fp32, through the AMX tiles: the absorbed MLA products of a decode step read in place, with
// no transposed copy of x in or of the result out. Shapes the tiles do not fit, and paths below Amx, are
// refused (the caller asks first: grouped_linear_cpu.py).
torch::Tensor per_head_linear_cpu(torch::Tensor x, torch::Tensor stack, int64_t path) {
  TORCH_CHECK(x.dim() == 3 && stack.dim() == 3 && x.size(1) == stack.size(0) && x.size(2) == stack.size(2),
              "x [R, H, K] and stack [H, N, K]");
  TORCH_CHECK(x.stride(2) == 1 && stack.is_contiguous(), "x's rows and the stack must be contiguous");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "x must be fp32 or bf16");
  TORCH_CHECK(stack.scalar_type() == torch::kBFloat16, "the stack must be bf16");
  const int64_t rows = x.size(0), heads = x.size(1), n = stack.size(1), k = x.size(2);
  auto out = torch::empty({rows, heads, n}, x.options().dtype(torch::kFloat32));
#ifdef MOELAUNCH_HAS_AMX
  TORCH_CHECK(isa::resolve(path) >= isa::kAmx && moelaunch::grouped_amx::fits(n, k),
              "per_head_linear_cpu needs the AMX tiles and K, N multiples of 32 and 16");
  const auto* w16 = reinterpret_cast<const c10::BFloat16*>(stack.data_ptr());
  tile_products(x, w16, moelaunch::grouped_amx::Layout::heads(rows, heads, x.stride(0), x.stride(1), n), out, n, k,
                false);
  return out;
#else
  TORCH_CHECK(false, "per_head_linear_cpu needs the AMX tiles, which this build has not");
#endif
}
