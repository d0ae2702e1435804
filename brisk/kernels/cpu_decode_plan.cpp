// A decoder layer stack for decode-sized steps, run in C++ (runtime/decode_plan.py): Llama's layer,
// and Gemma 3's (norms after attention and MLP too, QK norm, GELU, sliding windows, two rotary
// tables), which are the same steps with a few more row-wise pieces.
//
// The Python layer makes ~10 module calls and ~25 torch calls per layer, ~5 us each: about 3 ms of
// a 9 ms int4 decode step on this CPU went to Python and dispatch, not to arithmetic. The plan
// holds each layer's weights and runs the very kernels the modules call (gemv / small_gemm, the
// group and int8 kernels, rms_norm, rotary, kv_store, paged_attention, silu_mul) on the same
// rows, so every float is the one the Python path computes (tested bit for bit); the residual add
// is fused into the norm after it (the same two float operations).
//
// A whole step is one OpenMP parallel region. Calling each kernel's tensor entry point forked and
// joined the thread pool ~150 times a token (~2 us each) and allocated every intermediate; the
// waiting thread sat idle through all the serial glue. Here the threads split each Linear's rows
// and attention's items (kernels.h brisk_range: the units the entry points split), meet at a spin
// barrier wherever a step reads what both wrote, and each computes the small row-wise glue (norm,
// silu, activation quantization) for itself. int4 decode went from 4.5 to 2.9 ms of layers a token.
// Python builds a plan only for layers whose every piece has such a kernel; anything else (other
// Linears, tensor parallelism, long prefill chunks) stays on the module path.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <utility>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

using brisk_group::GroupWeights;

// Threads of the plan's one parallel region meet here between the steps that need each other's
// rows. A spin on one cache line: the ~2 us it saves over a fork/join is the point. After a few
// thousand spins a waiter yields, so an oversubscribed machine still makes progress.
class SpinBarrier {
 public:
  void reset(int n) { n_ = n, arrived_.store(0), generation_.store(0); }
  void wait() {
    if (n_ == 1) return;
    const int gen = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(gen + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; generation_.load(std::memory_order_acquire) == gen; ++spins) {
#ifdef BRISK_X86
      if (spins < 4096) {
        _mm_pause();
        continue;
      }
#endif
      std::this_thread::yield();
    }
  }

 private:
  int n_ = 1;
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<int> generation_{0};
};

// One Linear and the kernel its module would call for a few rows (see each module's forward), as
// raw pointers into the tensors it keeps alive.
struct LinearOp {
  enum Kind : int64_t {
    kFloat = 0, kGroup = 1, kGroupInt8Acts = 2, kInt8 = 3, kInt8Tiled = 4, kGroupInt16Acts = 5, kBlocks = 6,
    kSparse24 = 7
  };
  int64_t kind = 0, out = 0, in = 0;
  torch::Tensor weight, scale, zero, bias;  // bias: float32 [out] or undefined
  GroupWeights group{};                     // the group kinds
  std::vector<torch::Tensor> block_tensors;  // kBlocks: GGUF blocks per stacked part, kept alive
  std::vector<brisk_blocks::Segment> segments;
  // optional low-rank adapter, y += (x a^T) b^T: a [rank, in], b [out, rank] float32
  // (Speculative Streaming's stream pass: speculative/streaming.py)
  torch::Tensor lora_a, lora_b;

  // Rows of y [m, out] that thread `tid` of `team` computes: whole 4-row units, split evenly.
  std::pair<int64_t, int64_t> slice(int tid, int team) const {
    const int64_t units = (out + brisk_range::kRowUnit - 1) / brisk_range::kRowUnit;
    return {brisk_range::kRowUnit * (units * tid / team),
            std::min(out, brisk_range::kRowUnit * (units * (tid + 1) / team))};
  }

