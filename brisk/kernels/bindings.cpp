// Python bindings of brisk._C: one module for all CPU kernels.
#include <torch/extension.h>

#include "isa.h"
#include "blocks.h"
#include "kernels.h"

void bind_decode_plan(py::module& m);
void bind_vmem(py::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_decode_plan(m);
  bind_vmem(m);
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
  m.def("group_gemm_q16act", &group_gemm_q16act,
        "group_gemm (4- or 8-bit) with x quantized to int16 per 32-column block: int16 dot products",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("zero"), py::arg("group"), py::arg("bits"),
        py::arg("bias") = py::none(), py::arg("tiled") = false);
  m.def("group_dequantize", &group_dequantize, "the float32 weight a group-quantized q stands for",
        py::arg("q"), py::arg("scale"), py::arg("zero"), py::arg("group"), py::arg("bits"), py::arg("tiled") = false);
  m.def("group_dequantize_rows", &group_dequantize_rows, "rows ids of the float32 weight a group-quantized q stands for",
        py::arg("q"), py::arg("scale"), py::arg("zero"), py::arg("group"), py::arg("bits"), py::arg("tiled"),
        py::arg("ids"));
  m.def("block_gemm", &block_gemm,
        "x[M,in] @ W^T (+bias), W row-stacked segments of GGUF blocks (any of brisk_blocks' types), x in int8 blocks",
        py::arg("x"), py::arg("blocks"), py::arg("types"), py::arg("bias") = py::none());
  m.def("block_kgemm", &block_kgemm,
        "y[:, first_rows[i]:] = x[M,in] @ W_i^T for K-quant tile segments W_i, x in int8 per 128 columns (prompt work)",
        py::arg("x"), py::arg("blocks"), py::arg("types"), py::arg("first_rows"), py::arg("y"));
  m.def("block_dequantize", &block_dequantize, "rows [r0, r1) of GGUF blocks as float32 (w = d q - m), AVX2+",
        py::arg("blocks"), py::arg("type"), py::arg("in_features"), py::arg("r0"), py::arg("r1"));
  m.def("block_dequantize_bf16", &block_dequantize_bf16,
        "rows [r0, r1) of GGUF blocks as bfloat16 into out (torch's rounding of block_dequantize's floats), AVX2+",
        py::arg("blocks"), py::arg("type"), py::arg("in_features"), py::arg("r0"), py::arg("r1"), py::arg("out"));
  m.def("block_tile", &block_tile, "blocks of a type with tiles [rows, row bytes] repacked 4 rows at a time (kTiled | type), into out if given",
        py::arg("blocks"), py::arg("type"), py::arg("out") = py::none());
  m.def("block_untile", &block_untile, "a tiled weight's rows back in the file's layout", py::arg("tiles"),
        py::arg("type"));
  m.def("block_types", []() {
    std::vector<int64_t> t;
    for (int i = 0; i < 64; ++i)
      if (brisk_blocks::supported(i)) t.push_back(i);
    for (int i = 0; i < 64; ++i)
      if (brisk_blocks::supported(brisk_blocks::kTiled | i)) t.push_back(brisk_blocks::kTiled | i);
    return t;
  }, "GGML type ids the block kernels run, and brisk's tiled ones (kTiled | GGML type)");
  m.def("group_tile_rows", []() { return 4; }, "rows per tile of the group kernels' tiled layout (tiled=True)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up for float32 rows of [gate | up]", py::arg("gate_up"));
  m.def("argmax_rows", &argmax_rows, "first maximum's index of every float32 row (-1: the row has a NaN)",
        py::arg("x"));
  m.def("apply_token_bitmask_", &apply_token_bitmask_,
        "in place: -inf where a grammar's [rows, words] int32 bitmask has the token's bit clear",
        py::arg("logits"), py::arg("bitmask"));
  m.def("act_mul", &act_mul, "act(gate) * up for float32 rows of [gate | up]; act 0: silu, 1: gelu (tanh)",
        py::arg("gate_up"), py::arg("act"));
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
  m.def("sparse24_gemm", &sparse24_gemm,
        "x[M,in] @ W^T (* scale) (+bias), W 2:4 sparse: the kept half of every 4 columns and their positions",
        py::arg("x"), py::arg("values"), py::arg("meta"), py::arg("scale") = py::none(), py::arg("bias") = py::none(),
        py::arg("in_features"));
  m.def("sparse24_dense", &sparse24_dense, "the float32 [out, in] weight a 2:4 sparse one stands for",
        py::arg("values"), py::arg("meta"), py::arg("scale") = py::none(), py::arg("in_features"));
  m.def("isa", &isa_name, "instruction set the kernels dispatch to now");
  m.def("cpu_isa", []() { return brisk_isa::name(brisk_isa::cpu()); }, "the best instruction set this CPU offers");
  m.def("set_isa", [](const std::string& name) { brisk_isa::set(brisk_isa::parse(name)); },
        "lower the instruction set the kernels use (never above the CPU's); before any kernel runs", py::arg("name"));
  m.def("cpu_avx_vnni", &brisk_isa::cpu_avx_vnni, "whether this CPU has AVX-VNNI (vpdpbusd on 256-bit vectors)");
  m.def("avx_vnni", &brisk_isa::avx_vnni, "whether the avx2 level's block kernels use AVX-VNNI now");
  m.def("cpu_amx_bf16", &brisk_isa::cpu_amx_bf16,
        "whether this CPU's AMX-BF16 tiles are usable here (CPU, OS state, Linux permission): torch's bf16 GEMMs run on them");
  m.def("cpu_vendor", &brisk_isa::cpu_vendor, "the CPU's maker: intel, amd or other");
  m.def("set_avx_vnni", &brisk_isa::set_avx_vnni,
        "use AVX-VNNI in the avx2 level's block kernels where the CPU has it (default) or not; before any kernel runs",
        py::arg("on"));
  m.def("rotary", &rotary, "rotary embedding of the first `heads` heads of fused qkv rows (torch's rounding)",
        py::arg("qkv"), py::arg("heads"), py::arg("cos"), py::arg("sin"));
  m.def("kv_store", &kv_store, "write new tokens' keys and values into their paged slots", py::arg("k_cache"),
        py::arg("v_cache"), py::arg("k"), py::arg("v"), py::arg("slot_blocks"), py::arg("slot_offsets"));
  m.def("paged_attention", &paged_attention, "exact causal attention over a paged KV cache (in place into out)");
}
