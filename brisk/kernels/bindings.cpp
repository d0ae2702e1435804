// Python bindings of brisk._C: one module for all CPU kernels.
#include <torch/extension.h>

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias);
std::string isa_name();
torch::Tensor small_gemm(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias);
torch::Tensor int8_gemm_tiled(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                              const c10::optional<torch::Tensor>& bias);
torch::Tensor int8_gemm(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                        const c10::optional<torch::Tensor>& bias);
torch::Tensor group_gemm(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                         const c10::optional<torch::Tensor>& zero, int64_t group, int64_t bits,
                         const c10::optional<torch::Tensor>& bias, bool tiled);
torch::Tensor group_gemm_q8act(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                               const c10::optional<torch::Tensor>& zero, int64_t group, int64_t bits,
                               const c10::optional<torch::Tensor>& bias, bool tiled);
torch::Tensor group_dequantize(const torch::Tensor& q, const torch::Tensor& scale,
                               const c10::optional<torch::Tensor>& zero, int64_t group, int64_t bits, bool tiled);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
std::tuple<torch::Tensor, torch::Tensor> quantize_rows(const torch::Tensor& x, bool unsigned_offset);
torch::Tensor int8_epilogue(const torch::Tensor& acc, const torch::Tensor& a, const torch::Tensor& s,
                            const c10::optional<torch::Tensor>& bias);
torch::Tensor int8_dot_u8s8(const torch::Tensor& xq, const torch::Tensor& w);
bool have_vnni();
torch::Tensor ternary_gemm(const torch::Tensor& x, const torch::Tensor& plus, const torch::Tensor& minus,
                           const torch::Tensor& scale, const c10::optional<torch::Tensor>& bias);
void paged_attention(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                     const torch::Tensor& query_start, const torch::Tensor& kv_lens, double scale);
torch::Tensor rotary(const torch::Tensor& qkv, int64_t heads, const torch::Tensor& cos, const torch::Tensor& sin);
void kv_store(torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& k, const torch::Tensor& v,
              const torch::Tensor& slot_blocks, const torch::Tensor& slot_offsets);

void bind_decode_plan(py::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_decode_plan(m);
  m.def("gemv", &gemv, "x[1,in] @ w[out,in]^T (+bias) streaming the weight once", py::arg("x"), py::arg("w"),
        py::arg("bias") = py::none());
  m.def("small_gemm", &small_gemm, "x[M,in] @ w[out,in]^T (+bias) for small M, weights streamed once",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("int8_gemm", &int8_gemm, "(x[M,in] @ q[out,in]^T) * scale[out] (+bias), int8 weights streamed once",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("bias") = py::none());
  m.def("int8_gemm_tiled", &int8_gemm_tiled, "int8_gemm with q in 4-row x 64-column tiles (one memory stream)",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("bias") = py::none());
  m.def("group_gemm", &group_gemm, "x[M,in] @ W^T (+bias), W group-quantized (4-bit table or 8-bit), streamed once",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("zero"), py::arg("group"), py::arg("bits"),
        py::arg("bias") = py::none(), py::arg("tiled") = false);
  m.def("group_gemm_q8act", &group_gemm_q8act,
        "group_gemm with x quantized to int8 per 32-column block: VNNI integer dot products (AVX512-VNNI)",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("zero"), py::arg("group"), py::arg("bits"),
        py::arg("bias") = py::none(), py::arg("tiled") = false);
  m.def("group_dequantize", &group_dequantize, "the float32 weight a group-quantized q stands for",
        py::arg("q"), py::arg("scale"), py::arg("zero"), py::arg("group"), py::arg("bits"), py::arg("tiled") = false);
  m.def("group_tile_rows", []() { return 4; }, "rows per tile of the group kernels' tiled layout (tiled=True)");
  m.def("rms_norm", &rms_norm, "x / sqrt(mean(x^2) + eps) * w for float32 rows", py::arg("x"), py::arg("w"),
        py::arg("eps"));
  m.def("quantize_rows", &quantize_rows, "per-row symmetric int8 of x (+ 128 as uint8 if unsigned_offset); scales",
        py::arg("x"), py::arg("unsigned_offset"));
  m.def("int8_epilogue", &int8_epilogue, "acc[M,N] * a[M] * s[N] (+ bias) as float32", py::arg("acc"), py::arg("a"),
        py::arg("s"), py::arg("bias") = py::none());
  m.def("int8_dot_u8s8", &int8_dot_u8s8, "int32 [M, N] = uint8 xq [M, K] . int8 w [N, K] (AVX512-VNNI)", py::arg("xq"),
        py::arg("w"));
  m.def("have_vnni", &have_vnni, "whether this CPU runs the VNNI int8 kernels");
  m.def("ternary_gemm", &ternary_gemm, "x @ T^T * scale (+bias), T ternary in two bit planes: masked adds/subs",
        py::arg("x"), py::arg("plus"), py::arg("minus"), py::arg("scale"), py::arg("bias") = py::none());
  m.def("isa", &isa_name, "instruction set the GEMV kernels dispatch to on this CPU");
  m.def("rotary", &rotary, "rotary embedding of the first `heads` heads of fused qkv rows (torch's rounding)",
        py::arg("qkv"), py::arg("heads"), py::arg("cos"), py::arg("sin"));
  m.def("kv_store", &kv_store, "write new tokens' keys and values into their paged slots", py::arg("k_cache"),
        py::arg("v_cache"), py::arg("k"), py::arg("v"), py::arg("slot_blocks"), py::arg("slot_offsets"));
  m.def("paged_attention", &paged_attention, "exact causal attention over a paged KV cache (in place into out)");
}
