// The MoE router after its GEMM, fused into one pass per token: scores (sigmoid or softmax), the
// selection bias, group-limited selection, top-k, normalization and scaling. In torch these are ~14
// separate ops per layer, each a dispatch (a kernel launch on a GPU) for a few hundred values per token.
//
// Same rules as fused_reference.moe_route_ref: groups ranked by their best score (no bias) or the sum of
// their best two biased scores; experts ranked by biased score; weights are the unbiased scores. Ties go
// to the lower index.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace {

// The k largest of values[0:n], in descending order (ties: lower index first), into out.
void top_indices(const float* values, int64_t n, int64_t k, std::vector<int64_t>& order, int64_t* out) {
  order.resize(n);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
    return values[a] > values[b] || (values[a] == values[b] && a < b);
  });
  std::copy(order.begin(), order.begin() + k, out);
}

}  // namespace

std::vector<torch::Tensor> moe_route_cpu(torch::Tensor logits, c10::optional<torch::Tensor> bias, int64_t top_k,
                                         int64_t n_groups, int64_t topk_groups, bool sigmoid, bool normalize,
                                         double scale) {
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32 && logits.dim() == 2 && logits.is_contiguous(),
              "logits must be contiguous fp32 [T, E]");
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "top_k must be in [1, experts]");
  TORCH_CHECK(n_groups >= 1 && experts % n_groups == 0 && topk_groups >= 1 && topk_groups <= n_groups,
              "experts must split into n_groups groups, topk_groups of them kept");
  const float* b = nullptr;
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == experts,
                "bias must be contiguous fp32 [E]");
    b = bias->data_ptr<float>();
  }
  auto weights = torch::empty({tokens, top_k}, logits.options());
  auto ids = torch::empty({tokens, top_k}, logits.options().dtype(torch::kInt64));
  const float* lp = logits.data_ptr<float>();
  float* wp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t per_group = experts / n_groups;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(experts), choice(experts), group_score(n_groups);
    std::vector<int64_t> order, kept(topk_groups);
    for (int64_t t = begin; t < end; ++t) {
      const float* l = lp + t * experts;
      if (sigmoid) {
        for (int64_t e = 0; e < experts; ++e) scores[e] = 1.0f / (1.0f + std::exp(-l[e]));
      } else {
        const float top = *std::max_element(l, l + experts);
        float sum = 0.0f;
        for (int64_t e = 0; e < experts; ++e) sum += scores[e] = std::exp(l[e] - top);
        for (int64_t e = 0; e < experts; ++e) scores[e] /= sum;
      }
      for (int64_t e = 0; e < experts; ++e) choice[e] = b ? scores[e] + b[e] : scores[e];
      if (n_groups > 1) {
        for (int64_t g = 0; g < n_groups; ++g) {
          const float* c = choice.data() + g * per_group;
          if (!b) {
            group_score[g] = *std::max_element(c, c + per_group);
          } else {
            float first = neg_inf, second = neg_inf;
            for (int64_t e = 0; e < per_group; ++e) {
              if (c[e] > first) {
                second = first;
                first = c[e];
              } else if (c[e] > second) {
                second = c[e];
              }
            }
            group_score[g] = first + (per_group > 1 ? second : 0.0f);
          }
        }
        top_indices(group_score.data(), n_groups, topk_groups, order, kept.data());
        std::vector<bool> keep(n_groups, false);
        for (int64_t g : kept) keep[g] = true;
        for (int64_t e = 0; e < experts; ++e)
          if (!keep[e / per_group]) choice[e] = neg_inf;
      }
      int64_t* row_ids = ip + t * top_k;
      float* row_w = wp + t * top_k;
      top_indices(choice.data(), experts, top_k, order, row_ids);
      float sum = 0.0f;
      for (int64_t k = 0; k < top_k; ++k) sum += row_w[k] = scores[row_ids[k]];
      const float factor = normalize ? static_cast<float>(scale) / (sum + 1e-20f) : static_cast<float>(scale);
      for (int64_t k = 0; k < top_k; ++k) row_w[k] *= factor;
    }
  });
  return {weights, ids};
}

// The (token, expert) pairs of ids [T, K] (pair i = token * K + k) sorted by expert, stably (a counting
// sort), with each pair's token row gathered: (rows [T*K, D], the sorted pairs' experts [T*K], offsets
// [E + 1]: expert e's rows are offsets[e]:offsets[e + 1], slot [T, K]: where each pair's row went). In
// torch: sort, searchsorted, floor_divide, index_select and scatter_, five dispatches per layer.
std::vector<torch::Tensor> moe_sort_rows_cpu(torch::Tensor x, torch::Tensor ids, int64_t n_experts) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "x must be contiguous fp32 [T, D]");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.dim() == 2 && ids.is_contiguous() && ids.size(0) == x.size(0),
              "ids must be contiguous int64 [T, K] with x's T");
  const int64_t tokens = ids.size(0), k = ids.size(1), pairs = tokens * k, dim = x.size(1);
  auto rows = torch::empty({pairs, dim}, x.options());
  auto sorted_ids = torch::empty({pairs}, ids.options());
  auto offsets = torch::empty({n_experts + 1}, ids.options());
  auto slot = torch::empty({tokens, k}, ids.options());
  const int64_t* ip = ids.data_ptr<int64_t>();
  int64_t* op = offsets.data_ptr<int64_t>();
  int64_t* sp = slot.data_ptr<int64_t>();
  int64_t* sorted = sorted_ids.data_ptr<int64_t>();
  std::vector<int64_t> next(n_experts, 0);
  for (int64_t i = 0; i < pairs; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < n_experts, "expert id out of range");
    ++next[ip[i]];
  }
  op[0] = 0;
  for (int64_t e = 0; e < n_experts; ++e) {
    op[e + 1] = op[e] + next[e];
    next[e] = op[e];
  }
  for (int64_t i = 0; i < pairs; ++i) {  // in pair order: a stable sort
    const int64_t at = next[ip[i]]++;
    sp[i] = at;
    sorted[at] = ip[i];
  }
  const float* xp = x.data_ptr<float>();
  float* rp = rows.data_ptr<float>();
  at::parallel_for(0, pairs, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::copy_n(xp + (i / k) * dim, dim, rp + sp[i] * dim);
  });
  return {rows, sorted_ids, offsets, slot};
}

torch::Tensor grouped_linear_cpu(torch::Tensor x, torch::Tensor weight, torch::Tensor offsets, bool gated,
                                 int64_t path);

// The router's GEMM and routing in one call: logits = x [T, D] @ weight [E, D]^T by the grouped-linear
// kernel (one group: the same product the projections use), then moe_route_cpu on them.
std::vector<torch::Tensor> moe_gate_cpu(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias,
                                        int64_t top_k, int64_t n_groups, int64_t topk_groups, bool sigmoid,
                                        bool normalize, double scale) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "x must be [T, D] and weight [E, D]");
  const auto offsets = torch::tensor(std::vector<int64_t>{0, x.size(0)}, torch::kInt64);
  const auto logits = grouped_linear_cpu(x, weight.unsqueeze(0), offsets, false, -1);
  return moe_route_cpu(logits, bias, top_k, n_groups, topk_groups, sigmoid, normalize, scale);
}
