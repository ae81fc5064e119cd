// Paged MLA decode attention in the absorbed (latent) form, for the CPU.
//
// Same contract and numerics as kernels/mla_decode_reference.py, without its padded gather: every
// (row, group of heads) walks its own block table and reads each cached token straight from the pool,
// one block at a time, with an online softmax (running max and sum per head, fp32). Slots past a row's
// length, or before its start (a sliding window gives one), are never read, so they may hold anything.
//
// Within a block both products are register-tiled so that each load feeds several FMAs: scores take
// 4 heads x 3 tokens per pass over the 576-wide rows (7 loads per 12 FMAs), and the weighted sum takes
// 4 heads x 16 latent columns per pass over the block's tokens (6 loads per 8 FMAs). A head-by-head
// loop instead re-reads every token once per head and stores its accumulator after every FMA, which
// left the FMA units mostly idle.
//
// Three paths compute the products (chosen per call, cpu_isa.h). A bf16 query over a bf16 cache takes
// vdpbf16ps where the CPU has AVX512-BF16 (Bf16Attention): scores as bf16 dot products with fp32 sums,
// and the weighted sum with each softmax weight rounded to bf16 (relative error <= 2^-9 per weight;
// the running sum adds the rounded weights, so they still sum to one); where the CPU also has AMX
// tiles, the same products run as tile multiplies (mla_decode_amx.h). Everything else widens bf16 to
// fp32 (an fp8 cache a block at a time): 16-lane FMAs on an AVX-512 path (Widen16Attention, the fp32
// model's decode), 8-lane ones below it (WidenAttention).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "bf16_dot.h"
#include "cpu_isa.h"
#include "fp8_e4m3.h"
#include "mla_decode_amx.h"
#include "prefetch.h"
#include "scratch.h"
#include "simd.h"
#include "widen16.h"

namespace {

using moelaunch::exp8;
using moelaunch::hsum;
using moelaunch::in_register;
using moelaunch::lane_sums;
using moelaunch::kLanes;
using moelaunch::load8;
using moelaunch::Scratch;
using moelaunch::SpreadPrefetcher;
using moelaunch::store8;
using moelaunch::to_float;
using moelaunch::vec8;
namespace isa = moelaunch::isa;
namespace fp8 = moelaunch::fp8;

// Heads that share one pass over a row's tokens: each block is loaded once for all of them.
constexpr int64_t kHeadsPerTask = 16;
// Heads per register tile; a task's heads are padded to a multiple of it with zero queries.
constexpr int64_t kHeadTile = 4;
// Latent vectors per head in a weighted-sum tile: 4 x 2 accumulators beat both 4 x 3 and one pass of
// 8 heads x 1 (which broadcasts eight probabilities per loaded vector) by 15-25 % in isolation.
constexpr int kWeightedSumVectors = 2;

// scores[h * stride + t] = q[h] . tokens[t] for kHeadTile heads and TT tokens of `width` values; one
// prefetch tick per step.
template <int TT, typename cache_t>
inline void score_tile(const float* q, const cache_t* tokens, int64_t width, float* scores, int64_t stride,
                       SpreadPrefetcher& fetch) {
  vec8 acc[kHeadTile][TT] = {};
  int64_t i = 0;
  for (; i + kLanes <= width; i += kLanes) {
    fetch.tick();
    vec8 k[TT];
    for (int t = 0; t < TT; ++t) k[t] = in_register(load8(tokens + t * width + i));
    for (int h = 0; h < kHeadTile; ++h) {
      const vec8 qh = in_register(load8(q + h * width + i));
      for (int t = 0; t < TT; ++t) acc[h][t] += qh * k[t];
    }
  }
  constexpr int kTile = kHeadTile * TT;
  float sums[kTile];
  for (int j = 0; j < kTile; j += 8) {
    const vec8 part = lane_sums(&acc[0][0] + j, std::min(8, kTile - j));
    for (int l = 0; l < std::min(8, kTile - j); ++l) sums[j + l] = part[l];
  }
  for (int h = 0; h < kHeadTile; ++h) {
    for (int t = 0; t < TT; ++t) {
      float s = sums[h * TT + t];
      for (int64_t j = i; j < width; ++j) s += q[h * width + j] * to_float(tokens[t * width + j]);
      scores[h * stride + t] = s;
    }
  }
}

// acc[h][c:c + V * 8] += sum_t probs[h * stride + t] * tokens[t][c:c + V * 8] for HT heads; one
// prefetch tick per token.
template <int HT, int V, typename cache_t>
inline void weighted_sum_chunk(const float* probs, int64_t stride, const cache_t* tokens, int64_t n, int64_t width,
                               int64_t c_dim, int64_t c, float* acc, SpreadPrefetcher& fetch) {
  vec8 a[HT][V];
  for (int h = 0; h < HT; ++h) {
    for (int v = 0; v < V; ++v) a[h][v] = load8(acc + h * c_dim + c + v * kLanes);
  }
  for (int64_t t = 0; t < n; ++t) {
    fetch.tick();
    vec8 k[V];
    for (int v = 0; v < V; ++v) k[v] = in_register(load8(tokens + t * width + c + v * kLanes));
    for (int h = 0; h < HT; ++h) {
      const float p = probs[h * stride + t];
      for (int v = 0; v < V; ++v) a[h][v] += p * k[v];
    }
  }
  for (int h = 0; h < HT; ++h) {
    for (int v = 0; v < V; ++v) store8(acc + h * c_dim + c + v * kLanes, a[h][v]);
  }
}

// acc[h][0:c_dim] += sum_t probs[h * stride + t] * tokens[t][0:c_dim] for HT heads: chunks of V vectors,
// then single vectors, then scalars.
template <int HT, int V, typename cache_t>
inline void weighted_sum(const float* probs, int64_t stride, const cache_t* tokens, int64_t n, int64_t width,
                         int64_t c_dim, float* acc, SpreadPrefetcher& fetch) {
  int64_t c = 0;
  for (; c + V * kLanes <= c_dim; c += V * kLanes) {
    weighted_sum_chunk<HT, V>(probs, stride, tokens, n, width, c_dim, c, acc, fetch);
  }
  for (; c + kLanes <= c_dim; c += kLanes) {
    weighted_sum_chunk<HT, 1>(probs, stride, tokens, n, width, c_dim, c, acc, fetch);
  }
  for (; c < c_dim; ++c) {
    for (int64_t t = 0; t < n; ++t) {
      const float k = to_float(tokens[t * width + c]);
      for (int h = 0; h < HT; ++h) acc[h * c_dim + c] += probs[h * stride + t] * k;
    }
  }
}

// An fp8 (e4m3fn) cache: bytes, dequantized a block at a time into scratch of the queries' type (below).
struct Fp8Cache {
  uint8_t bits;
};

// The widening path: fp32 queries; fp32, bf16 or (dequantized) fp8 tokens widened to fp32; 8-lane FMAs.
struct WidenAttention {
  using q_t = float;

