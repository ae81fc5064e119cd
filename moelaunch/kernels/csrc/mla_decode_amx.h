// Paged MLA decode through the AMX tiles: bf16 queries over a bf16 cache (the Amx path, cpu_isa.h).
//
// Same contract as paged_mla_decode_cpu and the numerics of its vdpbf16ps path (fp32 sums of bf16
// products, each softmax weight rounded to bf16 and the running sum adding the rounded weights), with
// both products as tile multiplies of 16 x 16 x 32 values per instruction (vdpbf16ps: 16 x 2):
// - scores, 16 tokens at a time: S[token][head] = sum over 32-value slices of the cached rows (the A
//   tile, loaded straight from the pool: 16 rows a row's stride apart) times the task's queries (B
//   tiles, packed once per task as value pairs per head);
// - weighted sum: O[head][column] += W[head][token] x cache[token][column], with the weights (rounded
//   to bf16, 32 tokens a row) as the A tile and the cache as B tiles: each token pair's rows interleaved
//   by vpunpck{l,h}wd, so that the columns come out in the order bf16::write_interleaved_columns undoes.
// The softmax keeps one lane per head (16 lanes) and rescales the accumulator once per segment of up to
// 64 tokens; the accumulator (16 heads x c_dim fp32) lives in memory, more than the 8 tile registers.
// Tile registers are not renamed: a load into a register waits until the multiply reading it is done,
// so consecutive steps alternate between two sets of registers and two independent sums run at once
// (one register set per step left the multiplies waiting on loads: a third of the time in one load).
// Width and c_dim must be multiples of 32 (DeepSeek-V3: 576 and 512); other shapes take vdpbf16ps.
#pragma once

#include "cpu_isa.h"

#ifdef MOELAUNCH_HAS_AMX
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "amx.h"
#include "bf16_dot.h"
#include "scratch.h"
#include "simd.h"

