// A step's decoder layers in one native call: for every layer, add+RMSNorm, the QKV projection, rotary, the
// K/V write, paged decode attention, the output projection, add+RMSNorm, gate/up, SiLU * up and down, then the final
// norm, calling the same kernels the Python layers call, in the same order, on the same tensors; decode rows attend
// in paged_decode, prefill chunks in prefill_attention.
//
// Why: at one request a decode step spent ~4.5-5 ms of its 12-16 ms in Python between the kernels (module calls,
// views, checks, about 15 ops per layer over 30 layers) on a 2-core CPU. Here the layers run without the interpreter,
// and without holding the GIL, so a server's event loop keeps running during the step.
//
// Only what the kernels cover is built here (llmserve/models/decoder_stack.py decides): bf16, fp32 or int8 packed
// linears, no per-head q/k norm, a cache paged_decode reads (and prefill_attention, for steps with prefill chunks).

#include <torch/extension.h>
#include <pybind11/stl.h>

#include "kernels.h"

#include <array>
#include <chrono>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// One projection: bf16 weights in bf16_pack's layout (bf16_gemm), fp32 in fp32_pack's (fp32_gemm), or int8 in
// w8a8_pack's, with int8 activations (w8a8_linear, given the weight's row sums) or weight-only (int8w_gemm), or
// block-quantized (qblock_linear).
struct StackLinear {
  std::optional<QBlockWeight> blocks;
  torch::Tensor packed;
  int64_t n = 0;
  torch::Tensor scale;                // int8 weights
  c10::optional<torch::Tensor> wsum;  // w8a8
  c10::optional<torch::Tensor> bias;  // fp32
  int64_t path = 0;  // bf16 weights: bf16_gemm's path argument (the measured kernel, llmserve/kernels/choice.py)
  // On the amx path (2), batches of at most few_rows rows run qblock_linear_amx_dot over these blocks (`blocks`
  // where the layer runs on them): the tiles' bits, reading the blocks' bytes (the measured threshold; 0: never).
  std::optional<QBlockWeight> few;
  int64_t few_rows = 0;
  int64_t amx_rows = -1;  // int8 weights: w8a8_linear's or int8w_gemm's amx_rows (from how many rows AMX-INT8 tiles
                          // run: the measured threshold)

  const QBlockWeight* few_blocks(const torch::Tensor& x) const {
    if (path != 2 || x.size(0) > few_rows || x.scalar_type() != at::kBFloat16) return nullptr;
    return few.has_value() ? &*few : blocks.has_value() ? &*blocks : nullptr;
  }

  // silu(gate) * up of this gate/up projection: fused into the GEMM's epilogue on the amx paths (the same bits as
  // the two calls; at a 2,000-token prefill the separate op re-read the 12 MB gate/up output from beyond L2, ~1.5-2
  // ms a layer), else the GEMM then silu_mul.
  torch::Tensor glu(const torch::Tensor& x) const {
    if (path == 2 && n % 32 == 0 && (blocks.has_value() || packed.scalar_type() == at::kBFloat16) &&
        x.scalar_type() == at::kBFloat16) {
      if (const QBlockWeight* f = few_blocks(x)) return qblock_linear_amx_dot(x, *f, bias, true);
      return blocks.has_value() ? qblock_linear_amx(x, *blocks, bias, true) : bf16_gemm(x, packed, n, bias, 2, true);
    }
    return silu_mul((*this)(x));
  }

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (const QBlockWeight* f = few_blocks(x)) return qblock_linear_amx_dot(x, *f, bias);
    if (blocks.has_value()) return path == 2 ? qblock_linear_amx(x, *blocks, bias) : qblock_linear(x, *blocks, bias, -1);
    if (packed.scalar_type() == at::kFloat) return fp32_gemm(x, packed, n, bias);
    if (packed.scalar_type() != at::kChar) return bf16_gemm(x, packed, n, bias, path);
    return wsum.has_value() ? w8a8_linear(x, packed, scale, *wsum, bias, amx_rows) : int8w_gemm(x, packed, scale, bias, -1, amx_rows);
  }
};