  // Floats per head in the accumulator: the latent columns in order.
  static int64_t acc_width(int64_t c_dim) { return c_dim; }
  static vec8 round(vec8 p) { return p; }
  static float round(float p) { return p; }

  template <int TT, typename cache_t>
  static void score(const float* q, const cache_t* tokens, int64_t width, float* scores, int64_t stride,
                    SpreadPrefetcher& fetch) {
    score_tile<TT>(q, tokens, width, scores, stride, fetch);
  }

  template <typename cache_t>
  static void accumulate(const float* probs, int64_t stride, const cache_t* tokens, int64_t n, int64_t width,
                         int64_t c_dim, float* acc, SpreadPrefetcher& fetch) {
    weighted_sum<kHeadTile, kWeightedSumVectors>(probs, stride, tokens, n, width, c_dim, acc, fetch);
  }

  // Prefetch ticks of one head tile over n tokens (score and accumulate tick once per step).
  static int64_t ticks(int64_t n, int64_t width, int64_t c_dim) {
    return (n + 2) / 3 * (width / kLanes) + c_dim / (kLanes * kWeightedSumVectors) * n;
  }

  static void write_out(const float* acc, float inv, int64_t c_dim, float* out) {
    for (int64_t c = 0; c < c_dim; ++c) out[c] = acc[c] * inv;
  }
};

#ifdef MOELAUNCH_HAS_AVX512
namespace widen16 = moelaunch::widen16;

// The widening path at 16 lanes (AVX-512), for fp32 queries (the fp32 model): the same products as
// WidenAttention, whose 8-lane vectors left half of each FMA unused. The weighted sum takes 4 heads x 4
// vectors of 64 columns per pass (32 registers hold them); tails of the width and of c_dim are masked.
struct Widen16Attention : WidenAttention {
  static constexpr int kVectors = 4;

