// Paged MLA decode through the AMX tiles: bf16 queries over a bf16 cache, or over an fp8 one read as the
// bf16 values its codes stand for (the Amx path, cpu_isa.h).
//
// Same contract as paged_mla_decode_cpu and the numerics of its vdpbf16ps path (fp32 sums of bf16
// products, each softmax weight rounded to bf16 and the running sum adding the rounded weights), with
// both products as tile multiplies that read the cached rows straight from the pool (16 rows a row's
// stride apart), so nothing is copied per token:
// - scores, 16 tokens (one piece) at a time: S[token][head] = sum over 32-value slices of the cached
//   rows (the A tile) times the task's queries (B tiles, packed once per task as value pairs per head);
// - weighted sum, per 32-column chunk and piece: the cached rows are the B tile (token k's columns
//   2n, 2n + 1 as the pair of column n) and the weights the A tile, each weight beside a zero: in rows
//   0-7 of a tile as the pair's first value (heads 0-7 summing the even columns), in rows 8-15 as the
//   second (the odd columns). A tile multiply thus sums 16 tokens (32 with interleaved token pairs, which
//   cost a vector interleave per token pair and a tile load waiting on those stores: a fifth of the time).
// The softmax keeps one lane per head (16 lanes) and rescales the accumulator once per segment of up to
// 4 pieces; the accumulator (per 8 heads, per chunk one 16 x 16 fp32 tile) lives in memory.
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
#include "fp8_e4m3.h"
#include "scratch.h"
#include "simd.h"

namespace moelaunch::mla_amx {

using BF16 = c10::BFloat16;
constexpr int64_t kHeads = 16;   // heads per task: the score tile's columns
constexpr int64_t kHalf = 8;     // heads per weight tile (each head's weights in two of its rows)
constexpr int64_t kTokens = 16;  // tokens per piece: a score tile's rows, a weighted-sum tile's
constexpr int64_t kPieces = 4;   // pieces per segment (softmax rescales once per segment)
constexpr int64_t kSlice = amx::kSlice;  // bf16 values per tile row
constexpr int64_t kTileValues = amx::kTileValues;

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
  amx::pack_pairs(rope, heads, p_dim, p_dim, tiles + c_dim / kSlice * kTileValues);
}

// Where a piece's 16 cached rows come from: a bf16 pool (in place; a short piece's rows copied and
// padded with zeros, as a tile reads 16), or an fp8 one (dequantized to bf16 into `copy`, then zeros).
// piece(): the rows of tokens offset..offset + n - 1 of block `block`, 16 rows a row's width apart.
struct Bf16Pool {
  const BF16* cache;
  int64_t block_size, width;

  const BF16* piece(int64_t block, int64_t offset, int64_t n, BF16* copy) const {
    const BF16* rows = cache + (block * block_size + offset) * width;
    if (n == kTokens) return rows;
    std::memcpy(copy, rows, n * width * sizeof(BF16));
    std::memset(static_cast<void*>(copy + n * width), 0, (kTokens - n) * width * sizeof(BF16));
    return copy;
  }
};

// An fp8 cache's piece as the bf16 values its codes stand for (fp8::dequantize_tokens): the same tile
// products then read 1 byte a value from the pool. Widening the codes for fp32 FMAs instead ran 3-4x
// slower than a bf16 cache (docs/benchmarks.md, issue 30).
struct Fp8Pool {
  const uint8_t* codes;
  const float* scales;  // [blocks, block_size, 2]
  int64_t block_size, width, c_dim;

  const BF16* piece(int64_t block, int64_t offset, int64_t n, BF16* copy) const {
    const int64_t token = block * block_size + offset;
    fp8::dequantize_tokens(codes + token * width, scales + token * 2, n, width, c_dim, copy);
    std::memset(static_cast<void*>(copy + n * width), 0, (kTokens - n) * width * sizeof(BF16));
    return copy;
  }
};

