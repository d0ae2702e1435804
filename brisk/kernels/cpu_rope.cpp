// The glue of a decode step around attention, one call each instead of several torch ops per layer
// (together ~20 us a layer in eager torch, 0.6 ms of a 30-layer decode step):
//
//   rotary(qkv, heads, cos, sin): rotate the query and key heads at the front of each fused qkv row,
//     x * cos + rotate_half(x) * sin, exactly as model/rotary.apply_rotary computes it: two
//     products and a sum, each rounded on its own (contraction into fma is switched off below),
//     so results are torch's bit for bit.
//   kv_store(k_cache, v_cache, k, v, slot_blocks, slot_offsets): write each new token's keys and
//     values into its paged slot (the two index_put_ of model/paged_attention.py, in one pass).
#include <torch/extension.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cstring>

#include "kernels.h"

namespace {

// `optimize` keeps GCC from fusing the products into the sum (C++ mode contracts by default),
// which would round once instead of twice and differ from torch in the last bit.
__attribute__((optimize("fp-contract=off"))) void rotate_row(const float* x, const float* c, const float* s,
                                                             float* out, int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float* xh = x + h * head_dim;
    float* oh = out + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float a = xh[i] * c[i];
      const float b = -xh[i + half] * s[i];
      oh[i] = a + b;
    }
    for (int64_t i = half; i < head_dim; ++i) {
      const float a = xh[i] * c[i];
      const float b = xh[i - half] * s[i];
      oh[i] = a + b;
    }
  }
}

// One token's keys and values (head h at k + h * k_head_stride) into slot `offset` of `block`.
template <typename T>
void store_token(T* kc, T* vc, int64_t n_kv, int64_t head_dim, int64_t block_size, const T* k, int64_t k_head_stride,
                 const T* v, int64_t v_head_stride, int64_t block, int64_t offset) {
  for (int64_t h = 0; h < n_kv; ++h) {
    const T* ks = k + h * k_head_stride;
    T* kd = kc + ((block * n_kv + h) * head_dim) * block_size + offset;  // column `offset` of a [hd, bs] tile
    T* vd = vc + ((block * n_kv + h) * block_size + offset) * head_dim;  // row `offset` of a [bs, hd] tile
    for (int64_t d = 0; d < head_dim; ++d) kd[d * block_size] = ks[d];
    std::memcpy(vd, v + h * v_head_stride, head_dim * sizeof(T));
  }
}

}  // namespace

// qkv [n, >= heads * head_dim] float32 with unit column stride; cos, sin [n, head_dim] float32
// contiguous. Returns the rotated heads as a new [n, heads, head_dim] tensor.
torch::Tensor rotary(const torch::Tensor& qkv, int64_t heads, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kFloat32 && qkv.stride(1) == 1 && qkv.device().is_cpu(),
              "brisk rotary: qkv must be a float32 CPU [n, width] with unit column stride");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == qkv.size(0) && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32,
              "brisk rotary: cos and sin must be contiguous float32 [n, head_dim]");
  const int64_t n = qkv.size(0), head_dim = cos.size(1);
  TORCH_CHECK(head_dim % 2 == 0 && heads * head_dim <= qkv.size(1), "brisk rotary: ", heads, " heads of ", head_dim,
              " do not fit a row of ", qkv.size(1));
  auto out = torch::empty({n, heads, head_dim}, qkv.options());
  const float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row = qkv.stride(0);
  at::parallel_for(0, n, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      rotate_row(xp + t * row, cp + t * head_dim, sp + t * head_dim, op + t * heads * head_dim, heads, head_dim);
  });
  return out;
}

// k_cache [blocks, n_kv, head_dim, block_size], v_cache [blocks, n_kv, block_size, head_dim] (one
// layer, model/paged_attention.py); k, v [n, n_kv, head_dim] with unit stride along head_dim (views
// into the rotated and fused tensors are fine); slot_blocks, slot_offsets [n] int64.
void kv_store(torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& k, const torch::Tensor& v,
              const torch::Tensor& slot_blocks, const torch::Tensor& slot_offsets) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 && v_cache.dim() == 4 &&
                  k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "brisk kv_store: contiguous 4-D CPU caches expected");
  const int64_t n = k.size(0), n_kv = k_cache.size(1), head_dim = k_cache.size(2), block_size = k_cache.size(3);
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.size(1) == n_kv && k.size(2) == head_dim && v.sizes() == k.sizes() &&
                  k.stride(2) == 1 && v.stride(2) == 1,
              "brisk kv_store: k and v must be [n, ", n_kv, ", ", head_dim, "] with unit stride along head_dim");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "brisk kv_store: k and v must have the caches' dtype");
  brisk_range::check_slots(slot_blocks, slot_offsets, n, k_cache.size(0), block_size, "kv_store");
  const int64_t* bp = slot_blocks.data_ptr<int64_t>();
  const int64_t* op = slot_offsets.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "brisk_kv_store", [&] {
    for (int64_t t = 0; t < n; ++t)
      store_token(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), n_kv, head_dim, block_size,
                  k.data_ptr<scalar_t>() + t * k.stride(0), k.stride(1), v.data_ptr<scalar_t>() + t * v.stride(0),
                  v.stride(1), bp[t], op[t]);
  });
}

namespace brisk_range {

void check_slots(const torch::Tensor& slot_blocks, const torch::Tensor& slot_offsets, int64_t n, int64_t num_blocks,
                 int64_t block_size, const char* who) {
  TORCH_CHECK(slot_blocks.scalar_type() == torch::kLong && slot_offsets.scalar_type() == torch::kLong &&
                  slot_blocks.numel() == n && slot_offsets.numel() == n && slot_blocks.is_contiguous() &&
                  slot_offsets.is_contiguous() && slot_blocks.device().is_cpu() && slot_offsets.device().is_cpu(),
              "brisk ", who, ": slot_blocks and slot_offsets must be contiguous int64 CPU [n]");
  const int64_t* bp = slot_blocks.data_ptr<int64_t>();
  const int64_t* op = slot_offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(bp[t] >= 0 && bp[t] < num_blocks && op[t] >= 0 && op[t] < block_size, "brisk ", who, ": slot (",
                bp[t], ", ", op[t], ") is outside the cache");
}

void rotate_heads(const float* x, const float* cos, const float* sin, float* out, int64_t heads, int64_t head_dim) {
  rotate_row(x, cos, sin, out, heads, head_dim);
}

void kv_store_row(float* k_cache, float* v_cache, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                  const float* k, const float* v, int64_t block, int64_t offset) {
  store_token(k_cache, v_cache, kv_heads, head_dim, block_size, k, head_dim, v, head_dim, block, offset);
}

}  // namespace brisk_range
