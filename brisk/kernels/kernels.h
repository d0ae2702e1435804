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
torch::Tensor block_gemm(const torch::Tensor& x, const std::vector<torch::Tensor>& blocks,
                         const std::vector<int64_t>& types, const c10::optional<torch::Tensor>& bias);
void block_kgemm(const torch::Tensor& x, const std::vector<torch::Tensor>& blocks, const std::vector<int64_t>& types,
                 const std::vector<int64_t>& first_rows, const torch::Tensor& y);
torch::Tensor block_dequantize(const torch::Tensor& blocks, int64_t type, int64_t in, int64_t r0, int64_t r1);
void block_dequantize_bf16(const torch::Tensor& blocks, int64_t type, int64_t in, int64_t r0, int64_t r1,
                           const torch::Tensor& out);
torch::Tensor block_tile(const torch::Tensor& blocks, int64_t type, const std::optional<torch::Tensor>& out);
torch::Tensor block_untile(const torch::Tensor& tiles, int64_t type);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
torch::Tensor act_mul(const torch::Tensor& gate_up, int64_t act);
torch::Tensor argmax_rows(const torch::Tensor& x);
void apply_token_bitmask_(torch::Tensor& logits, const torch::Tensor& bitmask);
std::tuple<torch::Tensor, torch::Tensor> quantize_rows(const torch::Tensor& x, bool unsigned_offset);
torch::Tensor int8_epilogue(const torch::Tensor& acc, const torch::Tensor& a, const torch::Tensor& s,
                            const c10::optional<torch::Tensor>& bias);
torch::Tensor int8_dot_u8s8(const torch::Tensor& xq, const torch::Tensor& w);
bool have_vnni();
torch::Tensor ternary_gemm(const torch::Tensor& x, const torch::Tensor& plus, const torch::Tensor& minus,
                           const torch::Tensor& scale, const c10::optional<torch::Tensor>& bias);
torch::Tensor sparse24_gemm(const torch::Tensor& x, const torch::Tensor& values, const torch::Tensor& meta,
                            const c10::optional<torch::Tensor>& scale, const c10::optional<torch::Tensor>& bias,
                            int64_t in);
torch::Tensor sparse24_dense(const torch::Tensor& values, const torch::Tensor& meta,
                             const c10::optional<torch::Tensor>& scale, int64_t in);
void paged_attention(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                     const torch::Tensor& query_start, const torch::Tensor& kv_lens, double scale, int64_t window);
torch::Tensor rotary(const torch::Tensor& qkv, int64_t heads, const torch::Tensor& cos, const torch::Tensor& sin);
void kv_store(torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& k, const torch::Tensor& v,
              const torch::Tensor& slot_blocks, const torch::Tensor& slot_offsets);

// ---- Range entry points: the decode plan's threads (cpu_decode_plan.cpp) ----------------------
// The plan runs a whole decode step inside one parallel region, so it cannot call the entry points
// above (each forks and joins the thread pool, ~2 us, 150 times a token). These compute a slice
// of the same work from raw pointers: output rows [r0, r1) of a Linear (r0, r1 multiples of
// `kRowUnit`), work items [w0, w1) of attention. The entry points above split exactly these units
// over at::parallel_for, and every row or item is computed the same way whoever computes it, so
// the plan's floats are theirs.
#include <vector>

#include "blocks.h"
#include "group_weights.h"

namespace brisk_range {

constexpr int64_t kRowUnit = 4;  // rows of a 4-row block or tile: every Linear kernel's unit

// y[m, out] rows [r0, r1) of x[m, in] @ w^T: gemv's loop for one row of x, small_gemm's for more.
void float_rows(const float* w, const float* x, float* y, int64_t m, int64_t out, int64_t in, int64_t r0, int64_t r1);
// int8_gemm (q row-major) and int8_gemm_tiled without their epilogue (scale, bias).
void int8_rows(const int8_t* q, const float* x, float* y, int64_t m, int64_t out, int64_t in, int64_t r0, int64_t r1);
void int8_tiled_rows(const int8_t* q, const float* x, float* y, int64_t m, int64_t out, int64_t in, int64_t r0,
                     int64_t r1);
// sparse24_gemm without its epilogue (scale, bias): 2:4 values (float32 or int8) and their meta.
void sparse24_rows(const torch::Tensor& values, const int32_t* meta, const float* x, float* y, int64_t m, int64_t out,
                   int64_t in, int64_t r0, int64_t r1);
// group_gemm without bias: group weights x float activations.
void group_rows(const brisk_group::GroupWeights& w, const float* x, float* y, int64_t m, int64_t r0, int64_t r1);

// Activations quantized in 32-column blocks for the VNNI group kernels (levels 127: int8, 32767:
// int16; group_gemm_q8act / group_gemm_q16act), held by the thread that quantized them.
struct QuantizedActs {
  int levels = 0;
  std::vector<int8_t> q8;
  std::vector<int16_t> q16;
  std::vector<float> a, c;
  brisk_blocks::BlockActs blocks;  // the GGUF block kernels' (cpu_blocks.cpp)
};
void quantize_acts(int levels, const brisk_group::GroupWeights& w, const float* x, int64_t m, QuantizedActs& out);
void group_qact_rows(const brisk_group::GroupWeights& w, const QuantizedActs& x, float* y, int64_t m, int64_t r0,
                     int64_t r1);

// Attention of one step: the token -> (sequence, context) map every layer shares, and the items
// paged_attention splits over threads ((token, KV head), or halves of its query heads). With a
// sliding window, token t sees keys first_of[t] .. ctx_of[t] - 1 (first_of is 0 without one).
struct AttentionStep {
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0, block_size = 0, max_blocks = 0, num_tokens = 0;
  float scale = 0.0f;
  const int32_t* block_tables = nullptr;
  std::vector<int64_t> seq_of, ctx_of, first_of;
  int64_t split = 1, items = 0;
};
AttentionStep attention_step(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             const torch::Tensor& block_tables, const torch::Tensor& query_start,
                             const torch::Tensor& kv_lens, double scale, int64_t num_tokens, int64_t threads,
                             int64_t window = 0);
void attention_items(const AttentionStep& a, const float* q, float* out, const float* k_cache, const float* v_cache,
                     int64_t w0, int64_t w1);

// One row's pieces of the layer glue (cpu_norm.cpp, cpu_rope.cpp).
void rms_norm_row(const float* x, const float* w, float* y, int64_t h, float eps);
void silu_mul_row(const float* g, const float* u, float* y, int64_t n);
void gelu_tanh_mul_row(const float* g, const float* u, float* y, int64_t n);
void rotate_heads(const float* x, const float* cos, const float* sin, float* out, int64_t heads, int64_t head_dim);
// slot_blocks, slot_offsets: contiguous int64 [n], every slot inside a cache of `num_blocks` blocks
// of `block_size` (kv_store and the decode plan check their slots here; `who` names the caller).
void check_slots(const torch::Tensor& slot_blocks, const torch::Tensor& slot_offsets, int64_t n, int64_t num_blocks,
                 int64_t block_size, const char* who);
void kv_store_row(float* k_cache, float* v_cache, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                  const float* k, const float* v, int64_t block, int64_t offset);

}  // namespace brisk_range