// The per-thread memory of decode_rows.
struct Workspace {
  explicit Workspace(int64_t width, int64_t c_dim)
      : queries(width / kSlice * kTileValues),
        acc(2 * c_dim / kSlice * kTileValues),
        scores((kPieces + 1) * kTokens * kHeads),
        weights(kPieces * 2 * kTileValues),
        partial(kPieces * kTokens * width) {}
  Scratch<uint32_t> queries;
  Scratch<> acc, scores;  // acc: per 8 heads, per chunk a tile (rows 0-7 even columns, 8-15 odd)
  Scratch<uint32_t> weights;  // per piece, per 8 heads an A tile of weights beside zeros
  Scratch<BF16> partial;      // pieces copied (short ones, padded with zeros) or dequantized
  const BF16* rows[kPieces];  // each piece's 16 rows (in the pool, or its copy)
  int64_t lengths[kPieces];   // each piece's tokens
  int64_t pieces = 0;
};

// Scores (scaled) of the row's next segment, from pos (up to 4 pieces), into ws.scores [piece token][head];
// the pieces into ws.rows / ws.lengths. Returns the tokens covered. Pieces go two at a time (an odd
// last piece is paired with itself).
template <class Pool, typename index_t>
int64_t score_segment(Workspace& ws, const Pool& cache, const index_t* table, int64_t pos, int64_t len,
                      int64_t block_size, int64_t width, float scale) {
  const int64_t row_bytes = width * static_cast<int64_t>(sizeof(BF16));
  int64_t tokens = 0;
  for (ws.pieces = 0; ws.pieces < kPieces && pos < len; ++ws.pieces) {
    const int64_t offset = pos % block_size;
    const int64_t n = std::min({kTokens, block_size - offset, len - pos});
    ws.rows[ws.pieces] = cache.piece(static_cast<int64_t>(table[pos / block_size]), offset, n,
                                     ws.partial.data() + ws.pieces * kTokens * width);
    ws.lengths[ws.pieces] = n;
    pos += n;
    tokens += n;
  }
  float* scores = ws.scores.data();
  for (int64_t p = 0; p < ws.pieces; p += 2) {
    const bool pair = p + 1 < ws.pieces;  // a lone piece's twin goes past the segment, where nothing reads it
    amx::pair_products(ws.rows[p], ws.rows[pair ? p + 1 : p], row_bytes, ws.queries.data(), width / kSlice,
                       scores + p * kTokens * kHeads, scores + (pair ? p + 1 : kPieces) * kTokens * kHeads);
  }
  for (int64_t t = 0; t < ws.pieces * kTokens; ++t) {
    const vec16 s = load16(scores + t * kHeads) * scale;
    std::memcpy(scores + t * kHeads, &s, sizeof s);
  }
  return tokens;
}

// Piece p's softmax weights exp(score - max) rounded to bf16 (zero past its tokens), added to `sum`, into
// its A tiles: for heads 8q..8q+7, tile q's row h holds them as each pair's first value (bits >> 16),
// row 8 + h as its second; 16 tokens at a time through one in-register transpose (a scalar store per
// weight took a tenth of the kernel's time).
inline void store_weights(Workspace& ws, int64_t p, int64_t halves, vec16 max, vec16& sum) {
  alignas(64) u32x16 block[kTokens];  // [token][head]: each weight's bf16 bits in the high half
  for (int64_t i = 0; i < kTokens; ++i) {
    block[i] = u32x16{};
    if (i >= ws.lengths[p]) continue;
    block[i] = round_bf16_bits(exp16(load16(ws.scores.data() + (p * kTokens + i) * kHeads) - max));
    vec16 rounded;
    std::memcpy(&rounded, &block[i], sizeof rounded);
    sum += rounded;
  }
  __m512 by_head[kHeads];
  amx::columns16(reinterpret_cast<const float*>(block), by_head);
  for (int64_t h = 0; h < halves * kHalf; ++h) {
    uint32_t* tile = ws.weights.data() + (p * 2 + h / kHalf) * kTileValues;
    const __m512i bits = _mm512_castps_si512(by_head[h]);
    _mm512_store_si512(tile + (h % kHalf) * amx::kTileRows, _mm512_srli_epi32(bits, 16));
    _mm512_store_si512(tile + (h % kHalf + kHalf) * amx::kTileRows, bits);
  }
}