  // y's rows [r0, r1) = x [m, in] through this Linear; `acts` is the calling thread's scratch.
  // No contraction: the epilogue's multiply and add round separately, as torch's two ops do.
  __attribute__((optimize("fp-contract=off"))) void rows(const float* x, int64_t m, float* y, int64_t r0, int64_t r1, brisk_range::QuantizedActs& acts) const {
    if (r0 >= r1) return;
    switch (kind) {
      case kFloat: brisk_range::float_rows(weight.data_ptr<float>(), x, y, m, out, in, r0, r1); break;
      case kGroup: brisk_range::group_rows(group, x, y, m, r0, r1); break;
      case kGroupInt8Acts:
      case kGroupInt16Acts:
        brisk_range::quantize_acts(kind == kGroupInt8Acts ? 127 : 32767, group, x, m, acts);
        brisk_range::group_qact_rows(group, acts, y, m, r0, r1);
        break;
      case kBlocks:
        brisk_blocks::quantize_acts(x, m, in, acts.blocks);
        brisk_blocks::rows(segments, acts.blocks, y, out, r0, r1);
        break;
      case kInt8: brisk_range::int8_rows(weight.data_ptr<int8_t>(), x, y, m, out, in, r0, r1); break;
      case kInt8Tiled: brisk_range::int8_tiled_rows(weight.data_ptr<int8_t>(), x, y, m, out, in, r0, r1); break;
      case kSparse24: brisk_range::sparse24_rows(weight, zero.data_ptr<int32_t>(), x, y, m, out, in, r0, r1); break;
      default: break;  // add_layer admits only the kinds above
    }
    // the modules' epilogues (y.mul_(scale), y.add_(bias)): one rounding each, as torch's
    const bool scaled = kind == kInt8 || kind == kInt8Tiled || (kind == kSparse24 && scale.defined());
    if (!scaled && !bias.defined()) return;
    const float* s = scaled ? scale.data_ptr<float>() : nullptr;
    const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
    for (int64_t k = 0; k < m; ++k)
      for (int64_t r = r0; r < r1; ++r) {
        float& v = y[k * out + r];
        if (s) v *= s[r];
        if (b) v += b[r];
      }
  }
};

// (kBlocks, [blocks per part], [GGML type per part], None, bias, in_features, 0, False)
LinearOp parse_blocks(const py::tuple& t) {
  LinearOp op;
  op.kind = LinearOp::kBlocks;
  op.block_tensors = t[1].cast<std::vector<torch::Tensor>>();
  const auto types = t[2].cast<std::vector<int64_t>>();
  op.in = t[5].cast<int64_t>();
  TORCH_CHECK(!op.block_tensors.empty() && op.block_tensors.size() == types.size() && op.in % 32 == 0,
              "brisk DecodePlan: a blocks op is one GGML type per part and an input width multiple of 32");
  for (size_t i = 0; i < types.size(); ++i) {
    const torch::Tensor& b = op.block_tensors[i];
    const int type = static_cast<int>(types[i]);
    TORCH_CHECK(brisk_blocks::supported(type), "brisk DecodePlan: GGML type ", type, " has no block kernel");
    TORCH_CHECK(b.dim() == 2 && b.scalar_type() == torch::kUInt8 && b.is_contiguous() && b.device().is_cpu() &&
                    op.in % brisk_blocks::block_cols(type) == 0 &&
                    b.size(1) == op.in / brisk_blocks::block_cols(type) * brisk_blocks::block_bytes(type),
                "brisk DecodePlan: blocks of part ", i, " do not fit ", op.in, " columns of type ", type);
    op.segments.push_back({b.data_ptr<uint8_t>(), type, b.size(0), op.in, b.size(1), op.out});
    op.out += b.size(0);
  }
  if (!t[4].is_none()) {
    const torch::Tensor bias = t[4].cast<torch::Tensor>();
    TORCH_CHECK(bias.device().is_cpu() && bias.numel() == op.out, "brisk DecodePlan: bias must be a CPU tensor of ",
                op.out, " elements");
    op.bias = bias.to(torch::kFloat32).contiguous();
  }
  return op;
}

