// Declarations of brisk's C++ CPU kernels, shared by the Python bindings and the decode plan
// (which calls them directly, without Python).
#pragma once

#include <torch/extension.h>

#include <string>
#include <tuple>

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
torch::Tensor group_gemm_q16act(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                               const c10::optional<torch::Tensor>& zero, int64_t group, int64_t bits,
                               const c10::optional<torch::Tensor>& bias, bool tiled);
torch::Tensor group_dequantize(const torch::Tensor& q, const torch::Tensor& scale,
                               const c10::optional<torch::Tensor>& zero, int64_t group, int64_t bits, bool tiled);
torch::Tensor group_dequantize_rows(const torch::Tensor& q, const torch::Tensor& scale,
                                    const c10::optional<torch::Tensor>& zero, int64_t group, int64_t bits, bool tiled,
                                    const torch::Tensor& ids);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& h, const torch::Tensor& res,
                                                      const torch::Tensor& w, double eps);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
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
