// The CPU kernels' Python module: one extension, built once per machine (kernels/cpu_extension.py).
#include <torch/extension.h>

torch::Tensor paged_mla_decode_cpu(torch::Tensor q_latent, torch::Tensor q_pe, torch::Tensor cache,
                                   torch::Tensor block_table, torch::Tensor seq_lens, double scale);
torch::Tensor grouped_linear_cpu(torch::Tensor x, torch::Tensor weight, torch::Tensor offsets);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_mla_decode_cpu", &paged_mla_decode_cpu, "paged MLA decode (absorbed form) on the CPU");
  m.def("grouped_linear_cpu", &grouped_linear_cpu, "x @ weight[g]^T per group of rows, for few rows");
}