LinearOp parse_linear(const py::tuple& t) {
  TORCH_CHECK(t.size() == 8, "brisk DecodePlan: a linear op is (kind, weight, scale, zero, bias, group, bits, tiled)");
  const auto tensor = [](const py::handle& h) { return h.is_none() ? torch::Tensor() : h.cast<torch::Tensor>(); };
  LinearOp op;
  op.kind = t[0].cast<int64_t>();
  if (op.kind == LinearOp::kBlocks) return parse_blocks(t);
  op.weight = tensor(t[1]), op.scale = tensor(t[2]), op.zero = tensor(t[3]);
  const torch::Tensor bias = tensor(t[4]);
  const int64_t group = t[5].cast<int64_t>(), bits = t[6].cast<int64_t>();
  const bool tiled = t[7].cast<bool>();
  TORCH_CHECK(op.weight.defined() && op.weight.dim() == 2 && op.weight.is_contiguous() && op.weight.device().is_cpu(),
              "brisk DecodePlan: a linear op needs a contiguous CPU weight");
  switch (op.kind) {
    case LinearOp::kFloat:
      TORCH_CHECK(op.weight.scalar_type() == torch::kFloat32, "brisk DecodePlan: float weights must be float32");
      op.out = op.weight.size(0), op.in = op.weight.size(1);
      break;
    case LinearOp::kGroup:
    case LinearOp::kGroupInt8Acts:
    case LinearOp::kGroupInt16Acts:
      op.group = brisk_group::check_group_weights(op.weight, op.scale, op.zero.defined() ? c10::optional<torch::Tensor>(op.zero)
                                                                                    : c10::nullopt, group, bits, tiled);
      op.out = op.group.out, op.in = op.group.in;
      break;
    case LinearOp::kInt8:
    case LinearOp::kInt8Tiled:
      TORCH_CHECK(op.weight.scalar_type() == torch::kInt8, "brisk DecodePlan: int8 weights must be int8");
      op.out = op.weight.size(0), op.in = op.weight.size(1);
      TORCH_CHECK(op.scale.defined() && op.scale.scalar_type() == torch::kFloat32 && op.scale.is_contiguous() &&
                      op.scale.numel() == op.out, "brisk DecodePlan: int8 scale must be contiguous float32 [out]");
      TORCH_CHECK(op.kind == LinearOp::kInt8 || (op.out % 4 == 0 && op.in % 64 == 0),
                  "brisk DecodePlan: a tiled int8 weight needs out % 4 == 0 and in % 64 == 0");
      break;
    case LinearOp::kSparse24:  // (kind, values, scale or None, meta, bias, in_features, 0, False)
      op.out = op.weight.size(0), op.in = group;
      TORCH_CHECK(op.zero.defined() && op.zero.scalar_type() == torch::kInt32 && op.zero.is_contiguous() &&
                      op.zero.size(0) == op.out && op.weight.size(1) == op.zero.size(1) * 16 &&
                      op.in > 0 && op.in % 4 == 0 && (op.in + 31) / 32 == op.zero.size(1) &&
                      (op.weight.scalar_type() == torch::kInt8) == op.scale.defined() &&
                      (op.weight.scalar_type() == torch::kInt8 || op.weight.scalar_type() == torch::kFloat32),
                  "brisk DecodePlan: a 2:4 op is float32 or int8 values [out, tiles * 16] (int8 with a scale), "
                  "int32 meta [out, tiles]");
      TORCH_CHECK(!op.scale.defined() || (op.scale.scalar_type() == torch::kFloat32 && op.scale.is_contiguous() &&
                                          op.scale.numel() == op.out),
                  "brisk DecodePlan: a 2:4 scale must be contiguous float32 [out]");
      break;
    default: TORCH_CHECK(false, "brisk DecodePlan: unknown linear kind ", op.kind);
  }
  TORCH_CHECK(!op.zero.defined() || op.zero.device().is_cpu(), "brisk DecodePlan: zero must be a CPU tensor");
  if (bias.defined()) {
    TORCH_CHECK(bias.device().is_cpu() && bias.numel() == op.out, "brisk DecodePlan: bias must be a CPU tensor of ", op.out, " elements");
    op.bias = bias.to(torch::kFloat32).contiguous();
  }
  return op;
}

// One layer. Undefined optional norms are absent: q_norm / k_norm (per head, before rotary: Qwen3,
// Gemma 3), attn_out_norm / mlp_out_norm (on the attention / MLP output before it joins the
// residual stream: Gemma 3). post_norm is the norm before the MLP. `window` > 0: a sliding layer;
// `rope`: which of the step's rotary tables the layer rotates by. heads, kv_heads, inter: this
// layer's query heads, KV heads and MLP width (a structurally pruned model's layers differ).
struct Layer {
  torch::Tensor input_norm, post_norm;
  LinearOp qkv, o, gate_up, down;
  torch::Tensor q_norm, k_norm, attn_out_norm, mlp_out_norm;
  int64_t window = 0, rope = 0;
  int64_t heads = 0, kv_heads = 0, inter = 0;
};

// Rows private to one thread: the residual stream and what feeds the next Linear. Each thread
// computes them whole (576 floats a token: cheaper than a barrier), the same floats on every thread.
// `out` holds a normed Linear output (Gemma's post norms) where the module path norms it.
struct ThreadRows {
  std::vector<float> res, normed, act, out, qk;
  std::vector<float> lora_t, lora_u;  // an adapter's x a^T [n, rank] and its output rows [n, out]
  brisk_range::QuantizedActs acts;
};

void check_float_rows(const torch::Tensor& t, int64_t n, int64_t width, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu() && t.dim() == 2 &&
                  t.size(0) == n && t.size(1) == width,
              "brisk DecodePlan: ", what, " must be a contiguous float32 CPU [", n, ", ", width, "]");
}

}  // namespace