  template <int TT, typename cache_t>
  static void score(const float* q, const cache_t* tokens, int64_t width, float* scores, int64_t stride,
                    SpreadPrefetcher& fetch) {
    constexpr int kTile = kHeadTile * TT;
    __m512 acc[kTile];
    for (auto& a : acc) a = _mm512_setzero_ps();
    auto step = [&](int64_t i, auto load) {
      __m512 k[TT];
      for (int t = 0; t < TT; ++t) k[t] = load(tokens + t * width + i);
      for (int h = 0; h < kHeadTile; ++h) {
        const __m512 qh = load(q + h * width + i);
        for (int t = 0; t < TT; ++t) acc[h * TT + t] = _mm512_fmadd_ps(qh, k[t], acc[h * TT + t]);
      }
    };
    int64_t i = 0;
    for (; i + widen16::kStep <= width; i += widen16::kStep) {
      fetch.tick();
      step(i, [](const auto* p) { return widen16::load(p); });
    }
    if (i < width) step(i, [n = width - i](const auto* p) { return widen16::load_first(p, n); });
    for (int h = 0; h < kHeadTile; ++h) {
      for (int t = 0; t < TT; ++t) scores[h * stride + t] = _mm512_reduce_add_ps(acc[h * TT + t]);
    }
  }

  template <typename cache_t>
  static void accumulate(const float* probs, int64_t stride, const cache_t* tokens, int64_t n, int64_t width,
                         int64_t c_dim, float* acc, SpreadPrefetcher& fetch) {
    constexpr int64_t kCols = kVectors * widen16::kStep;
    int64_t c = 0;
    for (; c + kCols <= c_dim; c += kCols) chunk<kVectors>(probs, stride, tokens, n, width, c_dim, c, acc, fetch);
    for (; c < c_dim; c += widen16::kStep) chunk<1>(probs, stride, tokens, n, width, c_dim, c, acc, fetch);
  }

  // acc[h][c:c + V * 16] += sum_t probs[h * stride + t] * tokens[t][c:...] for kHeadTile heads, columns
  // past c_dim masked off.
  template <int V, typename cache_t>
  static void chunk(const float* probs, int64_t stride, const cache_t* tokens, int64_t n, int64_t width,
                    int64_t c_dim, int64_t c, float* acc, SpreadPrefetcher& fetch) {
    const int64_t cols = std::min<int64_t>(c_dim - c - (V - 1) * widen16::kStep, widen16::kStep);  // last vector's
    const __mmask16 last = static_cast<__mmask16>((1u << cols) - 1);
    const auto mask = [&](int v) { return v == V - 1 ? last : static_cast<__mmask16>(0xffff); };
    __m512 a[kHeadTile][V];
    for (int h = 0; h < kHeadTile; ++h) {
      for (int v = 0; v < V; ++v) a[h][v] = _mm512_maskz_loadu_ps(mask(v), acc + h * c_dim + c + v * widen16::kStep);
    }
    for (int64_t t = 0; t < n; ++t) {
      fetch.tick();
      __m512 k[V];
      for (int v = 0; v < V; ++v) {
        const cache_t* p = tokens + t * width + c + v * widen16::kStep;
        k[v] = v == V - 1 && cols < widen16::kStep ? widen16::load_first(p, cols) : widen16::load(p);
      }
      for (int h = 0; h < kHeadTile; ++h) {
        const __m512 weight = _mm512_set1_ps(probs[h * stride + t]);
        for (int v = 0; v < V; ++v) a[h][v] = _mm512_fmadd_ps(weight, k[v], a[h][v]);
      }
    }
    for (int h = 0; h < kHeadTile; ++h) {
      for (int v = 0; v < V; ++v) _mm512_mask_storeu_ps(acc + h * c_dim + c + v * widen16::kStep, mask(v), a[h][v]);
    }
  }

  static int64_t ticks(int64_t n, int64_t width, int64_t c_dim) {
    return (n + 2) / 3 * (width / widen16::kStep) + c_dim / (kVectors * widen16::kStep) * n;
  }
};
#endif

#ifdef MOELAUNCH_HAS_AVX512_BF16
namespace bf16 = moelaunch::bf16;
using BF16 = c10::BFloat16;

// The bf16 path: bf16 queries and cache, products through vdpbf16ps with fp32 sums.
struct Bf16Attention {
  using q_t = BF16;
  // Latent columns per accumulator chunk: a token pair's 32 columns interleave into two 16-lane vectors.
  static constexpr int64_t kCols = 32;
  // Tokens whose weights are packed at a time, as kTokens / 2 bf16 pairs per head.
  static constexpr int64_t kTokens = 32;

  // The accumulator holds each chunk of 32 columns as the interleave leaves them (see write_out), zero
  // past c_dim up to a whole chunk.
  static int64_t acc_width(int64_t c_dim) { return (c_dim + kCols - 1) / kCols * kCols; }