namespace moelaunch::mla_amx {

using BF16 = c10::BFloat16;
constexpr int64_t kHeads = 16;   // heads per task: the score tile's columns, the weight tile's rows
constexpr int64_t kTokens = 16;  // tokens per score tile
constexpr int64_t kSlice = amx::kSlice;  // bf16 values per tile row
constexpr int64_t kChunks = 2;   // weight tiles per segment (registers 4 and 5)
constexpr int64_t kSegment = kChunks * kSlice;
constexpr int64_t kPairTile = amx::kTileValues;

inline bool fits(int64_t width, int64_t c_dim) { return width % kSlice == 0 && c_dim % kSlice == 0; }

// v rounded to bf16 (to nearest, ties to even; finite values): the bf16 bits in each lane's high half.
inline u32x16 round_bf16_bits(vec16 v) {
  u32x16 bits;
  std::memcpy(&bits, &v, sizeof bits);
  return (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
}

inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// One task's queries [heads][width] ([latent | rope] per head) as B tiles, heads in the columns.
inline void pack_queries(const BF16* latent, const BF16* rope, int64_t heads, int64_t c_dim, int64_t p_dim,
                         uint32_t* tiles) {
  amx::pack_pairs(latent, heads, c_dim, c_dim, tiles);
  amx::pack_pairs(rope, heads, p_dim, p_dim, tiles + c_dim / kSlice * kPairTile);
}

// B tiles of tokens[2i] and tokens[2i + 1]'s columns c..c+31 interleaved, i < 16: `lo` and `hi` each 16
// rows of 16 pairs. Tokens at or past n are zeros (their weights are zero, and 0 x garbage may be NaN).
inline void interleave_pairs(const BF16* const* tokens, int64_t n, int64_t c, uint32_t* lo, uint32_t* hi) {
  for (int64_t i = 0; i < kTokens; ++i) {
    const int64_t t = 2 * i;
    const __m512i first = t < n ? _mm512_loadu_si512(tokens[t] + c) : _mm512_setzero_si512();
    const __m512i second = t + 1 < n ? _mm512_loadu_si512(tokens[t + 1] + c) : _mm512_setzero_si512();
    _mm512_store_si512(lo + i * kHeads, _mm512_unpacklo_epi16(first, second));
    _mm512_store_si512(hi + i * kHeads, _mm512_unpackhi_epi16(first, second));
  }
}

// The per-thread memory of decode_rows.
struct Workspace {
  explicit Workspace(int64_t width, int64_t c_dim)
      : queries(width / kSlice * kPairTile),
        pairs(8 * kPairTile),
        acc(kHeads * c_dim),
        scores((kSegment + 2 * kTokens) * kHeads),
        weights(kHeads * kSegment),
        partial(2 * kTokens * width) {}
  Scratch<uint32_t> queries, pairs;
  Scratch<> acc, scores;
  Scratch<uint16_t> weights;  // bf16 bits
  Scratch<BF16> partial;      // short pieces, copied and padded with zeros
  const BF16* tokens[kSegment];
};

// Scores (scaled) of the row's tokens [pos, pos + up to kSegment) into ws.scores [token][head], their
// rows' addresses into ws.tokens; returns the count. Pieces of up to 16 tokens sit in one block and
// go two at a time (an odd last piece is paired with itself).
template <typename index_t>
int64_t score_segment(Workspace& ws, const BF16* cache, const index_t* table, int64_t pos, int64_t len,
                      int64_t block_size, int64_t width, float scale) {
  const int64_t row_bytes = width * static_cast<int64_t>(sizeof(BF16));
  int64_t count = 0;
  while (pos < len && count < kSegment) {
    const BF16* piece[2];
    int64_t start[2], n_pieces = 0;
    for (; n_pieces < 2 && pos < len && count < kSegment; ++n_pieces) {
      const int64_t offset = pos % block_size;
      const int64_t n = std::min({kTokens, block_size - offset, len - pos, kSegment - count});
      const BF16* rows = cache + (static_cast<int64_t>(table[pos / block_size]) * block_size + offset) * width;
      for (int64_t t = 0; t < n; ++t) ws.tokens[count + t] = rows + t * width;
      if (n < kTokens) {  // the tile reads 16 rows: a short piece's are copied, then zeros
        BF16* copy = ws.partial.data() + n_pieces * kTokens * width;
        std::memcpy(copy, rows, n * row_bytes);
        std::memset(copy + n * width, 0, (kTokens - n) * row_bytes);
        rows = copy;
      }
      piece[n_pieces] = rows;
      start[n_pieces] = count;
      count += n;
      pos += n;
    }
    float* into = ws.scores.data();
    // A lone piece's twin goes past the segment's rows, where nothing reads it.
    amx::pair_products(piece[0], piece[n_pieces - 1], row_bytes, ws.queries.data(), width / kSlice,
                       into + start[0] * kHeads, into + (n_pieces == 2 ? start[1] : kSegment + kTokens) * kHeads);
  }
  for (int64_t t = 0; t < count; ++t) {
    const vec16 s = load16(ws.scores.data() + t * kHeads) * scale;
    std::memcpy(ws.scores.data() + t * kHeads, &s, sizeof s);
  }
  return count;
}

// acc[h] += weights[h] x tokens' columns for all 32-column chunks (acc[h] = on the first segment):
// accumulator halves in registers 0-1, the weights of tokens 0-31 in 4 and 32-63 in 5, their
// interleaved columns in 2-3 and 6-7. The interleave runs one chunk ahead into the other half of
// ws.pairs: a tile load of lines that vector stores have just written waits for them to reach the cache.
inline void weighted_sum(Workspace& ws, int64_t count, int64_t c_dim, bool first) {
  const int64_t chunks = (count + kSlice - 1) / kSlice, acc_stride = c_dim * static_cast<int64_t>(sizeof(float));
  constexpr int64_t weight_stride = kSegment * sizeof(uint16_t);
  auto interleave = [&](int64_t c, uint32_t* pairs) {
    interleave_pairs(ws.tokens, count, c, pairs, pairs + kPairTile);
    if (chunks > 1) interleave_pairs(ws.tokens + kSlice, count - kSlice, c, pairs + 2 * kPairTile, pairs + 3 * kPairTile);
  };
  _tile_loadd(4, ws.weights.data(), weight_stride);
  if (chunks > 1) _tile_loadd(5, ws.weights.data() + kSlice, weight_stride);
  interleave(0, ws.pairs.data());
  for (int64_t c = 0; c < c_dim; c += kSlice) {
    uint32_t* pairs = ws.pairs.data() + (c / kSlice % 2) * 4 * kPairTile;
    float* acc = ws.acc.data() + c;
    if (first) {
      _tile_zero(0);
      _tile_zero(1);
    } else {
      _tile_loadd(0, acc, acc_stride);
      _tile_loadd(1, acc + kHeads, acc_stride);
    }
    _tile_loadd(2, pairs, amx::kTileRowBytes);
    _tile_loadd(3, pairs + kPairTile, amx::kTileRowBytes);
    if (chunks > 1) {
      _tile_loadd(6, pairs + 2 * kPairTile, amx::kTileRowBytes);
      _tile_loadd(7, pairs + 3 * kPairTile, amx::kTileRowBytes);
    }
    if (c + kSlice < c_dim) interleave(c + kSlice, ws.pairs.data() + ((c / kSlice + 1) % 2) * 4 * kPairTile);
    _tile_dpbf16ps(0, 4, 2);
    _tile_dpbf16ps(1, 4, 3);
    if (chunks > 1) {
      _tile_dpbf16ps(0, 5, 6);
      _tile_dpbf16ps(1, 5, 7);
    }
    _tile_stored(0, acc, acc_stride);
    _tile_stored(1, acc + kHeads, acc_stride);
  }
}

template <typename index_t>
void decode_rows(const BF16* q_latent, const BF16* q_pe, const BF16* cache, const index_t* block_table,
                 const int64_t* seq_lens, const int64_t* starts, float* out, int64_t rows, int64_t heads,
                 int64_t c_dim, int64_t p_dim, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t width = c_dim + p_dim;
  const int64_t head_groups = (heads + kHeads - 1) / kHeads;
  at::parallel_for(0, rows * head_groups, 1, [&](int64_t begin, int64_t end) {
    amx::Tiles tiles;
    Workspace ws(width, c_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / head_groups;
      const int64_t h0 = (task % head_groups) * kHeads;
      const int64_t nh = std::min(kHeads, heads - h0);
      const int64_t len = seq_lens[r];
      pack_queries(q_latent + (r * heads + h0) * c_dim, q_pe + (r * heads + h0) * p_dim, nh, c_dim, p_dim,
                   ws.queries.data());
      vec16 running_max = vec16{} - std::numeric_limits<float>::infinity(), running_sum = vec16{};
      const int64_t first_pos = starts ? starts[r] : 0;
      for (int64_t pos = first_pos; pos < len;) {
        const bool first = pos == first_pos;
        const int64_t count =
            score_segment(ws, cache, block_table + r * max_blocks, pos, len, block_size, width, scale);
        pos += count;
        // Softmax over the segment, one lane per head; the accumulator rescaled to the new max.
        vec16 segment_max = running_max;
        for (int64_t t = 0; t < count; ++t) {
          const vec16 s = load16(ws.scores.data() + t * kHeads);
          segment_max = s > segment_max ? s : segment_max;
        }
        const vec16 correction = exp16(running_max - segment_max);
        running_sum *= correction;
        for (int64_t h = 0; h < nh && !first; ++h) {
          if (correction[h] == 1.f) continue;
          float* acc_h = ws.acc.data() + h * c_dim;
          for (int64_t c = 0; c < c_dim; ++c) acc_h[c] *= correction[h];
        }
        running_max = segment_max;
        // Each weight rounded to bf16, the sum adding the rounded values; stored transposed, [head][token],
        // 16 tokens at a time through one in-register transpose (one scalar store per weight took a tenth
        // of the kernel's time), zeros after the last token up to a whole chunk.
        const int64_t padded = (count + kSlice - 1) / kSlice * kSlice;
        for (int64_t t0 = 0; t0 < padded; t0 += kTokens) {
          alignas(64) u32x16 block[kTokens];  // [token][head]: each weight's bf16 bits in the high half
          for (int64_t i = 0; i < kTokens; ++i) {
            block[i] = u32x16{};
            if (t0 + i >= count) continue;
            block[i] = round_bf16_bits(exp16(load16(ws.scores.data() + (t0 + i) * kHeads) - segment_max));
            vec16 rounded;
            std::memcpy(&rounded, &block[i], sizeof rounded);
            running_sum += rounded;
          }
          __m512 by_head[kHeads];
          amx::columns16(reinterpret_cast<const float*>(block), by_head);
          for (int64_t h = 0; h < kHeads; ++h) {
            const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(by_head[h]), 16);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(ws.weights.data() + h * kSegment + t0),
                                _mm512_cvtepi32_epi16(bits));
          }
        }
        weighted_sum(ws, count, c_dim, first);
      }
      for (int64_t h = 0; h < nh; ++h) {
        bf16::write_interleaved_columns(ws.acc.data() + h * c_dim, 1.f / running_sum[h], c_dim,
                                        out + (r * heads + h0 + h) * c_dim);
      }
    }
  });
}

}  // namespace moelaunch::mla_amx

#endif