class DecodePlan {
 public:
  // act: the MLP's activation, 0 silu (SwiGLU), 1 gelu with tanh (GeGLU); max_rows: the most tokens
  // a step may have, up to which every Linear's module calls the kernel its op runs
  // (runtime/decode_plan.py plan_rows)
  DecodePlan(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps, int64_t act,
             int64_t max_rows)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), intermediate_(intermediate), max_rows_(max_rows),
        eps_(eps), act_(act) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0 && head_dim % 2 == 0 &&
                    intermediate > 0, "brisk DecodePlan: heads must be a multiple of kv_heads and head_dim even");
    TORCH_CHECK(act == 0 || act == 1, "brisk DecodePlan: act must be 0 (silu) or 1 (gelu tanh)");
    TORCH_CHECK(max_rows >= 1, "brisk DecodePlan: max_rows must be >= 1");
  }

  int64_t max_rows() const { return max_rows_; }

  // ops: qkv, o, gate_up, down as (kind, weight, scale, zero, bias, group, bits, tiled); the
  // optional norms (None: absent), window, rope and the widths as in `Layer` (a width < 1: the plan's).
  void add_layer(const torch::Tensor& input_norm, const torch::Tensor& post_norm, const std::vector<py::tuple>& ops,
                 const c10::optional<torch::Tensor>& q_norm, const c10::optional<torch::Tensor>& k_norm,
                 const c10::optional<torch::Tensor>& attn_out_norm, const c10::optional<torch::Tensor>& mlp_out_norm,
                 int64_t window, int64_t rope, int64_t heads, int64_t kv_heads, int64_t intermediate) {
    TORCH_CHECK(ops.size() == 4, "brisk DecodePlan: a layer needs 4 linear ops (qkv, o, gate_up, down)");
    const auto opt = [](const c10::optional<torch::Tensor>& t) { return t.has_value() ? t->contiguous() : torch::Tensor(); };
    Layer L{input_norm.contiguous(), post_norm.contiguous(), parse_linear(ops[0]), parse_linear(ops[1]),
            parse_linear(ops[2]), parse_linear(ops[3]), opt(q_norm), opt(k_norm), opt(attn_out_norm),
            opt(mlp_out_norm), window, rope, heads > 0 ? heads : heads_, kv_heads > 0 ? kv_heads : kv_heads_,
            intermediate > 0 ? intermediate : intermediate_};
    TORCH_CHECK(window >= 0 && rope >= 0, "brisk DecodePlan: window and rope must be >= 0");
    TORCH_CHECK(L.heads % L.kv_heads == 0 && L.heads / L.kv_heads <= 16,
                "brisk DecodePlan: a layer's heads must be a multiple of its kv_heads, at most 16 per KV head");
    TORCH_CHECK(L.q_norm.defined() == L.k_norm.defined(), "brisk DecodePlan: q_norm and k_norm come together");
    for (const auto& w : {L.q_norm, L.k_norm})
      TORCH_CHECK(!w.defined() || (w.scalar_type() == torch::kFloat32 && w.numel() == head_dim_ && w.device().is_cpu()),
                  "brisk DecodePlan: q/k norm weights must be float32 [", head_dim_, "]");
    const int64_t hidden = L.o.out, qkv_width = (L.heads + 2 * L.kv_heads) * head_dim_;
    TORCH_CHECK(L.qkv.out == qkv_width && L.qkv.in == hidden && L.o.in == L.heads * head_dim_ &&
                    L.gate_up.out == 2 * L.inter && L.gate_up.in == hidden && L.down.in == L.inter &&
                    L.down.out == hidden && (layers_.empty() || hidden == hidden_),
                "brisk DecodePlan: the layer's Linears do not fit the plan's shapes");
    for (const auto& w : {L.input_norm, L.post_norm, L.attn_out_norm, L.mlp_out_norm})
      TORCH_CHECK(!w.defined() || (w.scalar_type() == torch::kFloat32 && w.numel() == hidden && w.device().is_cpu()),
                  "brisk DecodePlan: norm weights must be float32 [", hidden, "]");
    TORCH_CHECK(input_norm.defined() && post_norm.defined(), "brisk DecodePlan: a layer needs its two norms");
    hidden_ = hidden;
    max_heads_ = std::max(max_heads_, L.heads), max_kv_heads_ = std::max(max_kv_heads_, L.kv_heads);
    max_inter_ = std::max(max_inter_, L.inter);
    layers_.push_back(std::move(L));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // A low-rank adapter on Linear `which` (0 qkv, 1 o, 2 gate_up, 3 down) of `layer`: its rows get
  // (x a^T) b^T added (a [rank, in], b [out, rank] float32); None, None removes it.
  void set_lora(int64_t layer, int64_t which, const c10::optional<torch::Tensor>& a,
                const c10::optional<torch::Tensor>& b) {
    TORCH_CHECK(0 <= layer && layer < num_layers() && 0 <= which && which < 4,
                "brisk DecodePlan: set_lora names layer 0..", num_layers() - 1, " and Linear 0..3");
    Layer& L = layers_[layer];
    LinearOp& op = which == 0 ? L.qkv : which == 1 ? L.o : which == 2 ? L.gate_up : L.down;
    TORCH_CHECK(a.has_value() == b.has_value(), "brisk DecodePlan: an adapter needs both a and b");
    if (!a.has_value()) {
      op.lora_a = op.lora_b = torch::Tensor();
      return;
    }
    const int64_t rank = a->dim() == 2 ? a->size(0) : 0;
    for (const auto* t : {&*a, &*b})
      TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->device().is_cpu() && t->dim() == 2,
                  "brisk DecodePlan: adapter matrices must be contiguous float32 CPU 2-D tensors");
    TORCH_CHECK(rank >= 1 && a->size(1) == op.in && b->size(0) == op.out && b->size(1) == rank,
                "brisk DecodePlan: an adapter for a ", op.out, " x ", op.in, " Linear is a [rank, ", op.in,
                "] and b [", op.out, ", rank]");
    op.lora_a = *a, op.lora_b = *b;
  }

  // Layers [start, end) on (h, residual) [n, hidden] as LlamaDecoderLayer.forward runs them;
  // caches: k0, v0, k1, v1, ... for those layers. Returns the new (h, residual).
  // slot_blocks, block_tables: one per KV group; layer_group: each layer's group (empty: one group).
  // cos, sin: one [n, head_dim] table pair per rotary base (a layer's `rope` picks its pair).
  std::tuple<torch::Tensor, torch::Tensor> run(torch::Tensor h, c10::optional<torch::Tensor> residual,
                                               const std::vector<torch::Tensor>& cos,
                                               const std::vector<torch::Tensor>& sin,
                                               const std::vector<torch::Tensor>& caches,
                                               const std::vector<torch::Tensor>& slot_blocks,
                                               const torch::Tensor& slot_offsets,
                                               const std::vector<torch::Tensor>& block_tables,
                                               const torch::Tensor& query_start, const torch::Tensor& kv_lens,
                                               double scale, int64_t start, int64_t end,
                                               const std::vector<int64_t>& layer_group) {
    TORCH_CHECK(0 <= start && start <= end && end <= num_layers(), "brisk DecodePlan: layers ", start, "..", end,
                " are not in the plan's ", num_layers());
    TORCH_CHECK(static_cast<int64_t>(caches.size()) == 2 * (end - start), "brisk DecodePlan: two caches a layer");
    if (start == end) return {h, residual.has_value() ? *residual : torch::Tensor()};
    const int64_t n = h.size(0);
    TORCH_CHECK(n >= 1 && n <= max_rows_, "brisk DecodePlan: a step of ", n, " tokens; the plan serves 1 to ", max_rows_,
                " (longer steps take the module path, whose kernels differ)");
    check_float_rows(h, n, hidden_, "h");
    if (residual.has_value()) check_float_rows(*residual, n, hidden_, "residual");
    TORCH_CHECK(!cos.empty() && cos.size() == sin.size(), "brisk DecodePlan: cos and sin come in pairs");
    for (size_t r = 0; r < cos.size(); ++r) {
      check_float_rows(cos[r], n, head_dim_, "cos");
      check_float_rows(sin[r], n, head_dim_, "sin");
    }
    for (int64_t i = start; i < end; ++i)
      TORCH_CHECK(layers_[i].rope < static_cast<int64_t>(cos.size()), "brisk DecodePlan: layer ", i, " rotates by table ",
                  layers_[i].rope, " of ", cos.size());
    // k caches [blocks, kv_heads, head_dim, block_size], v caches [blocks, kv_heads, block_size, head_dim]
    const int64_t block_size = caches[0].dim() == 4 ? caches[0].size(3) : 0;
    for (size_t c = 0; c < caches.size(); ++c) {
      const int64_t kv = layers_[start + static_cast<int64_t>(c / 2)].kv_heads;
      const std::vector<int64_t> k_shape{caches[0].size(0), kv, head_dim_, block_size},
          v_shape{caches[0].size(0), kv, block_size, head_dim_};
      TORCH_CHECK(caches[c].scalar_type() == torch::kFloat32 && caches[c].is_contiguous() && caches[c].device().is_cpu() &&
                      caches[c].sizes() == (c % 2 ? v_shape : k_shape),
                  "brisk DecodePlan: k and v caches must be contiguous float32 CPU ", at::IntArrayRef(k_shape), " and ",
                  at::IntArrayRef(v_shape));
    }
    const int64_t groups = static_cast<int64_t>(slot_blocks.size());
    TORCH_CHECK(groups >= 1 && block_tables.size() == slot_blocks.size(),
                "brisk DecodePlan: one slot_blocks and one block_tables per KV group");
    TORCH_CHECK(layer_group.empty() || static_cast<int64_t>(layer_group.size()) == num_layers(),
                "brisk DecodePlan: layer_group names every layer's KV group");
    std::vector<const int64_t*> blocks;
    for (const auto& b : slot_blocks) {
      brisk_range::check_slots(b, slot_offsets, n, caches[0].size(0), block_size, "DecodePlan");
      blocks.push_back(b.data_ptr<int64_t>());
    }
    const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
    const int threads = at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads());
    // one attention map per distinct (KV group, window, heads) of these layers
    std::vector<brisk_range::AttentionStep> attn_steps;
    std::vector<std::tuple<int64_t, int64_t, int64_t>> keys;
    std::vector<size_t> attn_of(end - start), group_of(end - start);
    for (int64_t i = start; i < end; ++i) {
      const int64_t g = layer_group.empty() ? 0 : layer_group[i];
      TORCH_CHECK(0 <= g && g < groups, "brisk DecodePlan: layer ", i, " is in KV group ", g, " of ", groups);
      group_of[i - start] = static_cast<size_t>(g);
      const std::tuple<int64_t, int64_t, int64_t> key{g, layers_[i].window, layers_[i].heads};
      const auto at = std::find(keys.begin(), keys.end(), key);
      attn_of[i - start] = at - keys.begin();
      if (at != keys.end()) continue;
      keys.push_back(key);
      attn_steps.push_back(brisk_range::attention_step(layers_[i].heads, layers_[i].kv_heads, head_dim_, block_size,
                                                       block_tables[g],
                                                       query_start, kv_lens, scale, n, threads, layers_[i].window));
    }
    std::vector<const float*> cos_p, sin_p;
    for (size_t r = 0; r < cos.size(); ++r) cos_p.push_back(cos[r].data_ptr<float>()), sin_p.push_back(sin[r].data_ptr<float>());

    Step step{n, h.data_ptr<float>(), residual.has_value() ? residual->data_ptr<float>() : nullptr,
              cos_p, sin_p, &caches, blocks, offsets, &attn_steps, attn_of, group_of, start, end};
    step.shared(hidden_, max_heads_, max_kv_heads_, head_dim_, max_inter_);
    std::vector<ThreadRows> rows(threads);
    {
      py::gil_scoped_release no_gil;  // pure C++ from here: let other Python threads (the server) run
      if (threads == 1) {
        layers(step, rows[0], 0, 1);
      } else {
#pragma omp parallel num_threads(threads)
        {
          const int team = omp_get_num_threads(), tid = omp_get_thread_num();
#pragma omp single
          step.barrier.reset(team);  // the implicit barrier after `single` publishes it
          layers(step, rows[tid], tid, team);
        }
      }
    }
    auto h_out = torch::empty({n, hidden_}, h.options()), res_out = torch::empty({n, hidden_}, h.options());
    const std::vector<float>& last = layers_[end - 1].mlp_out_norm.defined() ? rows[0].out : step.h;
    std::copy(last.begin(), last.begin() + n * hidden_, h_out.data_ptr<float>());
    std::copy(rows[0].res.begin(), rows[0].res.end(), res_out.data_ptr<float>());
    return {h_out, res_out};
  }

 private:
  // One step's inputs and the rows the threads share (each Linear's output, written by slices).
  struct Step {
    int64_t n;
    const float *h_in, *res_in;
    std::vector<const float*> cos, sin;  // per rotary table
    const std::vector<torch::Tensor>* caches;
    std::vector<const int64_t*> slot_blocks;  // per KV group
    const int64_t* slot_offsets;
    const std::vector<brisk_range::AttentionStep>* attn;  // per distinct (group, window)
    std::vector<size_t> attn_of;                           // layer - start -> its entry in attn
    std::vector<size_t> group_of;                          // layer - start -> its KV group
    int64_t start, end;
    std::vector<float> h, qkv, q, k, attn_out, gate_up;
    SpinBarrier barrier;  // per step: two threads stepping one plan at once stay apart
    void shared(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter) {
      h.assign(h_in, h_in + n * hidden);
      qkv.resize(n * (heads + 2 * kv_heads) * head_dim), q.resize(n * heads * head_dim);
      k.resize(n * kv_heads * head_dim), attn_out.resize(n * heads * head_dim), gate_up.resize(n * 2 * inter);
    }
  };

  // res = h + res (or h, on the first layer without a residual), normed = rms_norm(res, w): the
  // floats of the module path's residual add (torch's add) and rms_norm.
  void add_norm(const float* h, ThreadRows& me, const torch::Tensor& w, int64_t n, bool add) const {
    const int64_t total = n * hidden_;
    for (int64_t i = 0; i < total; ++i) me.res[i] = add ? h[i] + me.res[i] : h[i];
    for (int64_t r = 0; r < n; ++r)
      brisk_range::rms_norm_row(me.res.data() + r * hidden_, w.data_ptr<float>(), me.normed.data() + r * hidden_,
                                hidden_, static_cast<float>(eps_));
  }

  void linear(const LinearOp& op, const float* x, int64_t n, float* y, ThreadRows& me, int tid, int team) const {
    const auto [r0, r1] = op.slice(tid, team);
    op.rows(x, n, y, r0, r1, me.acts);
    if (op.lora_a.defined() && r0 < r1) add_lora(op, x, n, y, r0, r1, me);
  }

  // y's rows [r0, r1) += (x a^T) b^T: each thread forms x a^T whole (rank x in per token: cheaper
  // than a barrier), then its own output rows.
  static void add_lora(const LinearOp& op, const float* x, int64_t n, float* y, int64_t r0, int64_t r1,
                       ThreadRows& me) {
    const int64_t rank = op.lora_a.size(0), out = op.out;
    me.lora_t.resize(n * rank), me.lora_u.resize(n * out);
    brisk_range::float_rows(op.lora_a.data_ptr<float>(), x, me.lora_t.data(), n, rank, op.in, 0, rank);
    brisk_range::float_rows(op.lora_b.data_ptr<float>(), me.lora_t.data(), me.lora_u.data(), n, out, rank, r0, r1);
    for (int64_t k = 0; k < n; ++k)
      for (int64_t r = r0; r < r1; ++r) y[k * out + r] += me.lora_u[k * out + r];
  }

  // The layer loop as every thread of the team runs it: the Linears' rows, attention's items and
  // the tokens' rotation and KV stores split between the threads, the small row-wise steps done by
  // each thread for itself, a barrier wherever a step reads what all wrote.
  void layers(Step& s, ThreadRows& me, int tid, int team) {
    const int64_t n = s.n;
    me.res.resize(n * hidden_), me.normed.resize(n * hidden_), me.act.resize(n * max_inter_);
    me.out.resize(n * hidden_), me.qk.resize((max_heads_ + max_kv_heads_) * head_dim_);
    if (s.res_in) std::copy(s.res_in, s.res_in + n * hidden_, me.res.begin());
    bool add = s.res_in != nullptr;
    const float* h_in = s.h.data();  // the previous layer's output rows (Gemma: normed, this thread's)
    for (int64_t i = s.start; i < s.end; ++i) {
      const Layer& L = layers_[i];
      const brisk_range::AttentionStep& attn = (*s.attn)[s.attn_of[i - s.start]];
      const int64_t w0 = attn.items * tid / team, w1 = attn.items * (tid + 1) / team;
      float* k_cache = (*s.caches)[2 * (i - s.start)].data_ptr<float>();
      float* v_cache = (*s.caches)[2 * (i - s.start) + 1].data_ptr<float>();
      add_norm(h_in, me, L.input_norm, n, add);
      add = true;
      linear(L.qkv, me.normed.data(), n, s.qkv.data(), me, tid, team);
      s.barrier.wait();
      rotate_and_store(s, me, L, attn.block_size, k_cache, v_cache, s.slot_blocks[s.group_of[i - s.start]],
                       n * tid / team, n * (tid + 1) / team);
      s.barrier.wait();
      brisk_range::attention_items(attn, s.q.data(), s.attn_out.data(), k_cache, v_cache, w0, w1);
      s.barrier.wait();
      linear(L.o, s.attn_out.data(), n, s.h.data(), me, tid, team);
      s.barrier.wait();
      add_norm(out_norm(s.h.data(), L.attn_out_norm, me, n), me, L.post_norm, n, true);
      linear(L.gate_up, me.normed.data(), n, s.gate_up.data(), me, tid, team);
      s.barrier.wait();
      for (int64_t r = 0; r < n; ++r) {
        const float* gu = s.gate_up.data() + r * 2 * L.inter;
        float* y = me.act.data() + r * L.inter;
        if (act_ == 0) brisk_range::silu_mul_row(gu, gu + L.inter, y, L.inter);
        else brisk_range::gelu_tanh_mul_row(gu, gu + L.inter, y, L.inter);
      }
      linear(L.down, me.act.data(), n, s.h.data(), me, tid, team);
      s.barrier.wait();
      h_in = out_norm(s.h.data(), L.mlp_out_norm, me, n);
    }
  }

  // rms_norm of a Linear's output rows into this thread's `out` (Gemma's post norms); the rows
  // themselves where the layer has no such norm.
  const float* out_norm(const float* y, const torch::Tensor& w, ThreadRows& me, int64_t n) const {
    if (!w.defined()) return y;
    for (int64_t r = 0; r < n; ++r)
      brisk_range::rms_norm_row(y + r * hidden_, w.data_ptr<float>(), me.out.data() + r * hidden_, hidden_,
                                static_cast<float>(eps_));
    return me.out.data();
  }

  // Tokens [t0, t1)'s q and k heads (RMS-normed first where the layer has QK norm: rms_norm's
  // floats) rotated by the layer's table (rotary()'s floats), and their new keys and values into
  // their slots (each token its own: the threads split the tokens).
  void rotate_and_store(Step& s, ThreadRows& me, const Layer& L, int64_t block_size, float* k_cache,
                        float* v_cache, const int64_t* slot_blocks, int64_t t0, int64_t t1) const {
    const int64_t heads = L.heads, kv_heads = L.kv_heads;
    const int64_t rotated = heads + kv_heads, qkv_width = (rotated + kv_heads) * head_dim_;
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = s.qkv.data() + t * qkv_width;
      if (L.q_norm.defined()) {
        for (int64_t hd = 0; hd < rotated; ++hd)
          brisk_range::rms_norm_row(row + hd * head_dim_, (hd < heads ? L.q_norm : L.k_norm).data_ptr<float>(),
                                    me.qk.data() + hd * head_dim_, head_dim_, static_cast<float>(eps_));
      }
      const float* qk = L.q_norm.defined() ? me.qk.data() : row;
      const float *c = s.cos[L.rope] + t * head_dim_, *sn = s.sin[L.rope] + t * head_dim_;
      brisk_range::rotate_heads(qk, c, sn, s.q.data() + t * heads * head_dim_, heads, head_dim_);
      float* k = s.k.data() + t * kv_heads * head_dim_;
      brisk_range::rotate_heads(qk + heads * head_dim_, c, sn, k, kv_heads, head_dim_);
      brisk_range::kv_store_row(k_cache, v_cache, kv_heads, head_dim_, block_size, k, row + rotated * head_dim_,
                                slot_blocks[t], s.slot_offsets[t]);
    }
  }

  int64_t heads_, kv_heads_, head_dim_, intermediate_, max_rows_, hidden_ = 0;
  int64_t max_heads_ = 0, max_kv_heads_ = 0, max_inter_ = 0;  // over the layers: the step buffers' sizes
  double eps_;
  int64_t act_;
  std::vector<Layer> layers_;
};