  // p rounded to bf16 (to nearest, ties to even; p is a finite softmax weight), kept in fp32.
  static vec8 round(vec8 p) {
    moelaunch::u32x8 bits;
    std::memcpy(&bits, &p, sizeof bits);
    bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    std::memcpy(&p, &bits, sizeof p);
    return p;
  }
  static float round(float p) { return static_cast<float>(BF16(p)); }

  // scores[h * stride + t] = q[h] . tokens[t] for kHeadTile heads and TT tokens, 32 values a step.
  template <int TT>
  static void score(const BF16* q, const BF16* tokens, int64_t width, float* scores, int64_t stride,
                    SpreadPrefetcher& fetch) {
    constexpr int kTile = kHeadTile * TT;
    __m512 acc[kTile];
    for (auto& a : acc) a = _mm512_setzero_ps();
    auto step = [&](int64_t i, auto load) {
      __m512bh k[TT];
      for (int t = 0; t < TT; ++t) k[t] = load(tokens + t * width + i);
      for (int h = 0; h < kHeadTile; ++h) {
        const __m512bh qh = load(q + h * width + i);
        for (int t = 0; t < TT; ++t) acc[h * TT + t] = _mm512_dpbf16_ps(acc[h * TT + t], qh, k[t]);
      }
    };
    int64_t i = 0;
    for (; i + bf16::kStep <= width; i += bf16::kStep) {
      fetch.tick();
      step(i, [](const BF16* p) { return bf16::load(p); });
    }
    if (i < width) step(i, [n = width - i](const BF16* p) { return bf16::load_first(p, n); });
    alignas(64) float sums[16];
    _mm512_store_ps(sums, bf16::lane_sums(acc, kTile));
    for (int h = 0; h < kHeadTile; ++h) {
      for (int t = 0; t < TT; ++t) scores[h * stride + t] = sums[h * TT + t];
    }
  }

  // acc[h] += sum_t probs[h * stride + t] * tokens[t][0:c_dim] for kHeadTile heads (probs already
  // rounded to bf16), two tokens per vdpbf16ps: a token pair's rows interleaved into (t, t+1) value
  // pairs (vpunpck{l,h}wd), each head's two weights broadcast as one bf16 pair. Up to 32 tokens at a
  // time, their weights packed on the stack; V chunks of 32 columns per pass.
  static void accumulate(const float* probs, int64_t stride, const BF16* tokens, int64_t n, int64_t width,
                         int64_t c_dim, float* acc, SpreadPrefetcher& fetch) {
    const int64_t acc_w = acc_width(c_dim);
    alignas(64) uint32_t pairs[kHeadTile][kTokens / 2];
    for (int64_t t0 = 0; t0 < n; t0 += kTokens) {
      const int64_t nt = std::min(kTokens, n - t0);
      for (int h = 0; h < kHeadTile; ++h) {
        for (int64_t j = 0; j < (nt + 1) / 2; ++j) {
          uint32_t lo, hi = 0;
          std::memcpy(&lo, probs + h * stride + t0 + 2 * j, sizeof lo);
          if (2 * j + 1 < nt) std::memcpy(&hi, probs + h * stride + t0 + 2 * j + 1, sizeof hi);
          pairs[h][j] = (lo >> 16) | (hi & 0xffff0000u);  // exact: both already bf16 values
        }
      }
      const BF16* block = tokens + t0 * width;
      int64_t c = 0;
      for (; c + 2 * kCols <= c_dim; c += 2 * kCols) chunk<2>(pairs, block, nt, width, c, c_dim, acc_w, acc, fetch);
      for (; c < c_dim; c += kCols) chunk<1>(pairs, block, nt, width, c, c_dim, acc_w, acc, fetch);
    }
  }

