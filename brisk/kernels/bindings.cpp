// Python bindings of brisk._C: one module for all CPU kernels.
#include <torch/extension.h>

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias);
std::string isa_name();
torch::Tensor small_gemm(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias);
torch::Tensor int8_gemm(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                        const c10::optional<torch::Tensor>& bias);
void paged_attention(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                     const torch::Tensor& query_start, const torch::Tensor& kv_lens, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "x[1,in] @ w[out,in]^T (+bias) streaming the weight once", py::arg("x"), py::arg("w"),
        py::arg("bias") = py::none());
  m.def("small_gemm", &small_gemm, "x[M,in] @ w[out,in]^T (+bias) for small M, weights streamed once",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("int8_gemm", &int8_gemm, "(x[M,in] @ q[out,in]^T) * scale[out] (+bias), int8 weights streamed once",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("bias") = py::none());
  m.def("isa", &isa_name, "instruction set the GEMV kernels dispatch to on this CPU");
  m.def("paged_attention", &paged_attention, "exact causal attention over a paged KV cache (in place into out)");
}
