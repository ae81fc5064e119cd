// The CPU kernels' Python module (pybind11: eager calls) and their CPU implementations of the torch ops
// that kernels/cpu_ops.py declares (TORCH_LIBRARY_IMPL: traced and compiled calls). One extension, built
// once per machine (kernels/cpu_extension.py).
#include <torch/extension.h>

#include "cpu_isa.h"

torch::Tensor paged_mla_decode_cpu(torch::Tensor q_latent, torch::Tensor q_pe, torch::Tensor cache,
                                   torch::Tensor block_table, torch::Tensor seq_lens, double scale,
                                   c10::optional<torch::Tensor> starts, int64_t path);
torch::Tensor paged_mla_decode_fp8_cpu(torch::Tensor q_latent, torch::Tensor q_pe, torch::Tensor cache,
                                       torch::Tensor cache_scales, torch::Tensor block_table, torch::Tensor seq_lens,
                                       double scale, c10::optional<torch::Tensor> starts, int64_t path);
torch::Tensor grouped_linear_cpu(torch::Tensor x, torch::Tensor weight, torch::Tensor offsets, bool gated,
                                 int64_t path);
torch::Tensor per_head_linear_cpu(torch::Tensor x, torch::Tensor stack, int64_t path);
torch::Tensor rms_norm_cpu(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor mla_latent_cpu(torch::Tensor latent, torch::Tensor weight, double eps, torch::Tensor cos,
                             torch::Tensor sin, bool interleaved);
torch::Tensor mla_input_norms_cpu(torch::Tensor q_a, torch::Tensor q_weight, double q_eps, torch::Tensor latent,
                                  torch::Tensor weight, double eps, torch::Tensor cos, torch::Tensor sin,
                                  bool interleaved);
torch::Tensor rotate_tail_cpu(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t p, bool interleaved);
torch::Tensor silu_mul_cpu(torch::Tensor gate, torch::Tensor up);
torch::Tensor moe_combine_cpu(torch::Tensor y, torch::Tensor slot, torch::Tensor weights,
                              c10::optional<torch::Tensor> base, c10::optional<torch::Tensor> residual);
std::vector<torch::Tensor> add_rms_norm_cpu(torch::Tensor x, torch::Tensor y, torch::Tensor weight, double eps);
torch::Tensor int8_linear_cpu(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor offsets,
                              bool gated, int64_t path);
torch::Tensor int4_linear_cpu(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor zero,
                              torch::Tensor offsets, int64_t group_size, bool gated, int64_t path);
torch::Tensor w8a8_linear_cpu(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor offsets,
                              bool gated, int64_t path, c10::optional<torch::Tensor> row_amax);
std::vector<torch::Tensor> moe_route_cpu(torch::Tensor logits, c10::optional<torch::Tensor> bias, int64_t top_k,
                                         int64_t n_groups, int64_t topk_groups, bool sigmoid, bool normalize,
                                         double scale);
std::vector<torch::Tensor> moe_gate_cpu(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias,
                                        int64_t top_k, int64_t n_groups, int64_t topk_groups, bool sigmoid,
                                        bool normalize, double scale);
std::vector<torch::Tensor> moe_sort_rows_cpu(torch::Tensor x, torch::Tensor ids, int64_t n_experts);
std::vector<torch::Tensor> argmax_rows_cpu(torch::Tensor logits);
void store_fp8_latent_cpu(torch::Tensor pool, torch::Tensor scales, int64_t layer, torch::Tensor slots,
                          torch::Tensor latent, int64_t c_dim);
void store_rows_cpu(torch::Tensor pool, int64_t layer, torch::Tensor slots, torch::Tensor rows);
torch::Tensor dequantize_latent_cpu(torch::Tensor values, torch::Tensor scales, int64_t c_dim, bool bf16);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels run without the GIL (their arguments are converted before, their results after): a
  // server's HTTP thread answers, streams and detokenizes while the engine thread is inside one.
  const auto kRelease = py::call_guard<py::gil_scoped_release>();
  m.def("paged_mla_decode_cpu", &paged_mla_decode_cpu, kRelease, "paged MLA decode (absorbed form) on the CPU",
        py::arg("q_latent"), py::arg("q_pe"), py::arg("cache"), py::arg("block_table"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("starts") = py::none(), py::arg("path") = -1);
  m.def("paged_mla_decode_fp8_cpu", &paged_mla_decode_fp8_cpu, kRelease, "paged MLA decode over an fp8 cache",
        py::arg("q_latent"), py::arg("q_pe"), py::arg("cache"), py::arg("cache_scales"), py::arg("block_table"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("starts") = py::none(), py::arg("path") = -1);
  m.def("grouped_linear_cpu", &grouped_linear_cpu, kRelease, "x @ weight[g]^T per group of rows, for few rows; gated: SiLU-gated",
        py::arg("x"), py::arg("weight"), py::arg("offsets"), py::arg("gated") = false, py::arg("path") = -1);
  m.def("per_head_linear_cpu", &per_head_linear_cpu, kRelease, "x [R, H, K] @ stack[h]^T per head h, through the AMX tiles",
        py::arg("x"), py::arg("stack"), py::arg("path") = -1);
  m.def("rms_norm_cpu", &rms_norm_cpu, kRelease, "RMSNorm of fp32 rows");
  m.def("mla_latent_cpu", &mla_latent_cpu, kRelease, "in place: RMSNorm of the MLA latent, rotary embedding of its k_pe");
  m.def("mla_input_norms_cpu", &mla_input_norms_cpu, kRelease,
        "mla_latent_cpu in place on the latent, and RMSNorm of q_a into a new tensor, in one pass");
  m.def("rotate_tail_cpu", &rotate_tail_cpu, kRelease, "in place: rotary embedding of each head's last columns");
  m.def("silu_mul_cpu", &silu_mul_cpu, kRelease, "silu(gate) * up");
  m.def("moe_combine_cpu", &moe_combine_cpu, kRelease,
        "residual + base + the routing-weighted sum of each token's expert outputs", py::arg("y"), py::arg("slot"),
        py::arg("weights"), py::arg("base") = py::none(), py::arg("residual") = py::none());
  m.def("add_rms_norm_cpu", &add_rms_norm_cpu, kRelease, "(x + y, RMSNorm(x + y)) of fp32 rows");
  // `path` (cpu_isa.h): 0 scalar, 1 AVX2, 2 AVX-512, 3 AVX-512 + BF16, 4 AMX, -1 the best built.
  m.def("cpu_isa_best_path", [] { return static_cast<int64_t>(moelaunch::isa::best_path()); },
        "the best instruction-set path this build has");
  m.def("bf16_dot_calls", [] { return moelaunch::isa::bf16_dot_calls().load(); },
        "how many kernel calls ran their products through vdpbf16ps (AVX512-BF16)");
  m.def("amx_calls", [] { return moelaunch::isa::amx_calls().load(); },
        "how many kernel calls ran their products through the AMX tiles");
  // Integer weights (int_linear_cpu.cpp).
  m.def("int8_linear_cpu", &int8_linear_cpu, kRelease, "x @ (q * scale)^T per group of rows, int8 weights");
  m.def("int4_linear_cpu", &int4_linear_cpu, kRelease, "x @ ((q - zero) * scale)^T per group of rows, int4 weights");
  m.def("w8a8_linear_cpu", &w8a8_linear_cpu, kRelease, "int8 x (quantized per row) @ int8 q^T, both scales", py::arg("x"),
        py::arg("q"), py::arg("scale"), py::arg("offsets"), py::arg("gated"), py::arg("path"),
        py::arg("row_amax") = py::none());
  m.def("moe_route_cpu", &moe_route_cpu, kRelease, "MoE router after its GEMM: scores, groups, top-k, weights");
  m.def("moe_gate_cpu", &moe_gate_cpu, kRelease, "the router's GEMM, then moe_route_cpu");
  m.def("moe_sort_rows_cpu", &moe_sort_rows_cpu, kRelease, "(token, expert) pairs sorted by expert, their rows gathered");
  m.def("argmax_rows_cpu", &argmax_rows_cpu, kRelease, "each row's first maximum (or first NaN) and whether it is finite");
  m.def("store_rows_cpu", &store_rows_cpu, kRelease, "in place: rows into one layer of a paged pool at flat slots");
  m.def("store_fp8_latent_cpu", &store_fp8_latent_cpu, kRelease,
        "in place: latent rows quantized to e4m3, a scale per part, into one layer of an fp8 paged pool");
  m.def("dequantize_latent_cpu", &dequantize_latent_cpu, kRelease,
        "an fp8 cache's tokens read back: codes times their part's scale, in fp32 or bf16");
}

namespace {

std::tuple<torch::Tensor, torch::Tensor> as_pair(const std::vector<torch::Tensor>& v) { return {v[0], v[1]}; }

}  // namespace

// The schemas are declared in kernels/cpu_ops.py; the ops returning tuples or nothing are adapted here.
TORCH_LIBRARY_IMPL(moelaunch, CPU, m) {
  m.impl("paged_mla_decode_cpu", &paged_mla_decode_cpu);
  m.impl("paged_mla_decode_fp8_cpu", &paged_mla_decode_fp8_cpu);
  m.impl("grouped_linear_cpu", &grouped_linear_cpu);
  m.impl("per_head_linear_cpu", &per_head_linear_cpu);
  m.impl("rms_norm_cpu", &rms_norm_cpu);
  m.impl("mla_latent_cpu", [](torch::Tensor latent, torch::Tensor weight, double eps, torch::Tensor cos,
                              torch::Tensor sin, bool interleaved) {
    mla_latent_cpu(latent, weight, eps, cos, sin, interleaved);
  });
  m.impl("mla_input_norms_cpu", &mla_input_norms_cpu);
  m.impl("rotate_tail_cpu", [](torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t p, bool interleaved) {
    rotate_tail_cpu(x, cos, sin, p, interleaved);
  });
  m.impl("silu_mul_cpu", &silu_mul_cpu);
  m.impl("moe_combine_cpu", &moe_combine_cpu);
  m.impl("add_rms_norm_cpu", [](torch::Tensor x, torch::Tensor y, torch::Tensor weight, double eps) {
    return as_pair(add_rms_norm_cpu(x, y, weight, eps));
  });
  m.impl("moe_route_cpu", [](torch::Tensor logits, c10::optional<torch::Tensor> bias, int64_t top_k,
                             int64_t n_groups, int64_t topk_groups, bool sigmoid, bool normalize, double scale) {
    return as_pair(moe_route_cpu(logits, bias, top_k, n_groups, topk_groups, sigmoid, normalize, scale));
  });
  m.impl("moe_gate_cpu", [](torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias, int64_t top_k,
                            int64_t n_groups, int64_t topk_groups, bool sigmoid, bool normalize, double scale) {
    return as_pair(moe_gate_cpu(x, weight, bias, top_k, n_groups, topk_groups, sigmoid, normalize, scale));
  });
  m.impl("moe_sort_rows_cpu", [](torch::Tensor x, torch::Tensor ids, int64_t n_experts) {
    auto v = moe_sort_rows_cpu(x, ids, n_experts);
    return std::make_tuple(v[0], v[1], v[2], v[3]);
  });
  m.impl("int8_linear_cpu", &int8_linear_cpu);
  m.impl("int4_linear_cpu", &int4_linear_cpu);
  m.impl("w8a8_linear_cpu", &w8a8_linear_cpu);
  m.impl("store_rows", &store_rows_cpu);
  m.impl("store_fp8_latent_cpu", &store_fp8_latent_cpu);
  m.impl("dequantize_latent_cpu", &dequantize_latent_cpu);
  m.impl("argmax_rows_cpu", [](torch::Tensor logits) { return as_pair(argmax_rows_cpu(logits)); });
}