  template <int V>
  static void chunk(const uint32_t (*pairs)[kTokens / 2], const BF16* tokens, int64_t nt, int64_t width, int64_t c,
                    int64_t c_dim, int64_t acc_w, float* acc, SpreadPrefetcher& fetch) {
    __m512 a[kHeadTile][V][2];
    for (int h = 0; h < kHeadTile; ++h) {
      for (int v = 0; v < V; ++v) {
        for (int half = 0; half < 2; ++half) a[h][v][half] = _mm512_loadu_ps(acc + h * acc_w + c + v * kCols + 16 * half);
      }
    }
    const int64_t cols = c_dim - c;  // columns left; a chunk past c_dim reads zeros, not the k_pe values
    auto row = [&](const BF16* p, int v) {
      const int64_t left = cols - v * kCols;
      return left >= kCols ? _mm512_loadu_si512(p + v * kCols)
                           : _mm512_maskz_loadu_epi16(static_cast<__mmask32>((uint64_t{1} << left) - 1), p + v * kCols);
    };
    for (int64_t j = 0; j < (nt + 1) / 2; ++j) {
      fetch.tick();
      const BF16* first = tokens + 2 * j * width + c;
      const bool second = 2 * j + 1 < nt;
      __m512bh lo[V], hi[V];
      for (int v = 0; v < V; ++v) {
        const __m512i t0 = row(first, v), t1 = second ? row(first + width, v) : _mm512_setzero_si512();
        lo[v] = (__m512bh)_mm512_unpacklo_epi16(t0, t1);
        hi[v] = (__m512bh)_mm512_unpackhi_epi16(t0, t1);
      }
      for (int h = 0; h < kHeadTile; ++h) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[h][j]));
        for (int v = 0; v < V; ++v) {
          a[h][v][0] = _mm512_dpbf16_ps(a[h][v][0], p, lo[v]);
          a[h][v][1] = _mm512_dpbf16_ps(a[h][v][1], p, hi[v]);
        }
      }
    }
    for (int h = 0; h < kHeadTile; ++h) {
      for (int v = 0; v < V; ++v) {
        for (int half = 0; half < 2; ++half) _mm512_storeu_ps(acc + h * acc_w + c + v * kCols + 16 * half, a[h][v][half]);
      }
    }
  }

  static int64_t ticks(int64_t n, int64_t width, int64_t c_dim) {
    return (n + 2) / 3 * (width / bf16::kStep) + (n + 1) / 2 * (c_dim / (2 * kCols));
  }

  static void write_out(const float* acc, float inv, int64_t c_dim, float* out) {
    bf16::write_interleaved_columns(acc, inv, c_dim, out);
  }
};
#endif