struct StackLayer {
  torch::Tensor input_norm, post_norm;
  StackLinear qkv, o, gate_up, down;
  c10::optional<torch::Tensor> q_norm, k_norm;   // Qwen3: RMSNorm over head_dim on q and k, before rotary
  torch::Tensor k_cache, v_cache;                // [num_blocks, block_size, kv_heads, head_dim]
  c10::optional<torch::Tensor> k_scales, v_scales;  // int8 caches; int4's (scale, zero) pairs
  int64_t window = -1;                           // <= 0: none
};

// Phases timed when profiling is on, as `bench throughput --profile-steps` names them.
enum Phase { kLinear, kDecodeAttention, kAttention, kOther, kPhases };

class DecoderStack {
 public:
  DecoderStack(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps, double scale)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), intermediate_(intermediate), eps_(eps),
        scale_(scale) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0 && head_dim % 2 == 0,
                "DecoderStack: heads must be a multiple of kv_heads, head_dim even");
  }

  // A linear's arguments: packed weight, outputs, scale (int8) or None, wsum (w8a8) or None, bias or None, path, and
  // optionally the amx path's few-rows blocks (a QBlockWeight, or None for the layer's own) and their row count.
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, const std::vector<py::object>& qkv,
                 const std::vector<py::object>& o, const std::vector<py::object>& gate_up,
                 const std::vector<py::object>& down, c10::optional<torch::Tensor> q_norm,
                 c10::optional<torch::Tensor> k_norm, torch::Tensor k_cache, torch::Tensor v_cache,
                 c10::optional<torch::Tensor> k_scales, c10::optional<torch::Tensor> v_scales, int64_t window) {
    const int64_t qkv_n = (heads_ + 2 * kv_heads_) * head_dim_;
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "DecoderStack: q_norm and k_norm come together");
    StackLayer layer{input_norm, post_norm, linear(qkv, qkv_n, "qkv"), linear(o, -1, "o"),
                     linear(gate_up, 2 * intermediate_, "gate_up"), linear(down, -1, "down"), q_norm, k_norm,
                     k_cache, v_cache, k_scales, v_scales, window};
    const bool int4 = k_cache.scalar_type() == at::kByte;  // packed: head_dim / 2 bytes a row
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == kv_heads_ &&
                    k_cache.size(3) == (int4 ? head_dim_ / 2 : head_dim_),
                "DecoderStack: cache [num_blocks, block_size, kv_heads, head_dim] (int4: head_dim / 2 bytes)");
    TORCH_CHECK(k_scales.has_value() == (k_cache.scalar_type() == at::kChar || int4),
                "DecoderStack: scales with int8 and int4 caches");
    layers_.push_back(std::move(layer));
  }

  // x: [T, E] the step's embedded tokens, the num_decodes decodes (one token per request) first; cos/sin
  // [T, head_dim / 2] in x's dtype; slots [T]: where each token's K/V goes. Decodes: tables [nd, max_blocks] and
  // lens [nd] (paged_decode's); prefill chunks: spans [S, 4] and their context slots (prefill_attention's). Returns
  // final_norm(the last layer's output + residual), [T, E]. prefill_path, decode_dot: prefill_attention's path (0
  // fp32, 1 dot, 2 amx) and paged_decode's dot (the step's measured choices).
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots, int64_t num_decodes,
                        c10::optional<torch::Tensor> tables, c10::optional<torch::Tensor> lens,
                        c10::optional<torch::Tensor> spans, c10::optional<torch::Tensor> span_slots,
                        torch::Tensor final_norm, int64_t prefill_path, int64_t decode_dot) {
    TORCH_CHECK(!layers_.empty(), "DecoderStack: no layers");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "DecoderStack: x must be contiguous [T, E]");
    const int64_t T = x.size(0), H = heads_, KVH = kv_heads_, D = head_dim_, nd = num_decodes;
    TORCH_CHECK(nd >= 0 && nd <= T, "DecoderStack: num_decodes outside [0, T]");
    TORCH_CHECK(nd == 0 || (tables.has_value() && lens.has_value()), "DecoderStack: decodes need tables and lens");
    TORCH_CHECK(nd == T || (spans.has_value() && span_slots.has_value()), "DecoderStack: prefills need spans and slots");
    // Layer 0 has no residual yet: the residual is x itself, normalised without an add.
    torch::Tensor residual = x, h;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& l = layers_[i];
      timed(kOther, [&] {
        if (i == 0)
          h = rms_norm(x, l.input_norm);
        else
          add_rms_norm_(h, residual, l.input_norm, eps_);
      });
      // Each intermediate is freed as soon as the next one is made (the scopes below), as the Python layers' are: at a
      // 2,048-token chunk, gate/up alone is 12.6 MB of SmolLM2 in bf16 (kept to the end of the layer, peak RSS was +37 MB).
      torch::Tensor attn;
      {
        const torch::Tensor qkv = timed(kLinear, [&] { return l.qkv(h); });  // [T, (H + 2 KVH) D]
        torch::Tensor q = qkv.narrow(1, 0, H * D).view({T, H, D}), k = qkv.narrow(1, H * D, KVH * D).view({T, KVH, D});
        const torch::Tensor v = qkv.narrow(1, (H + KVH) * D, KVH * D).view({T, KVH, D});
        timed(kOther, [&] {
          if (l.q_norm.has_value()) {  // per head, into new tensors, each rotated on its own (as LlamaAttention)
            q = rms_norm(q, *l.q_norm);
            k = rms_norm(k, *l.k_norm);
            rotary_(q, cos, sin);
            rotary_(k, cos, sin);
          } else {  // q and k are adjacent in qkv: rotate both heads at once
            rotary_(qkv.narrow(1, 0, (H + KVH) * D).view({T, H + KVH, D}), cos, sin);
          }
        });
        timed(kAttention, [&] {
          if (l.k_cache.scalar_type() == at::kByte)
            write_kv_int4(k, v, l.k_cache, l.v_cache, *l.k_scales, *l.v_scales, slots);
          else if (l.k_scales.has_value())
            write_kv_int8(k, v, l.k_cache, l.v_cache, *l.k_scales, *l.v_scales, slots);
          else
            write_kv(k, v, l.k_cache, l.v_cache, slots);
        });
        // as torch_backend.paged_attention: the decodes' rows from paged_decode, the prefills' from prefill_attention
        if (nd > 0) {
          attn = timed(kDecodeAttention, [&] {
            return paged_decode(q.narrow(0, 0, nd), l.k_cache, l.v_cache, *tables, *lens, scale_, l.window, l.k_scales,
                                l.v_scales, -1, decode_dot);
          });
        }
        if (nd < T) {
          timed(kAttention, [&] {
            torch::Tensor out = torch::empty({T, H, D}, x.options());
            if (nd > 0) out.narrow(0, 0, nd).copy_(attn);
            prefill_attention(q, k, v, l.k_cache, l.v_cache, l.k_scales, l.v_scales, *spans, *span_slots, scale_,
                              l.window, out, prefill_path);
            attn = out;
          });
        }
      }
      h = timed(kLinear, [&] { return l.o(attn.view({T, H * D})); });
      attn.reset();
      timed(kOther, [&] { add_rms_norm_(h, residual, l.post_norm, eps_); });
      const torch::Tensor act = timed(kLinear, [&] { return l.gate_up.glu(h); });  // silu(gate) * up, [T, I]
      h = timed(kLinear, [&] { return l.down(act); });
    }
    timed(kOther, [&] { add_rms_norm_(h, residual, final_norm, eps_); });
    return h;
  }

  void set_profiling(bool on) { profiling_ = on; }

  // Seconds per phase since the last call (linear, decode attention, attention, other), then zeroed.
  std::vector<double> take_profile() {
    std::vector<double> out(seconds_.begin(), seconds_.end());
    seconds_.fill(0.0);
    return out;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  // RMSNorm over the last dimension without a residual, as the Python layer (RMSNorm._norm: normalised in fp32,
  // rounded to x's dtype, times the weight), so the two paths give the same bits.
  torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight) const {
    return at::mul(weight, at::rms_norm(x.to(at::kFloat), {x.size(-1)}, c10::nullopt, eps_).to(x.scalar_type()));
  }

  StackLinear linear(const std::vector<py::object>& args, int64_t expected_n, const char* what) const {
    TORCH_CHECK(args.size() == 6 || args.size() == 8 || args.size() == 9,
                "DecoderStack: a linear is (packed, n, scale, wsum, bias, path[, few blocks, few rows[, w8a8 amx "
                "rows]])");
    StackLinear l;
    l.n = args[1].cast<int64_t>();
    l.path = args[5].cast<int64_t>();
    if (args.size() == 9) l.amx_rows = args[8].cast<int64_t>();
    if (args.size() >= 8) {
      if (!args[6].is_none()) l.few = args[6].cast<QBlockWeight>();
      l.few_rows = args[7].cast<int64_t>();
      TORCH_CHECK(l.few_rows == 0 || (l.path == 2 && qblock_amx_dot_supported()),
                  "DecoderStack: ", what, ": few-row blocks need the amx path and qblock_amx_dot_supported()");
    }
    TORCH_CHECK(l.path != 1 || bf16_dot_supported(), "DecoderStack: ", what, " asks for dot products this CPU lacks");
    TORCH_CHECK(l.path != 2 || amx_bf16_supported(), "DecoderStack: ", what, " asks for AMX tiles this CPU lacks");
    if (py::isinstance<QBlockWeight>(args[0])) {  // (QBlockWeight, n, None, None, bias, 0 or 2: AMX tiles)
      l.blocks = args[0].cast<QBlockWeight>();
      TORCH_CHECK(expected_n < 0 || l.n == expected_n, "DecoderStack: ", what, " has ", l.n, " outputs, expected ",
                  expected_n);
      if (!args[4].is_none()) l.bias = args[4].cast<torch::Tensor>().to(at::kFloat).contiguous();
      TORCH_CHECK(l.path == 0 || l.path == 2, "DecoderStack: ", what, ": blocks take path 0 (int8) or 2 (AMX)");
      return l;
    }
    l.packed = args[0].cast<torch::Tensor>();
    TORCH_CHECK(expected_n < 0 || l.n == expected_n, "DecoderStack: ", what, " has ", l.n, " outputs, expected ",
                expected_n);
    TORCH_CHECK(l.packed.scalar_type() == at::kChar || l.packed.scalar_type() == at::kBFloat16 ||
                    l.packed.scalar_type() == at::kFloat,
                "DecoderStack: ", what, " must be bf16_pack'ed, fp32_pack'ed or w8a8_pack'ed");
    TORCH_CHECK(l.packed.scalar_type() != at::kFloat || (l.path == 0 && fp32_gemm_supported()),
                "DecoderStack: fp32 ", what, " takes path 0 on a CPU with AVX2 and FMA");
    if (l.packed.scalar_type() == at::kChar) {
      TORCH_CHECK(!args[2].is_none(), "DecoderStack: int8 ", what, " needs its scale");
      l.scale = args[2].cast<torch::Tensor>();
      if (!args[3].is_none()) l.wsum = args[3].cast<torch::Tensor>();
    }
    if (!args[4].is_none()) l.bias = args[4].cast<torch::Tensor>().to(at::kFloat).contiguous();
    return l;
  }

  template <typename F>
  std::invoke_result_t<const F&> timed(Phase phase, const F& f) {
    if (!profiling_) return f();
    const auto start = std::chrono::steady_clock::now();
    struct Stop {  // adds the elapsed time however f leaves (a return value or an exception)
      DecoderStack* self;
      Phase phase;
      std::chrono::steady_clock::time_point start;
      ~Stop() {
        self->seconds_[phase] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      }
    } stop{this, phase, start};
    return f();
  }

  int64_t heads_, kv_heads_, head_dim_, intermediate_;
  double eps_, scale_;
  std::vector<StackLayer> layers_;
  bool profiling_ = false;
  std::array<double, kPhases> seconds_{};
};

}  // namespace

void bind_decoder_stack(pybind11::module_& m) {
  py::class_<DecoderStack>(m, "DecoderStack", "a step's decoder layers in one call (decoder_stack.cpp)")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, double>(), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("intermediate"), py::arg("eps"), py::arg("scale"))
      .def("add_layer", &DecoderStack::add_layer)
      .def("forward", &DecoderStack::forward, py::call_guard<py::gil_scoped_release>())
      .def("set_profiling", &DecoderStack::set_profiling)
      .def("take_profile", &DecoderStack::take_profile)
      .def_property_readonly("num_layers", &DecoderStack::num_layers);
}
