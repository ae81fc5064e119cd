// Writing tokens' rows into one layer of a paged cache pool (kernels/paged_store.py) at flat slots
// (block * block_size + offset):
// - store_rows_cpu: rows already in the pool's dtype, one row copy a slot;
// - store_fp8_latent_cpu, the FP8 latent cache's quantizing store: latent rows [N, C + P] (fp32 or bf16),
//   each token's c_kv part (the first C values) and k_pe part with a scale of its own (amax / 448, 1 for a
//   part of zeros) written beside it. Bit for bit what kernels/kv_fp8.quantize_latent and two row stores
//   give for finite latents (the same division, the same rounding: fp8_e4m3.h). In torch that was a dozen
//   ops and two index copies per layer and step, which left an eager step with an fp8 cache ~15% slower
//   than one with a float cache on a small model;
// and reading an FP8 cache's tokens back (dequantize_latent_cpu: codes times their part's scale, fp32 or
// bf16, as kernels/kv_fp8.dequantize_latent computes them), where torch's fp8 -> fp32 conversion alone
// took a fifth of a prompt step.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "fp8_e4m3.h"
#include "simd.h"

namespace {

using moelaunch::load8;
using moelaunch::vec8;
namespace fp8 = moelaunch::fp8;

constexpr float kE4m3Max = 448.f;

// A part's scale: its largest magnitude over 448, or 1 where the part is all zeros (any positive scale
// reads zeros back; 1 avoids a 0/0).
float part_scale(const float* x, int64_t n) {
  vec8 largest{};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const vec8 v = load8(x + i);
    const vec8 magnitude = v < 0 ? -v : v;
    largest = largest > magnitude ? largest : magnitude;
  }
  float amax = 0.f;
  for (int lane = 0; lane < 8; ++lane) amax = std::max(amax, largest[lane]);
  for (; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / kE4m3Max;
  return scale > 0.f ? scale : 1.f;
}

void quantize_part(const float* x, int64_t n, float scale, uint8_t* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) fp8::from_float8(load8(x + i) / scale, out + i);
  for (; i < n; ++i) out[i] = fp8::from_float(x[i] / scale);
}

}  // namespace

// index_copy_ on a view of the layer cost ~16 us a call for a decode step's few rows; in a compiled step
// its Python implementation would be the one Python call left between the graph's ops.
void store_rows_cpu(torch::Tensor pool, int64_t layer, torch::Tensor slots, torch::Tensor rows) {
  TORCH_CHECK(pool.is_contiguous() && pool.dim() == 4 && 0 <= layer && layer < pool.size(0),
              "store_rows: pool must be contiguous [layers, blocks, block_size, W] and layer in range");
  const int64_t width = pool.size(3);
  const int64_t layer_slots = pool.size(1) * pool.size(2);
  const auto src = rows.contiguous();
  const auto ids = slots.to(torch::kLong).contiguous();
  TORCH_CHECK(src.dim() == 2 && src.size(1) == width && src.scalar_type() == pool.scalar_type() &&
                  ids.numel() == src.size(0),
              "store_rows: rows must be [len(slots), ", width, "] of the pool's dtype");
  const int64_t row_bytes = width * pool.element_size();
  const int64_t* slot = ids.data_ptr<int64_t>();
  const char* from = static_cast<const char*>(src.data_ptr());
  char* to = static_cast<char*>(pool.data_ptr()) + layer * layer_slots * row_bytes;
  for (int64_t t = 0; t < src.size(0); ++t) {
    TORCH_CHECK(0 <= slot[t] && slot[t] < layer_slots, "store_rows: slot ", slot[t], " out of range");
    std::memcpy(to + slot[t] * row_bytes, from + t * row_bytes, row_bytes);
  }
}

void store_fp8_latent_cpu(torch::Tensor pool, torch::Tensor scales, int64_t layer, torch::Tensor slots,
                          torch::Tensor latent, int64_t c_dim) {
  TORCH_CHECK(pool.scalar_type() == at::ScalarType::Float8_e4m3fn && pool.is_contiguous() && pool.dim() == 4,
              "store_fp8_latent_cpu: pool must be a contiguous float8_e4m3fn [layers, blocks, block_size, W]");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() &&
                  scales.sizes().slice(0, 3) == pool.sizes().slice(0, 3) && scales.size(3) == 2,
              "store_fp8_latent_cpu: scales must be contiguous fp32 [layers, blocks, block_size, 2]");
  const int64_t width = pool.size(3);
  TORCH_CHECK(latent.dim() == 2 && latent.size(1) == width && 0 < c_dim && c_dim < width,
              "store_fp8_latent_cpu: latent must be [N, ", width, "] with 0 < c_dim < ", width);
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.numel() == latent.size(0),
              "store_fp8_latent_cpu: one int64 slot per latent row");
  TORCH_CHECK(0 <= layer && layer < pool.size(0), "store_fp8_latent_cpu: layer out of range");
  const auto rows = latent.to(torch::kFloat).contiguous();
  const auto slot_ids = slots.contiguous();
  const int64_t layer_slots = pool.size(1) * pool.size(2);
  const float* x = rows.data_ptr<float>();
  const int64_t* slot = slot_ids.data_ptr<int64_t>();
  uint8_t* codes = reinterpret_cast<uint8_t*>(pool.data_ptr()) + layer * layer_slots * width;
  float* token_scales = scales.data_ptr<float>() + layer * layer_slots * 2;
  for (int64_t t = 0; t < rows.size(0); ++t)
    TORCH_CHECK(0 <= slot[t] && slot[t] < layer_slots, "store_fp8_latent_cpu: slot ", slot[t], " out of range");
  // A step's slots are distinct but for the scratch slot its padding rows share, which nothing reads.
  at::parallel_for(0, rows.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = x + t * width;
      uint8_t* out = codes + slot[t] * width;
      float* scale = token_scales + slot[t] * 2;
      scale[0] = part_scale(row, c_dim);
      scale[1] = part_scale(row + c_dim, width - c_dim);
      quantize_part(row, c_dim, scale[0], out);
      quantize_part(row + c_dim, width - c_dim, scale[1], out + c_dim);
    }
  });
}

torch::Tensor dequantize_latent_cpu(torch::Tensor values, torch::Tensor scales, int64_t c_dim, bool bf16) {
  TORCH_CHECK(values.scalar_type() == at::ScalarType::Float8_e4m3fn && values.dim() >= 1,
              "dequantize_latent_cpu: values must be float8_e4m3fn [..., W]");
  const int64_t width = values.size(-1);
  const int64_t tokens = width > 0 ? values.numel() / width : 0;
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.numel() == 2 * tokens && 0 < c_dim && c_dim < width,
              "dequantize_latent_cpu: scales must be fp32 [..., 2] and 0 < c_dim < W");
  const auto codes = values.contiguous();
  const auto token_scales = scales.contiguous();
  auto out = torch::empty(values.sizes(), values.options().dtype(bf16 ? torch::kBFloat16 : torch::kFloat));
  const uint8_t* in = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const float* scale = token_scales.data_ptr<float>();
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    const int64_t at = begin * width;
    if (bf16)
      fp8::dequantize_tokens(in + at, scale + 2 * begin, end - begin, width, c_dim,
                             out.data_ptr<c10::BFloat16>() + at);
    else
      fp8::dequantize_tokens(in + at, scale + 2 * begin, end - begin, width, c_dim, out.data_ptr<float>() + at);
  });
  return out;
}