template <class Attn, typename cache_t, typename index_t>
void decode_rows(const typename Attn::q_t* q_latent, const typename Attn::q_t* q_pe, const cache_t* cache,
                 const index_t* block_table,
                 const int64_t* seq_lens, const int64_t* starts, float* out, int64_t rows, int64_t heads,
                 int64_t c_dim, int64_t p_dim, int64_t block_size, int64_t max_blocks, float scale,
                 const float* cache_scales) {
  const int64_t width = c_dim + p_dim, acc_w = Attn::acc_width(c_dim);
  const int64_t head_groups = (heads + kHeadsPerTask - 1) / kHeadsPerTask;
  // Where row r's walk begins: the block holding its first token (0 without starts).
  auto first_block_start = [&](int64_t r) { return starts ? starts[r] - starts[r] % block_size : int64_t{0}; };
  at::parallel_for(0, rows * head_groups, 1, [&](int64_t begin, int64_t end) {
    constexpr int64_t padded = kHeadsPerTask;  // a multiple of kHeadTile
    Scratch<typename Attn::q_t> q(padded * width);
    Scratch<> acc(padded * acc_w), probs(padded * block_size);
    constexpr bool kFp8 = std::is_same_v<cache_t, Fp8Cache>;
    Scratch<typename Attn::q_t> dequantized(kFp8 ? block_size * width : 0);  // in the queries' type
    std::vector<float> running_max(padded), running_sum(padded);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / head_groups;
      const int64_t h0 = (task % head_groups) * kHeadsPerTask;
      const int64_t nh = std::min(kHeadsPerTask, heads - h0);
      const int64_t nh_tiles = (nh + kHeadTile - 1) / kHeadTile;
      const int64_t len = seq_lens[r];
      // Each head's query as one [latent | rope] row, so a score is one dot with a cached [c | k_pe] row.
      q.zero();
      for (int64_t h = 0; h < nh; ++h) {
        std::copy_n(q_latent + (r * heads + h0 + h) * c_dim, c_dim, q.data() + h * width);
        std::copy_n(q_pe + (r * heads + h0 + h) * p_dim, p_dim, q.data() + h * width + c_dim);
      }
      acc.zero();
      std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(running_sum.begin(), running_sum.end(), 0.f);
      for (int64_t start = first_block_start(r); start < len; start += block_size) {
        // The first block may begin before the row's first token: its walk skips `skip` slots.
        const int64_t skip = starts ? std::max<int64_t>(starts[r] - start, 0) : 0;
        const int64_t n = std::min(block_size, len - start) - skip;
        const int64_t block_id = static_cast<int64_t>(block_table[r * max_blocks + start / block_size]);
        const cache_t* stored = cache + (block_id * block_size + skip) * width;
        // An fp8 block is dequantized once per task (for all its heads), then read like an fp32 or a
        // bf16 one.
        const auto* block = [&] {
          if constexpr (kFp8) {
            const float* token_scales = cache_scales + (block_id * block_size + skip) * 2;
            fp8::dequantize_tokens(reinterpret_cast<const uint8_t*>(stored), token_scales, n, width, c_dim,
                                   dequantized.data());
            return static_cast<const typename Attn::q_t*>(dequantized.data());
          } else {
            return stored;
          }
        }();
        // What this task reads next (its row's next block, or the next task's first block) sits
        // elsewhere in the pool, where the hardware prefetcher cannot guess it.
        SpreadPrefetcher fetch;
        const int64_t next = start + block_size;
        const bool same_row = next < len;
        const int64_t next_row = same_row ? r : (task + 1 < end ? (task + 1) / head_groups : -1);
        if (next_row >= 0) {
          const int64_t from = same_row ? next : first_block_start(next_row);
          const int64_t next_n = std::min(block_size, seq_lens[next_row] - from);
          const cache_t* next_block =
              cache + static_cast<int64_t>(block_table[next_row * max_blocks + from / block_size]) * block_size * width;
          const int64_t ticks = nh_tiles * Attn::ticks(n, width, c_dim);
          fetch = SpreadPrefetcher(next_block, next_n * width * static_cast<int64_t>(sizeof(cache_t)), ticks);
        }
        for (int64_t ht = 0; ht < nh_tiles; ++ht) {
          const auto* q_tile = q.data() + ht * kHeadTile * width;
          float* s_tile = probs.data() + ht * kHeadTile * block_size;
          int64_t t = 0;
          for (; t + 3 <= n; t += 3) {
            Attn::template score<3>(q_tile, block + t * width, width, s_tile + t, block_size, fetch);
          }
          if (t + 2 <= n) {
            Attn::template score<2>(q_tile, block + t * width, width, s_tile + t, block_size, fetch);
            t += 2;
          }
          if (t < n) {
            Attn::template score<1>(q_tile, block + t * width, width, s_tile + t, block_size, fetch);
          }
        }
        for (int64_t h = 0; h < nh_tiles * kHeadTile; ++h) {
          float* s = probs.data() + h * block_size;
          float block_max = running_max[h];
          for (int64_t t = 0; t < n; ++t) {
            s[t] *= scale;
            block_max = std::max(block_max, s[t]);
          }
          // Rescale what was accumulated under the old max; this block's tokens then add on top.
          const float correction = std::exp(running_max[h] - block_max);
          if (correction != 1.f) {
            running_sum[h] *= correction;
            float* acc_h = acc.data() + h * acc_w;
            for (int64_t c = 0; c < acc_w; ++c) acc_h[c] *= correction;
          }
          int64_t t = 0;
          for (; t + kLanes <= n; t += kLanes) {
            const vec8 p = Attn::round(exp8(load8(s + t) - block_max));
            store8(s + t, p);
            running_sum[h] += hsum(p);
          }
          for (; t < n; ++t) {
            s[t] = Attn::round(std::exp(s[t] - block_max));
            running_sum[h] += s[t];
          }
          running_max[h] = block_max;
        }
        for (int64_t ht = 0; ht < nh_tiles; ++ht) {
          Attn::accumulate(probs.data() + ht * kHeadTile * block_size, block_size, block, n, width, c_dim,
                           acc.data() + ht * kHeadTile * acc_w, fetch);
        }
      }
      for (int64_t h = 0; h < nh; ++h) {
        Attn::write_out(acc.data() + h * acc_w, 1.f / running_sum[h], c_dim, out + (r * heads + h0 + h) * c_dim);
      }
    }
  });
}

template <class Attn, typename cache_t>
void dispatch_index(const torch::Tensor& q_latent, const torch::Tensor& q_pe, const torch::Tensor& cache,
                    const torch::Tensor& block_table, const torch::Tensor& seq_lens, const int64_t* starts,
                    torch::Tensor& out, float scale, const float* cache_scales) {
  using q_t = typename Attn::q_t;
  const int64_t rows = q_latent.size(0), heads = q_latent.size(1), c_dim = q_latent.size(2);
  const auto* cache_ptr = reinterpret_cast<const cache_t*>(cache.data_ptr());
  auto run = [&](const auto* table) {
    decode_rows<Attn>(reinterpret_cast<const q_t*>(q_latent.data_ptr()), reinterpret_cast<const q_t*>(q_pe.data_ptr()),
                      cache_ptr, table, seq_lens.data_ptr<int64_t>(), starts, out.data_ptr<float>(), rows, heads,
                      c_dim, q_pe.size(2), cache.size(1), block_table.size(1), scale, cache_scales);
  };
  if (block_table.scalar_type() == torch::kInt32) {
    run(block_table.data_ptr<int32_t>());
  } else {
    run(block_table.data_ptr<int64_t>());
  }
}

