// A Llama decoder layer stack for decode-sized steps, run in C++ (model/decode_plan.py).
//
// The Python layer makes ~10 module calls and ~25 torch calls per layer, ~5 us each: about 3 ms of
// a 9 ms int4 decode step on this CPU went to Python and dispatch, not to arithmetic. The plan
// holds each layer's tensors and calls the very kernels the modules call, in the same order with
// the same arguments (gemv / small_gemm, the group and int8 kernels, rms_norm, rotary, kv_store,
// paged_attention, silu_mul), so every float is the one the Python path computes; the residual add
// is fused into the norm after it (add_rms_norm: the same two float operations).
// Python builds a plan only for layers whose every piece has such a kernel; anything else (other
// Linears, tensor parallelism, long prefill chunks) stays on the module path.
#include <torch/extension.h>

#include <vector>

#include "kernels.h"

namespace {

// One Linear and the kernel its module would call for a few rows (see each module's forward).
struct LinearOp {
  enum Kind : int64_t { kFloat = 0, kGroup = 1, kGroupInt8Acts = 2, kInt8 = 3, kInt8Tiled = 4, kGroupInt16Acts = 5 };
  int64_t kind;
  torch::Tensor weight, scale;
  c10::optional<torch::Tensor> zero, bias;
  int64_t group, bits;
  bool tiled;

  torch::Tensor operator()(const torch::Tensor& x) const {
    switch (kind) {
      case kFloat:  // model/layers.py linear(): one row through gemv, a few through small_gemm
        return x.size(0) == 1 ? gemv(x, weight, bias) : small_gemm(x, weight, bias);
      case kGroup: return group_gemm(x, weight, scale, zero, group, bits, bias, tiled);
      case kGroupInt8Acts: return group_gemm_q8act(x, weight, scale, zero, group, bits, bias, tiled);
      case kGroupInt16Acts: return group_gemm_q16act(x, weight, scale, zero, group, bits, bias, tiled);
      case kInt8: return int8_gemm(x, weight, scale, bias);
      case kInt8Tiled: return int8_gemm_tiled(x, weight, scale, bias);
      default: TORCH_CHECK(false, "brisk DecodePlan: unknown linear kind ", kind);
    }
  }
};

struct Layer {
  torch::Tensor input_norm, post_norm;
  LinearOp qkv, o, gate_up, down;
};

}  // namespace

class DecodePlan {
 public:
  DecodePlan(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), intermediate_(intermediate), eps_(eps) {}

  // ops: qkv, o, gate_up, down as (kind, weight, scale, zero, bias, group, bits, tiled)
  void add_layer(const torch::Tensor& input_norm, const torch::Tensor& post_norm, const std::vector<py::tuple>& ops) {
    TORCH_CHECK(ops.size() == 4, "brisk DecodePlan: a layer needs 4 linear ops (qkv, o, gate_up, down)");
    std::vector<LinearOp> parsed;
    for (const auto& t : ops) {
      TORCH_CHECK(t.size() == 8, "brisk DecodePlan: a linear op is (kind, weight, scale, zero, bias, group, bits, tiled)");
      const auto opt = [](const py::handle& h) {
        return h.is_none() ? c10::optional<torch::Tensor>() : c10::optional<torch::Tensor>(h.cast<torch::Tensor>());
      };
      const auto tensor = [](const py::handle& h) { return h.is_none() ? torch::Tensor() : h.cast<torch::Tensor>(); };
      parsed.push_back(LinearOp{t[0].cast<int64_t>(), tensor(t[1]), tensor(t[2]), opt(t[3]), opt(t[4]),
                                t[5].cast<int64_t>(), t[6].cast<int64_t>(), t[7].cast<bool>()});
    }
    layers_.push_back(Layer{input_norm, post_norm, parsed[0], parsed[1], parsed[2], parsed[3]});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Layers [start, end) on (h, residual) [n, hidden] as LlamaDecoderLayer.forward runs them;
  // caches: k0, v0, k1, v1, ... for those layers. Returns the new (h, residual).
  std::tuple<torch::Tensor, torch::Tensor> run(torch::Tensor h, c10::optional<torch::Tensor> residual,
                                               const torch::Tensor& cos, const torch::Tensor& sin,
                                               const std::vector<torch::Tensor>& caches,
                                               const torch::Tensor& slot_blocks, const torch::Tensor& slot_offsets,
                                               const torch::Tensor& block_tables, const torch::Tensor& query_start,
                                               const torch::Tensor& kv_lens, double scale, int64_t start,
                                               int64_t end) {
    TORCH_CHECK(0 <= start && start <= end && end <= num_layers(), "brisk DecodePlan: layers ", start, "..", end,
                " are not in the plan's ", num_layers());
    TORCH_CHECK(static_cast<int64_t>(caches.size()) == 2 * (end - start), "brisk DecodePlan: two caches a layer");
    py::gil_scoped_release no_gil;  // pure C++ from here: let other Python threads (the server) run
    const int64_t n = h.size(0), rotated = heads_ + kv_heads_;
    torch::Tensor res = residual.has_value() ? *residual : torch::Tensor();
    for (int64_t i = start; i < end; ++i) {
      const Layer& L = layers_[i];
      torch::Tensor normed;
      if (res.defined()) std::tie(res, normed) = add_rms_norm(h, res, L.input_norm, eps_);
      else res = h, normed = rms_norm(h, L.input_norm, eps_);
      const torch::Tensor qkv = L.qkv(normed);
      const torch::Tensor qk = rotary(qkv, rotated, cos, sin);  // [n, heads + kv_heads, head_dim]
      const torch::Tensor q = qk.narrow(1, 0, heads_), k = qk.narrow(1, heads_, kv_heads_);
      const torch::Tensor v = qkv.narrow(1, rotated * head_dim_, kv_heads_ * head_dim_).view({n, kv_heads_, head_dim_});
      torch::Tensor k_cache = caches[2 * (i - start)], v_cache = caches[2 * (i - start) + 1];
      kv_store(k_cache, v_cache, k, v, slot_blocks, slot_offsets);
      torch::Tensor attn = torch::empty({n, heads_, head_dim_}, qkv.options());
      paged_attention(attn, q.contiguous(), k_cache, v_cache, block_tables, query_start, kv_lens, scale);
      h = L.o(attn.view({n, heads_ * head_dim_}));
      std::tie(res, normed) = add_rms_norm(h, res, L.post_norm, eps_);
      h = L.down(silu_mul(L.gate_up(normed)));
    }
    return {h, res};
  }

 private:
  int64_t heads_, kv_heads_, head_dim_, intermediate_;
  double eps_;
  std::vector<Layer> layers_;
};

void bind_decode_plan(py::module& m) {
  py::class_<DecodePlan>(m, "DecodePlan", "a Llama layer stack's decode steps in C++ (model/llama.py)")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double>(), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("intermediate"), py::arg("eps"))
      .def("add_layer", &DecodePlan::add_layer, py::arg("input_norm"), py::arg("post_norm"), py::arg("ops"))
      .def("num_layers", &DecodePlan::num_layers)
      .def("run", &DecodePlan::run, py::arg("h"), py::arg("residual"), py::arg("cos"), py::arg("sin"),
           py::arg("caches"), py::arg("slot_blocks"), py::arg("slot_offsets"), py::arg("block_tables"),
           py::arg("query_start"), py::arg("kv_lens"), py::arg("scale"), py::arg("start"), py::arg("end"));
}