void bind_decode_plan(py::module& m) {
  py::class_<DecodePlan>(m, "DecodePlan", "a decoder layer stack's decode steps in C++ (runtime/decode_plan.py)")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, int64_t, int64_t>(), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"), py::arg("eps"), py::arg("act") = 0,
           py::arg("max_rows") = 8)
      .def("max_rows", &DecodePlan::max_rows)
      .def("add_layer", &DecodePlan::add_layer, py::arg("input_norm"), py::arg("post_norm"), py::arg("ops"),
           py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(), py::arg("attn_out_norm") = py::none(),
           py::arg("mlp_out_norm") = py::none(), py::arg("window") = 0, py::arg("rope") = 0, py::arg("heads") = 0,
           py::arg("kv_heads") = 0, py::arg("intermediate") = 0)
      .def("num_layers", &DecodePlan::num_layers)
      .def("set_lora", &DecodePlan::set_lora, py::arg("layer"), py::arg("which"), py::arg("a") = py::none(),
           py::arg("b") = py::none())
      .def("run", &DecodePlan::run, py::arg("h"), py::arg("residual"), py::arg("cos"), py::arg("sin"),
           py::arg("caches"), py::arg("slot_blocks"), py::arg("slot_offsets"), py::arg("block_tables"),
           py::arg("query_start"), py::arg("kv_lens"), py::arg("scale"), py::arg("start"), py::arg("end"),
           py::arg("layer_group") = std::vector<int64_t>{});
}