// One piece's multiplies into the two accumulators 0 and 1 (two independent sums: a tile multiply waits
// for the one before it on the same accumulator, ~3x its issue interval), either for one chunk of rows
// and both halves of the heads (shared_rows), or for two chunks and one half (shared_weights). Each piece
// takes one of two register sets, so its loads need not wait for the previous piece's multiplies.
// Literal register numbers: the intrinsics paste them.
struct FirstPieceRegisters {
  static void shared_rows(const void* rows, int64_t stride, const void* w0, const void* w1) {
    _tile_loadd(2, rows, stride);
    _tile_loadd(3, w0, amx::kTileRowBytes);
    _tile_loadd(4, w1, amx::kTileRowBytes);
    _tile_dpbf16ps(0, 3, 2);
    _tile_dpbf16ps(1, 4, 2);
  }
  static void shared_weights(const void* rows0, const void* rows1, int64_t stride, const void* w) {
    _tile_loadd(2, rows0, stride);
    _tile_loadd(3, rows1, stride);
    _tile_loadd(4, w, amx::kTileRowBytes);
    _tile_dpbf16ps(0, 4, 2);
    _tile_dpbf16ps(1, 4, 3);
  }
};
struct SecondPieceRegisters {
  static void shared_rows(const void* rows, int64_t stride, const void* w0, const void* w1) {
    _tile_loadd(5, rows, stride);
    _tile_loadd(6, w0, amx::kTileRowBytes);
    _tile_loadd(7, w1, amx::kTileRowBytes);
    _tile_dpbf16ps(0, 6, 5);
    _tile_dpbf16ps(1, 7, 5);
  }
  static void shared_weights(const void* rows0, const void* rows1, int64_t stride, const void* w) {
    _tile_loadd(5, rows0, stride);
    _tile_loadd(6, rows1, stride);
    _tile_loadd(7, w, amx::kTileRowBytes);
    _tile_dpbf16ps(0, 7, 5);
    _tile_dpbf16ps(1, 7, 6);
  }
};

// Piece p's multiplies for the chunk of 32 columns from c: with two halves of heads, both; with one, for
// chunks c and c2 (c2 == c when c is the last chunk: its second sum is then dropped).
template <class Regs>
inline void piece_product(Workspace& ws, int64_t p, int64_t c, int64_t c2, int64_t row_bytes, int64_t halves) {
  const uint32_t* weights = ws.weights.data() + p * 2 * kTileValues;
  if (halves > 1) {
    Regs::shared_rows(ws.rows[p] + c, row_bytes, weights, weights + kTileValues);
  } else {
    Regs::shared_weights(ws.rows[p] + c, ws.rows[p] + c2, row_bytes, weights);
  }
}

// acc += the segment's weights x its rows, for every 32-column chunk (acc = on the first segment), two
// accumulator tiles per step: one chunk's two halves of the heads, or (one half) two chunks.
inline void weighted_sum(Workspace& ws, int64_t halves, int64_t c_dim, int64_t row_bytes, bool first) {
  const int64_t chunks = c_dim / kSlice;
  const int64_t step = halves > 1 ? 1 : 2;
  for (int64_t chunk = 0; chunk < chunks; chunk += step) {
    const int64_t chunk2 = halves > 1 ? chunk : std::min(chunk + 1, chunks - 1);
    const bool second = halves > 1 || chunk2 != chunk;  // whether accumulator 1 holds a sum to keep
    float* acc0 = ws.acc.data() + chunk * kTileValues;
    float* acc1 = halves > 1 ? acc0 + chunks * kTileValues : acc0 + kTileValues;
    if (first) {
      _tile_zero(0);
      _tile_zero(1);
    } else {
      _tile_loadd(0, acc0, amx::kTileRowBytes);
      if (second) _tile_loadd(1, acc1, amx::kTileRowBytes);
    }
    for (int64_t p = 0; p < ws.pieces; ++p) {
      if (p % 2 == 0) {
        piece_product<FirstPieceRegisters>(ws, p, chunk * kSlice, chunk2 * kSlice, row_bytes, halves);
      } else {
        piece_product<SecondPieceRegisters>(ws, p, chunk * kSlice, chunk2 * kSlice, row_bytes, halves);
      }
    }
    _tile_stored(0, acc0, amx::kTileRowBytes);
    if (second) _tile_stored(1, acc1, amx::kTileRowBytes);
  }
}