#ifdef MOELAUNCH_HAS_AMX
// The AMX tiles (mla_decode_amx.h) over bf16 queries, the cached rows read through `pool`.
template <class Pool>
void amx_decode(const torch::Tensor& q_latent, const torch::Tensor& q_pe, const Pool& pool,
                const torch::Tensor& block_table, const torch::Tensor& seq_lens, const int64_t* first,
                torch::Tensor& out, int64_t block_size, float s) {
  ++isa::amx_calls();
  auto run = [&](const auto* table) {
    moelaunch::mla_amx::decode_rows(reinterpret_cast<const c10::BFloat16*>(q_latent.data_ptr()),
                                    reinterpret_cast<const c10::BFloat16*>(q_pe.data_ptr()), pool, table,
                                    seq_lens.data_ptr<int64_t>(), first, out.data_ptr<float>(), q_latent.size(0),
                                    q_latent.size(1), q_latent.size(2), q_pe.size(2), block_size, block_table.size(1), s);
  };
  if (block_table.scalar_type() == torch::kInt32) {
    run(block_table.data_ptr<int32_t>());
  } else {
    run(block_table.data_ptr<int64_t>());
  }
}
#endif

}  // namespace

// q_latent [R, H, C] and q_pe [R, H, P] fp32 or bf16 (both alike); cache [num_blocks, block_size, C + P]
// fp32 or bf16; block_table [R, max_blocks] int32/int64; seq_lens [R] int64 (>= 1); starts [R] int64
// (< seq_lens), the first position each row attends to (default 0); path: cpu_isa.h's (-1: the best
// built). Returns [R, H, C] fp32. bf16 queries over a bf16 cache run the AMX tiles on the Amx path
// (mla_decode_amx.h; where C and C + P are multiples of 32) and vdpbf16ps on the AVX512-BF16 path (and on
// the Amx path for other shapes); other bf16 queries are widened first.
torch::Tensor paged_mla_decode_cpu(torch::Tensor q_latent, torch::Tensor q_pe, torch::Tensor cache,
                                   torch::Tensor block_table, torch::Tensor seq_lens, double scale,
                                   c10::optional<torch::Tensor> starts, int64_t path) {
  const auto q_dtype = q_latent.scalar_type();
  TORCH_CHECK((q_dtype == torch::kFloat32 || q_dtype == torch::kBFloat16) && q_pe.scalar_type() == q_dtype,
              "queries must be both fp32 or both bf16");
  TORCH_CHECK(q_latent.is_contiguous() && q_pe.is_contiguous() && cache.is_contiguous() &&
                  block_table.is_contiguous() && seq_lens.is_contiguous(),
              "inputs must be contiguous");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt64, "seq_lens must be int64");
  TORCH_CHECK(!starts || (starts->scalar_type() == torch::kInt64 && starts->is_contiguous()),
              "starts must be contiguous int64");
  TORCH_CHECK(cache.scalar_type() == torch::kFloat32 || cache.scalar_type() == torch::kBFloat16,
              "cache dtype must be fp32 or bf16, got ", cache.scalar_type());
  const int64_t* first = starts ? starts->data_ptr<int64_t>() : nullptr;
  auto out = torch::empty(q_latent.sizes(), q_latent.options().dtype(torch::kFloat32));
  const float s = static_cast<float>(scale);
  const isa::Path resolved = isa::resolve(path);
  [[maybe_unused]] const bool bf16_dot = q_dtype == torch::kBFloat16 && cache.scalar_type() == torch::kBFloat16 &&
                                         resolved >= isa::kAvx512Bf16;
#ifdef MOELAUNCH_HAS_AMX
  const int64_t c_dim = q_latent.size(2);
  if (bf16_dot && resolved == isa::kAmx && moelaunch::mla_amx::fits(c_dim + q_pe.size(2), c_dim)) {
    const moelaunch::mla_amx::Bf16Pool pool{reinterpret_cast<const c10::BFloat16*>(cache.data_ptr()), cache.size(1),
                                            cache.size(2)};
    amx_decode(q_latent, q_pe, pool, block_table, seq_lens, first, out, cache.size(1), s);
    return out;
  }
#endif
#ifdef MOELAUNCH_HAS_AVX512_BF16
  if (bf16_dot) {
    ++isa::bf16_dot_calls();
    dispatch_index<Bf16Attention, c10::BFloat16>(q_latent, q_pe, cache, block_table, seq_lens, first, out, s, nullptr);
    return out;
  }
