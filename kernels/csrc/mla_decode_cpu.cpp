// Paged MLA decode attention in the absorbed (latent) form, for the CPU.
//
// Same contract and numerics as kernels/mla_decode_reference.py, without its padded gather: every
// (row, group of heads) walks its own block table and reads each cached token once, straight from the
// pool, with an online softmax (running max and sum per head, fp32). Slots past a row's length are
// never read, so they may hold anything.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// Heads that share one pass over a row's tokens: each token is loaded once for all of them.
constexpr int64_t kHeadsPerTask = 16;

template <typename cache_t>
inline float dot(const float* q, const cache_t* k, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += q[i] * static_cast<float>(k[i]);
  return sum;
}

// Four tokens against one query: four independent sums keep the FMA units busy (one sum is a chain of
// dependent adds) and the query is loaded once for all four.
template <typename cache_t>
inline void dot4(const float* q, const cache_t* k, int64_t stride, int64_t n, float* out) {
  const cache_t *k0 = k, *k1 = k + stride, *k2 = k + 2 * stride, *k3 = k + 3 * stride;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t i = 0; i < n; ++i) {
    const float qi = q[i];
    s0 += qi * static_cast<float>(k0[i]);
    s1 += qi * static_cast<float>(k1[i]);
    s2 += qi * static_cast<float>(k2[i]);
    s3 += qi * static_cast<float>(k3[i]);
  }
  out[0] += s0;
  out[1] += s1;
  out[2] += s2;
  out[3] += s3;
}

template <typename cache_t>
inline void axpy(float* acc, float p, const cache_t* k, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) acc[i] += p * static_cast<float>(k[i]);
}

template <typename cache_t, typename index_t>
void decode_rows(const float* q_latent, const float* q_pe, const cache_t* cache, const index_t* block_table,
                 const int64_t* seq_lens, float* out, int64_t rows, int64_t heads, int64_t c_dim, int64_t p_dim,
                 int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t width = c_dim + p_dim;
  const int64_t head_groups = (heads + kHeadsPerTask - 1) / kHeadsPerTask;
  at::parallel_for(0, rows * head_groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kHeadsPerTask * block_size);
    std::vector<float> running_max(kHeadsPerTask), running_sum(kHeadsPerTask);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / head_groups;
      const int64_t h0 = (task % head_groups) * kHeadsPerTask;
      const int64_t nh = std::min(kHeadsPerTask, heads - h0);
      const int64_t len = seq_lens[r];
      float* acc = out + (r * heads + h0) * c_dim;  // the output rows double as accumulators
      std::fill(acc, acc + nh * c_dim, 0.f);
      std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(running_sum.begin(), running_sum.end(), 0.f);
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const cache_t* block = cache + static_cast<int64_t>(block_table[r * max_blocks + start / block_size]) *
                                           block_size * width;
        for (int64_t h = 0; h < nh; ++h) {
          const float* ql = q_latent + (r * heads + h0 + h) * c_dim;
          const float* qp = q_pe + (r * heads + h0 + h) * p_dim;
          float* s = scores.data() + h * block_size;
          int64_t t = 0;
          for (; t + 4 <= n; t += 4) {
            std::fill(s + t, s + t + 4, 0.f);
            dot4(ql, block + t * width, width, c_dim, s + t);
            dot4(qp, block + t * width + c_dim, width, p_dim, s + t);
          }
          for (; t < n; ++t) {
            const cache_t* token = block + t * width;
            s[t] = dot(ql, token, c_dim) + dot(qp, token + c_dim, p_dim);
          }
          float block_max = running_max[h];
          for (t = 0; t < n; ++t) {
            s[t] *= scale;
            block_max = std::max(block_max, s[t]);
          }
          // Rescale what was accumulated under the old max, then add this block's tokens.
          const float correction = std::exp(running_max[h] - block_max);
          float* acc_h = acc + h * c_dim;
          if (correction != 1.f) {
            running_sum[h] *= correction;
#pragma omp simd
            for (int64_t c = 0; c < c_dim; ++c) acc_h[c] *= correction;
          }
          for (int64_t t = 0; t < n; ++t) {
            const float p = std::exp(s[t] - block_max);
            running_sum[h] += p;
            axpy(acc_h, p, block + t * width, c_dim);
          }
          running_max[h] = block_max;
        }
      }
      for (int64_t h = 0; h < nh; ++h) {
        const float inv = 1.f / running_sum[h];
        float* acc_h = acc + h * c_dim;
#pragma omp simd
        for (int64_t c = 0; c < c_dim; ++c) acc_h[c] *= inv;
      }
    }
  });
}

template <typename cache_t>
void dispatch_index(const torch::Tensor& q_latent, const torch::Tensor& q_pe, const torch::Tensor& cache,
                    const torch::Tensor& block_table, const torch::Tensor& seq_lens, torch::Tensor& out, float scale) {
  const int64_t rows = q_latent.size(0), heads = q_latent.size(1), c_dim = q_latent.size(2);
  const auto* cache_ptr = reinterpret_cast<const cache_t*>(cache.data_ptr());
  auto run = [&](const auto* table) {
    decode_rows(q_latent.data_ptr<float>(), q_pe.data_ptr<float>(), cache_ptr, table, seq_lens.data_ptr<int64_t>(),
                out.data_ptr<float>(), rows, heads, c_dim, q_pe.size(2), cache.size(1), block_table.size(1), scale);
  };
  if (block_table.scalar_type() == torch::kInt32) {
    run(block_table.data_ptr<int32_t>());
  } else {
    run(block_table.data_ptr<int64_t>());
  }
}

}  // namespace

// q_latent [R, H, C] and q_pe [R, H, P] fp32; cache [num_blocks, block_size, C + P] fp32 or bf16;
// block_table [R, max_blocks] int32/int64; seq_lens [R] int64 (>= 1). Returns [R, H, C] fp32.
torch::Tensor paged_mla_decode_cpu(torch::Tensor q_latent, torch::Tensor q_pe, torch::Tensor cache,
                                   torch::Tensor block_table, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q_latent.scalar_type() == torch::kFloat32 && q_pe.scalar_type() == torch::kFloat32,
              "queries must be fp32");
  TORCH_CHECK(q_latent.is_contiguous() && q_pe.is_contiguous() && cache.is_contiguous() &&
                  block_table.is_contiguous() && seq_lens.is_contiguous(),
              "inputs must be contiguous");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt64, "seq_lens must be int64");
  auto out = torch::empty_like(q_latent);
  const float s = static_cast<float>(scale);
  if (cache.scalar_type() == torch::kFloat32) {
    dispatch_index<float>(q_latent, q_pe, cache, block_table, seq_lens, out, s);
  } else if (cache.scalar_type() == torch::kBFloat16) {
    dispatch_index<c10::BFloat16>(q_latent, q_pe, cache, block_table, seq_lens, out, s);
  } else {
    TORCH_CHECK(false, "cache dtype must be fp32 or bf16, got ", cache.scalar_type());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_mla_decode_cpu", &paged_mla_decode_cpu, "paged MLA decode (absorbed form) on the CPU");
}