// Head h's accumulated columns (even ones in row h % 8 of its half's tiles, odd ones in row 8 + h % 8),
// times inv, into out [c_dim] in column order.
inline void write_head(const float* acc, int64_t h, int64_t c_dim, float inv, float* out) {
  const __m512i first_half = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second_half = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const __m512 scale = _mm512_set1_ps(inv);
  const int64_t chunks = c_dim / kSlice;
  const float* tiles = acc + (h / kHalf) * chunks * kTileValues;
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const float* tile = tiles + chunk * kTileValues;
    const __m512 even = _mm512_load_ps(tile + (h % kHalf) * amx::kTileRows);
    const __m512 odd = _mm512_load_ps(tile + (h % kHalf + kHalf) * amx::kTileRows);
    _mm512_storeu_ps(out + chunk * kSlice, _mm512_mul_ps(_mm512_permutex2var_ps(even, first_half, odd), scale));
    _mm512_storeu_ps(out + chunk * kSlice + 16, _mm512_mul_ps(_mm512_permutex2var_ps(even, second_half, odd), scale));
  }
}

// The accumulator's rows of each head times its correction (heads 0..halves * 8).
inline void rescale(Workspace& ws, int64_t halves, int64_t c_dim, vec16 correction) {
  const int64_t chunks = c_dim / kSlice;
  for (int64_t q = 0; q < halves; ++q) {
    for (int64_t row = 0; row < amx::kTileRows; ++row) {
      const float factor = correction[q * kHalf + row % kHalf];
      if (factor == 1.f) continue;
      for (int64_t chunk = 0; chunk < chunks; ++chunk) {
        float* r = ws.acc.data() + (q * chunks + chunk) * kTileValues + row * amx::kTileRows;
        _mm512_store_ps(r, _mm512_mul_ps(_mm512_load_ps(r), _mm512_set1_ps(factor)));
      }
    }
  }
}

// cache: a Bf16Pool or an Fp8Pool.
template <class Pool, typename index_t>
void decode_rows(const BF16* q_latent, const BF16* q_pe, const Pool& cache, const index_t* block_table,
                 const int64_t* seq_lens, const int64_t* starts, float* out, int64_t rows, int64_t heads,
                 int64_t c_dim, int64_t p_dim, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t width = c_dim + p_dim;
  const int64_t row_bytes = width * static_cast<int64_t>(sizeof(BF16));
  const int64_t head_groups = (heads + kHeads - 1) / kHeads;
  at::parallel_for(0, rows * head_groups, 1, [&](int64_t begin, int64_t end) {
    amx::Tiles tiles;
    Workspace ws(width, c_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / head_groups;
      const int64_t h0 = (task % head_groups) * kHeads;
      const int64_t nh = std::min(kHeads, heads - h0);
      const int64_t halves = (nh + kHalf - 1) / kHalf;
      const int64_t len = seq_lens[r];
      pack_queries(q_latent + (r * heads + h0) * c_dim, q_pe + (r * heads + h0) * p_dim, nh, c_dim, p_dim,
                   ws.queries.data());
      vec16 running_max = vec16{} - std::numeric_limits<float>::infinity(), running_sum = vec16{};
      const int64_t first_pos = starts ? starts[r] : 0;
      for (int64_t pos = first_pos; pos < len;) {
        const bool first = pos == first_pos;
        pos += score_segment(ws, cache, block_table + r * max_blocks, pos, len, block_size, width, scale);
        // Softmax over the segment, one lane per head; the accumulator rescaled to the new max.
        vec16 segment_max = running_max;
        for (int64_t p = 0; p < ws.pieces; ++p) {
          for (int64_t t = 0; t < ws.lengths[p]; ++t) {
            const vec16 s = load16(ws.scores.data() + (p * kTokens + t) * kHeads);
            segment_max = s > segment_max ? s : segment_max;
          }
        }
        const vec16 correction = exp16(running_max - segment_max);
        running_sum *= correction;
        if (!first) rescale(ws, halves, c_dim, correction);
        running_max = segment_max;
        for (int64_t p = 0; p < ws.pieces; ++p) store_weights(ws, p, halves, segment_max, running_sum);
        weighted_sum(ws, halves, c_dim, row_bytes, first);
      }
      for (int64_t h = 0; h < nh; ++h) {
        write_head(ws.acc.data(), h, c_dim, 1.f / running_sum[h], out + (r * heads + h0 + h) * c_dim);
      }
    }
  });
}

}  // namespace moelaunch::mla_amx

#endif
