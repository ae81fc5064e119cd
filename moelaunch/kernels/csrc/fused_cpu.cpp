// The small per-token steps around the big products, each fused into one pass over its rows: RMSNorm,
// the MLA latent's norm plus rotary embedding, rotary embedding of the queries' last columns, SiLU
// gating, and the weighted sum of routed experts' outputs. In torch each is 5-10 separate ops, each
// with its own pass over the data and its own dispatch cost; at prompt sizes those passes were a third
// of a step, at decode sizes the dispatches were.
//
// All fp32, rows with a unit column stride (row strides may be anything, so slices of a wider tensor
// work in place). Rows are independent and split across threads.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>

#include "simd.h"

namespace {

using moelaunch::hsum;
using moelaunch::kLanes;
using moelaunch::load8;
using moelaunch::silu_mul_row;
using moelaunch::store8;
using moelaunch::vec8;

// Rows per thread task: small enough to split a prompt's rows, large enough that a decode step's few
// rows stay on one thread.
constexpr int64_t kRowGrain = 16;

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be fp32");
  TORCH_CHECK(t.dim() >= 2 && t.stride(-1) == 1, name, " must have a unit stride in its last dimension");
}

// out[0:n] = x[0:n] / rms(x[0:n]) * weight[0:n]; out may be x.
void rms_norm_row(const float* x, const float* weight, int64_t n, float eps, float* out) {
  vec8 squares{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vec8 v = load8(x + i);
    squares += v * v;
  }
  float sum = hsum(squares);
  for (; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  i = 0;
  for (; i + kLanes <= n; i += kLanes) store8(out + i, load8(x + i) * inv * load8(weight + i));
  for (; i < n; ++i) out[i] = x[i] * inv * weight[i];
}

// x[0:d] rotated in place by the angles whose cosines and sines are cos[0:d/2], sin[0:d/2]: pairs
// (2i, 2i + 1) when interleaved (DeepSeek's checkpoint layout), else (i, i + d/2).
void rotate_row(float* x, const float* cos, const float* sin, int64_t d, bool interleaved) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    float* a = interleaved ? x + 2 * i : x + i;
    float* b = interleaved ? x + 2 * i + 1 : x + i + half;
    const float x1 = *a, x2 = *b;
    *a = x1 * cos[i] - x2 * sin[i];
    *b = x2 * cos[i] + x1 * sin[i];
  }
}

void check_tables(const torch::Tensor& cos, const torch::Tensor& sin, int64_t rows, int64_t d) {
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32, "cos/sin must be fp32");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(), "cos/sin must be contiguous");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == rows && cos.size(1) * 2 == d, "cos/sin must be [rows, ", d / 2, "]");
}

}  // namespace

// x [N, D] -> [N, D]: RMSNorm with weight [D].
torch::Tensor rms_norm_cpu(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "x must be [N, D] and weight a contiguous fp32 [D]");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t n = x.size(1), stride = x.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * stride, wp, n, e, op + r * n);
  });
  return out;
}

// x, y [N, D] -> (x + y, RMSNorm(x + y) with weight [D]): a pre-norm block's residual add and the next
// norm in one pass (two dispatches in torch).
std::vector<torch::Tensor> add_rms_norm_cpu(torch::Tensor x, torch::Tensor y, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(y, "y");
  TORCH_CHECK(x.dim() == 2 && x.sizes() == y.sizes() && weight.scalar_type() == torch::kFloat32 &&
                  weight.is_contiguous() && weight.numel() == x.size(1),
              "x and y must be [N, D] and weight a contiguous fp32 [D]");
  auto sum = torch::empty({x.size(0), x.size(1)}, x.options());
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t n = x.size(1), xs = x.stride(0), ys = y.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* s = sp + r * n;
      for (int64_t i = 0; i < n; ++i) s[i] = xp[r * xs + i] + yp[r * ys + i];
      rms_norm_row(s, wp, n, e, op + r * n);
    }
  });
  return {sum, out};
}

