// The group-quantized weight layout both group kernels read (cpu_quant.cpp: float activations,
// cpu_quant_vnni.cpp: int8 activations), and the checks that a set of tensors has it. The layout
// itself is described at the top of cpu_quant.cpp and in quant/grouped.py.
#pragma once

#include <torch/extension.h>

#include "simd.h"

namespace brisk_group {

struct GroupWeights {
  const uint8_t* q;
  const uint16_t* scale;  // float16 bits [out, groups] (tiled: 4 rows x 1 group)
  const uint16_t* zero;   // float16 bits, as scale; null for 8-bit
  int64_t out, in, group, groups;
  int64_t run_bytes;  // bytes of one row's 32-column run: 16 (4-bit) or 32 (8-bit)
  bool tiled;

  // Index of row r's group g in scale and zero.
  int64_t at(int64_t r, int64_t g) const { return tiled ? ((r >> 2) * groups + g) * 4 + (r & 3) : r * groups + g; }

  // Where row r's run of columns [32 c, 32 c + 32) starts.
  const uint8_t* run(int64_t r, int64_t c) const {
    if (tiled) return q + (((r >> 2) * (in / 32) + c) * 4 + (r & 3)) * run_bytes;
    return q + (r * (in / 32) + c) * run_bytes;
  }
};

inline GroupWeights check_group_weights(const torch::Tensor& q, const torch::Tensor& scale,
                                        const c10::optional<torch::Tensor>& zero, int64_t group, int64_t bits,
                                        bool tiled) {
  TORCH_CHECK(bits == 4 || bits == 8, "brisk group kernels: bits must be 4 or 8");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.device().is_cpu() && scale.device().is_cpu(),
              "brisk group kernels: q and scale must be contiguous CPU tensors");
  TORCH_CHECK(bits == 4 ? q.scalar_type() == torch::kUInt8 : q.scalar_type() == torch::kInt8,
              "brisk group kernels: 4-bit q is uint8, 8-bit q is int8");
  const int64_t out = q.size(0), in = bits == 4 ? q.size(1) * 2 : q.size(1);
  TORCH_CHECK(group > 0 && group % 32 == 0 && in % group == 0, "brisk group kernels: group ", group,
              " must be a multiple of 32 dividing ", in);
  const int64_t groups = in / group;
  TORCH_CHECK(!tiled || out % 4 == 0, "brisk group kernels: a tiled weight needs out % 4 == 0, got ", out);
  TORCH_CHECK(scale.scalar_type() == torch::kFloat16 && scale.is_contiguous() && scale.numel() == out * groups,
              "brisk group kernels: scale must be contiguous float16 [out, in / group]");
  TORCH_CHECK(bits == 8 || (zero.has_value() && zero->scalar_type() == torch::kFloat16 && zero->is_contiguous() &&
                            zero->numel() == out * groups),
              "brisk group kernels: 4-bit needs a contiguous float16 zero [out, in / group]");
  return GroupWeights{static_cast<const uint8_t*>(q.data_ptr()), static_cast<const uint16_t*>(scale.data_ptr()),
                      bits == 4 ? static_cast<const uint16_t*>(zero->data_ptr()) : nullptr, out, in, group, groups,
                      bits == 4 ? 16 : 32, tiled};
}

}  // namespace brisk_group