#endif
  // The widening path reads fp32 queries (no copy when they are).
  q_latent = q_latent.to(torch::kFloat32);
  q_pe = q_pe.to(torch::kFloat32);
  auto widen = [&](auto attention) {
    using Attn = decltype(attention);
    if (cache.scalar_type() == torch::kFloat32) {
      dispatch_index<Attn, float>(q_latent, q_pe, cache, block_table, seq_lens, first, out, s, nullptr);
    } else {
      dispatch_index<Attn, c10::BFloat16>(q_latent, q_pe, cache, block_table, seq_lens, first, out, s, nullptr);
    }
  };
#ifdef MOELAUNCH_HAS_AVX512
  if (resolved >= isa::kAvx512) {
    widen(Widen16Attention{});
    return out;
  }
#endif
  widen(WidenAttention{});
  return out;
}


// The same for an fp8 (e4m3fn) cache with cache_scales [num_blocks, block_size, 2] fp32 (c_kv, k_pe
// scale per token): each block read is 1 byte per value, dequantized in the kernel; path as above. bf16
// queries on a path with bf16 dot products read its values dequantized to bf16, by the AMX tiles a
// 16-token piece at a time (where the widths fit them) or by vdpbf16ps a block at a time; other bf16
// queries are widened. Returns fp32.
torch::Tensor paged_mla_decode_fp8_cpu(torch::Tensor q_latent, torch::Tensor q_pe, torch::Tensor cache,
                                       torch::Tensor cache_scales, torch::Tensor block_table, torch::Tensor seq_lens,
                                       double scale, c10::optional<torch::Tensor> starts, int64_t path) {
  const auto q_dtype = q_latent.scalar_type();
  TORCH_CHECK((q_dtype == torch::kFloat32 || q_dtype == torch::kBFloat16) && q_pe.scalar_type() == q_dtype,
              "queries must be both fp32 or both bf16");
  TORCH_CHECK(q_latent.is_contiguous() && q_pe.is_contiguous() && cache.is_contiguous() &&
                  cache_scales.is_contiguous() && block_table.is_contiguous() && seq_lens.is_contiguous(),
              "inputs must be contiguous");
  TORCH_CHECK(cache.scalar_type() == at::ScalarType::Float8_e4m3fn, "cache must be float8_e4m3fn");
  TORCH_CHECK(cache_scales.scalar_type() == torch::kFloat32 && cache_scales.dim() == 3 &&
                  cache_scales.size(0) == cache.size(0) && cache_scales.size(1) == cache.size(1) &&
                  cache_scales.size(2) == 2,
              "cache_scales must be fp32 [num_blocks, block_size, 2]");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt64, "seq_lens must be int64");
  TORCH_CHECK(!starts || (starts->scalar_type() == torch::kInt64 && starts->is_contiguous()),
              "starts must be contiguous int64");
  const int64_t* first = starts ? starts->data_ptr<int64_t>() : nullptr;
  const float s = static_cast<float>(scale);
  const isa::Path resolved = isa::resolve(path);
#ifdef MOELAUNCH_HAS_AVX512_BF16
  if (q_dtype == torch::kBFloat16 && resolved >= isa::kAvx512Bf16) {
    auto out = torch::empty(q_latent.sizes(), q_latent.options().dtype(torch::kFloat32));
#ifdef MOELAUNCH_HAS_AMX
    const int64_t c_dim = q_latent.size(2);
    if (resolved == isa::kAmx && moelaunch::mla_amx::fits(c_dim + q_pe.size(2), c_dim)) {
      const moelaunch::mla_amx::Fp8Pool pool{reinterpret_cast<const uint8_t*>(cache.data_ptr()),
                                             cache_scales.data_ptr<float>(), cache.size(1), cache.size(2), c_dim};
      amx_decode(q_latent, q_pe, pool, block_table, seq_lens, first, out, cache.size(1), s);
      return out;
    }
#endif
    ++isa::bf16_dot_calls();
    dispatch_index<Bf16Attention, Fp8Cache>(q_latent, q_pe, cache, block_table, seq_lens, first, out, s,
                                            cache_scales.data_ptr<float>());
    return out;
  }
#endif
  q_latent = q_latent.to(torch::kFloat32);
  q_pe = q_pe.to(torch::kFloat32);
  auto out = torch::empty_like(q_latent);
#ifdef MOELAUNCH_HAS_AVX512
  if (resolved >= isa::kAvx512) {
    dispatch_index<Widen16Attention, Fp8Cache>(q_latent, q_pe, cache, block_table, seq_lens, first, out, s,
                                               cache_scales.data_ptr<float>());
    return out;
  }
#endif
  dispatch_index<WidenAttention, Fp8Cache>(q_latent, q_pe, cache, block_table, seq_lens, first, out, s,
                                           cache_scales.data_ptr<float>());
  return out;
}