// In place on latent [N, C + P]: RMSNorm (weight [C]) on the first C columns, rotary embedding (tables
// [N, P/2]) on the last P. With q_a [N, Q] (and q_weight [Q], q_eps), RMSNorm of q_a into q_out in the
// same pass over the rows: the MLA's two input norms as one call.
static void mla_norm_rows(torch::Tensor latent, torch::Tensor weight, double eps, torch::Tensor cos, torch::Tensor sin,
                          bool interleaved, const torch::Tensor* q_a, const torch::Tensor* q_weight, double q_eps,
                          torch::Tensor* q_out) {
  check_rows(latent, "latent");
  TORCH_CHECK(latent.dim() == 2 && weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() &&
                  weight.numel() < latent.size(1),
              "latent must be [N, C + P] and weight a contiguous fp32 [C]");
  const int64_t c = weight.numel(), p = latent.size(1) - c, stride = latent.stride(0);
  check_tables(cos, sin, latent.size(0), p);
  float* lp = latent.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const float* qp = q_a ? q_a->data_ptr<float>() : nullptr;
  const float* qwp = q_a ? q_weight->data_ptr<float>() : nullptr;
  float* qop = q_a ? q_out->data_ptr<float>() : nullptr;
  const int64_t q_width = q_a ? q_a->size(1) : 0, q_stride = q_a ? q_a->stride(0) : 0;
  const float qe = static_cast<float>(q_eps);
  at::parallel_for(0, latent.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = lp + r * stride;
      rms_norm_row(row, wp, c, e, row);
      rotate_row(row + c, cp + r * p / 2, sp + r * p / 2, p, interleaved);
      if (qp) rms_norm_row(qp + r * q_stride, qwp, q_width, qe, qop + r * q_width);
    }
  });
}

// latent [N, C + P] normalized and rotated in place (see mla_norm_rows). Returns latent.
torch::Tensor mla_latent_cpu(torch::Tensor latent, torch::Tensor weight, double eps, torch::Tensor cos,
                             torch::Tensor sin, bool interleaved) {
  mla_norm_rows(latent, weight, eps, cos, sin, interleaved, nullptr, nullptr, 0.0, nullptr);
  return latent;
}

// mla_latent_cpu on latent, and returns RMSNorm(q_a) (q_a [N, Q], q_weight [Q]) as a new [N, Q].
torch::Tensor mla_input_norms_cpu(torch::Tensor q_a, torch::Tensor q_weight, double q_eps, torch::Tensor latent,
                                  torch::Tensor weight, double eps, torch::Tensor cos, torch::Tensor sin,
                                  bool interleaved) {
  check_rows(q_a, "q_a");
  TORCH_CHECK(q_a.dim() == 2 && q_a.size(0) == latent.size(0), "q_a must be [N, Q] with latent's N");
  TORCH_CHECK(q_weight.scalar_type() == torch::kFloat32 && q_weight.is_contiguous() && q_weight.numel() == q_a.size(1),
              "q_weight must be a contiguous fp32 [Q]");
  auto q_out = torch::empty({q_a.size(0), q_a.size(1)}, q_a.options());
  mla_norm_rows(latent, weight, eps, cos, sin, interleaved, &q_a, &q_weight, q_eps, &q_out);
  return q_out;
}

// In place on x [N, H, D]: rotary embedding (tables [N, P/2]) on the last P columns of every head.
// Returns x.
torch::Tensor rotate_tail_cpu(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t p, bool interleaved) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 3 && p > 0 && p <= x.size(2) && p % 2 == 0, "x must be [N, H, D] with D >= P, P even");
  check_tables(cos, sin, x.size(0), p);
  const int64_t heads = x.size(1), d = x.size(2), s0 = x.stride(0), s1 = x.stride(1);
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        rotate_row(xp + r * s0 + h * s1 + d - p, cp + r * p / 2, sp + r * p / 2, p, interleaved);
      }
    }
  });
  return x;
}

