// The CPU kernels' Python module: one extension, built once per machine (kernels/cpu_extension.py).
#include <torch/extension.h>

#include "cpu_isa.h"

torch::Tensor paged_mla_decode_cpu(torch::Tensor q_latent, torch::Tensor q_pe, torch::Tensor cache,
                                   torch::Tensor block_table, torch::Tensor seq_lens, double scale,
                                   c10::optional<torch::Tensor> starts, int64_t path);
torch::Tensor paged_mla_decode_fp8_cpu(torch::Tensor q_latent, torch::Tensor q_pe, torch::Tensor cache,
                                       torch::Tensor cache_scales, torch::Tensor block_table, torch::Tensor seq_lens,
                                       double scale, c10::optional<torch::Tensor> starts);
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
                              int64_t path);
torch::Tensor int4_linear_cpu(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor zero,
                              torch::Tensor offsets, int64_t group_size, int64_t path);
torch::Tensor w8a8_linear_cpu(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor offsets,
                              int64_t path, c10::optional<torch::Tensor> row_amax);
std::vector<torch::Tensor> moe_route_cpu(torch::Tensor logits, c10::optional<torch::Tensor> bias, int64_t top_k,
                                         int64_t n_groups, int64_t topk_groups, bool sigmoid, bool normalize,
                                         double scale);
std::vector<torch::Tensor> moe_gate_cpu(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias,
                                        int64_t top_k, int64_t n_groups, int64_t topk_groups, bool sigmoid,
                                        bool normalize, double scale);
std::vector<torch::Tensor> moe_sort_rows_cpu(torch::Tensor x, torch::Tensor ids, int64_t n_experts);
std::vector<torch::Tensor> argmax_rows_cpu(torch::Tensor logits);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_mla_decode_cpu", &paged_mla_decode_cpu, "paged MLA decode (absorbed form) on the CPU",
        py::arg("q_latent"), py::arg("q_pe"), py::arg("cache"), py::arg("block_table"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("starts") = py::none(), py::arg("path") = -1);
  m.def("paged_mla_decode_fp8_cpu", &paged_mla_decode_fp8_cpu, "paged MLA decode over an fp8 cache",
        py::arg("q_latent"), py::arg("q_pe"), py::arg("cache"), py::arg("cache_scales"), py::arg("block_table"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("starts") = py::none());
  m.def("grouped_linear_cpu", &grouped_linear_cpu, "x @ weight[g]^T per group of rows, for few rows; gated: SiLU-gated",
        py::arg("x"), py::arg("weight"), py::arg("offsets"), py::arg("gated") = false, py::arg("path") = -1);
  m.def("per_head_linear_cpu", &per_head_linear_cpu, "x [R, H, K] @ stack[h]^T per head h, through the AMX tiles",
        py::arg("x"), py::arg("stack"), py::arg("path") = -1);
  m.def("rms_norm_cpu", &rms_norm_cpu, "RMSNorm of fp32 rows");
  m.def("mla_latent_cpu", &mla_latent_cpu, "in place: RMSNorm of the MLA latent, rotary embedding of its k_pe");
  m.def("mla_input_norms_cpu", &mla_input_norms_cpu,
        "mla_latent_cpu in place on the latent, and RMSNorm of q_a into a new tensor, in one pass");
  m.def("rotate_tail_cpu", &rotate_tail_cpu, "in place: rotary embedding of each head's last columns");
  m.def("silu_mul_cpu", &silu_mul_cpu, "silu(gate) * up");
  m.def("moe_combine_cpu", &moe_combine_cpu,
        "residual + base + the routing-weighted sum of each token's expert outputs", py::arg("y"), py::arg("slot"),
        py::arg("weights"), py::arg("base") = py::none(), py::arg("residual") = py::none());
  m.def("add_rms_norm_cpu", &add_rms_norm_cpu, "(x + y, RMSNorm(x + y)) of fp32 rows");
  // `path` (cpu_isa.h): 0 scalar, 1 AVX2, 2 AVX-512, 3 AVX-512 + BF16, 4 AMX, -1 the best built.
  m.def("cpu_isa_best_path", [] { return static_cast<int64_t>(moelaunch::isa::best_path()); },
        "the best instruction-set path this build has");
  m.def("bf16_dot_calls", [] { return moelaunch::isa::bf16_dot_calls().load(); },
        "how many kernel calls ran their products through vdpbf16ps (AVX512-BF16)");
  m.def("amx_calls", [] { return moelaunch::isa::amx_calls().load(); },
        "how many kernel calls ran their products through the AMX tiles");
  // Integer weights (int_linear_cpu.cpp).
  m.def("int8_linear_cpu", &int8_linear_cpu, "x @ (q * scale)^T per group of rows, int8 weights");
  m.def("int4_linear_cpu", &int4_linear_cpu, "x @ ((q - zero) * scale)^T per group of rows, int4 weights");
  m.def("w8a8_linear_cpu", &w8a8_linear_cpu, "int8 x (quantized per row) @ int8 q^T, both scales", py::arg("x"),
        py::arg("q"), py::arg("scale"), py::arg("offsets"), py::arg("path"), py::arg("row_amax") = py::none());
  m.def("moe_route_cpu", &moe_route_cpu, "MoE router after its GEMM: scores, groups, top-k, weights");
  m.def("moe_gate_cpu", &moe_gate_cpu, "the router's GEMM, then moe_route_cpu");
  m.def("moe_sort_rows_cpu", &moe_sort_rows_cpu, "(token, expert) pairs sorted by expert, their rows gathered");
  m.def("argmax_rows_cpu", &argmax_rows_cpu, "each row's first maximum (or first NaN) and whether it is finite");
}