// gate, up [N, I] -> silu(gate) * up [N, I], all fp32 or all bf16 (computed in fp32, rounded once).
torch::Tensor silu_mul_cpu(torch::Tensor gate, torch::Tensor up) {
  TORCH_CHECK(gate.scalar_type() == up.scalar_type() &&
                  (gate.scalar_type() == torch::kFloat32 || gate.scalar_type() == torch::kBFloat16),
              "gate and up must be both fp32 or both bf16");
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes(), "gate and up must be the same [N, I]");
  TORCH_CHECK(gate.stride(-1) == 1 && up.stride(-1) == 1, "gate and up must have a unit stride in their last dimension");
  const int64_t n = gate.size(1), gs = gate.stride(0), us = up.stride(0);
  auto out = torch::empty({gate.size(0), n}, gate.options());
  auto run = [&](const auto* gp, const auto* upp, auto* op) {
    at::parallel_for(0, gate.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_mul_row(gp + r * gs, upp + r * us, n, op + r * n);
    });
  };
  if (gate.scalar_type() == torch::kFloat32) {
    run(gate.data_ptr<float>(), up.data_ptr<float>(), out.data_ptr<float>());
  } else {
    using BF16 = c10::BFloat16;
    run(reinterpret_cast<const BF16*>(gate.data_ptr()), reinterpret_cast<const BF16*>(up.data_ptr()),
        reinterpret_cast<BF16*>(out.data_ptr()));
  }
  return out;
}

// out[t] = base[t] + sum_k weights[t, k] * y[slot[t, k]]: y [S, D] the routed experts' outputs (in any
// order), slot/weights [T, K] where each token's K outputs are and what they weigh, base [T, D] or
// undefined (zeros).
torch::Tensor moe_combine_cpu(torch::Tensor y, torch::Tensor slot, torch::Tensor weights,
                              c10::optional<torch::Tensor> base, c10::optional<torch::Tensor> residual) {
  check_rows(y, "y");
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous(), "y must be a contiguous [S, D]");
  TORCH_CHECK(slot.scalar_type() == torch::kInt64 && slot.is_contiguous() && slot.dim() == 2,
              "slot must be a contiguous int64 [T, K]");
  TORCH_CHECK(weights.scalar_type() == torch::kFloat32 && weights.is_contiguous() && weights.sizes() == slot.sizes(),
              "weights must be a contiguous fp32 [T, K] like slot");
  const int64_t tokens = slot.size(0), k = slot.size(1), d = y.size(1), slots = y.size(0);
  const bool has_base = base.has_value() && base->defined();
  if (has_base) {
    check_rows(*base, "base");
    TORCH_CHECK(base->dim() == 2 && base->size(0) == tokens && base->size(1) == d, "base must be [T, D]");
  }
  const bool has_residual = residual.has_value() && residual->defined();
  if (has_residual) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == tokens && residual->size(1) == d,
                "residual must be [T, D]");
  }
  auto out = torch::empty({tokens, d}, y.options());
  const float* yp = y.data_ptr<float>();
  const float* rp = has_residual ? residual->data_ptr<float>() : nullptr;
  const int64_t rs = has_residual ? residual->stride(0) : 0;
  const int64_t* sp = slot.data_ptr<int64_t>();
  const float* wp = weights.data_ptr<float>();
  const float* bp = has_base ? base->data_ptr<float>() : nullptr;
  const int64_t bs = has_base ? base->stride(0) : 0;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* o = op + t * d;
      if (bp != nullptr) {
        std::copy_n(bp + t * bs, d, o);
      } else {
        std::fill_n(o, d, 0.f);
      }
      if (rp != nullptr) {
        for (int64_t i = 0; i < d; ++i) o[i] += rp[t * rs + i];
      }
      for (int64_t j = 0; j < k; ++j) {
        const int64_t s = sp[t * k + j];
        TORCH_CHECK(s >= 0 && s < slots, "slot ", s, " out of range [0, ", slots, ")");
        const float w = wp[t * k + j];
        const float* row = yp + s * d;
        int64_t i = 0;
        for (; i + kLanes <= d; i += kLanes) store8(o + i, load8(o + i) + w * load8(row + i));
        for (; i < d; ++i) o[i] += w * row[i];
      }
    }
  });
  return out;
}
