// The extension's Python module: every file's entry points (declared in kernels.h), bound in one place. Only this file
// and decoder_stack.cpp (which takes Python objects) include <torch/extension.h>: its pybind11 and libtorch headers
// cost ~30 s of compiler time a file (2-core AMD EPYC Zen 4), against ~8 s for the ATen headers the kernels use, and
// a first start compiles every file.

#include <torch/extension.h>

#include "kernels.h"
#include "work_queue.h"

#include <chrono>

// The work queue's hand-out, for its tests: [total, 3] int64, per unit (the thread that ran it, its place in that
// thread's order, the unit WorkCursor::upcoming named while it ran). Each unit spins `spin_us` so the threads meet.
static at::Tensor work_queue_trace(int64_t total, int64_t run, int64_t spin_us) {
  auto out = at::full({total, 3}, -2, at::kLong);
  auto* o = out.data_ptr<int64_t>();
  std::atomic<int64_t> thread_ids{0};
  parallel_units(total, run, [&](WorkCursor& c) {
    const int64_t me = thread_ids.fetch_add(1);
    for (int64_t k = 0; c.valid(); c.advance(), ++k) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
      while (std::chrono::steady_clock::now() < until) {
      }
      int64_t* row = o + 3 * c.unit();
      row[0] = me;
      row[1] = k;
      row[2] = c.upcoming();
    }
  });
  return out;
}

// decoder_stack.cpp
void bind_decoder_stack(py::module_& m);

static void bind_qblocks(py::module_& m) {
  m.def("qblock_pack", &qblock_pack, "uint8 codes [n, k] (4, 5, 6 or 8 bits) -> qblock_linear's packed layout",
        py::arg("codes"), py::arg("bits"));
  m.def("gguf_nibbles", &gguf_nibbles, "the nibbles of GGUF Q4_0/Q4_1 blocks as one code per byte", py::arg("raw"),
        py::arg("offset"), py::arg("size"));
  py::class_<QBlockWeight>(m, "QBlockWeight", "a block-quantized weight in qblock_gemm.cpp's layout")
      .def(py::init<torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>, int64_t, int64_t, int64_t, int64_t,
                    int64_t>(),
           py::arg("codes"), py::arg("scales"), py::arg("mins"), py::arg("n"), py::arg("k"), py::arg("bits"),
           py::arg("group"), py::arg("zero"))
      .def_readwrite("amx8_rows", &QBlockWeight::amx8_rows,
                     "from this many rows qblock_linear's int8 activations run on AMX-INT8 tiles (the same bits)")
      .def_readwrite("wide_rows", &QBlockWeight::wide_rows,
                     "from this many rows qblock_linear's VNNI kernel widens a work unit's codes once (the same bits)")
      .def_readwrite("fma", &QBlockWeight::fma,
                     "qblock_linear's auto path runs fp32 FMAs on the codes, not int8 activations (measured)");
  m.def("qblock_linear", &qblock_linear, "x @ W^T (+ bias) over a QBlockWeight (CPU, AVX-512 or AVX2; int8 activations "
        "per block of 32)", py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("vnni") = -1);
  m.def("qblock_linear_amx", &qblock_linear_amx, "x @ W^T (+ bias) over a QBlockWeight on AMX tiles, its tiles "
        "dequantized to bf16 as they are read (bf16 x; AMX-BF16); glu: silu(gate) * up of a gate/up weight",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("glu") = false);
  m.def("qblock_linear_amx_dot", &qblock_linear_amx_dot, "qblock_linear_amx's result, bit for bit, by dot products "
        "over the blocks (for a few rows; AVX512-BF16 and VBMI)", py::arg("x"), py::arg("weight"),
        py::arg("bias") = py::none(), py::arg("glu") = false);
  m.def("qblock_amx_dot_supported", &qblock_amx_dot_supported, "whether qblock_linear_amx_dot runs here");
  m.def("qblock_dequantize_bf16", &qblock_dequantize_bf16, "a QBlockWeight dequantized to bf16 in bf16_pack's layout "
        "(AVX512-BF16)", py::arg("weight"));
  m.def("qblock_rows", &qblock_rows, "fp32 rows [R, K] of a QBlockWeight, exactly the format's values (AVX-512 or AVX2)",
        py::arg("weight"), py::arg("ids"));
  m.def("qblock_linear_supported", &qblock_linear_supported, "whether qblock_linear runs here (AVX-512, or AVX2)");
  m.def("qblock_fma_supported", &qblock_fma_supported,
        "whether qblock_linear's fp32-FMA path (vnni=0) runs here (AVX-512, or AVX2 and FMA)");
  m.def("qblock_avx2_supported", &qblock_avx2_supported, "whether qblock_linear's AVX2 kernel (vnni=3) runs here");
  m.def("qblock_vnni_supported", &qblock_vnni_supported, "whether qblock_linear's int8 path runs here (AVX512-VNNI)");
  m.def("qblock_amx8_supported", &amx_int8_supported, "whether qblock_linear's int8 path runs batches on AMX-INT8 "
        "tiles here");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged decode attention reading K/V in place (CPU)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("lens"), py::arg("scale"),
        py::arg("window"), py::arg("k_scales") = py::none(), py::arg("v_scales") = py::none(),
        py::arg("splits") = -1, py::arg("dot") = 0);
  m.def("decode_splits", &decode_splits, "parts paged_decode splits each context into, for items (request, kv_head) "
        "pairs and the longest context, at this thread count", py::arg("items"), py::arg("max_context"));
  m.def("int8_kv_decode_supported", &int8_kv_decode_supported, "whether paged_decode reads int8 caches here");
  m.def("write_kv_int8", &write_kv_int8, "quantize K/V rows to int8 (one scale per token and head) into the cache");
  m.def("write_kv_int4", &write_kv_int4, "quantize K/V rows to packed int4 (an fp16 scale and zero point per token "
        "and head) into the cache");
  m.def("write_kv", &write_kv, "copy K/V rows into a 16- or 32-bit cache at their slots (converted as .to())");
  m.def("rotary_", &rotary_, "Rotary embedding in place on [T, heads, D] (CPU)");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = weight * rms_norm(residual), in place (CPU)");
  m.def("silu_mul", &silu_mul, "[T, 2 I] (gate, up) -> silu(gate) * up, [T, I] (CPU)");
  m.def("w8a8_linear_supported", &w8a8_linear_supported, "whether this CPU runs w8a8_linear (AVX-512 with VNNI)");
  m.def("prefill_attention_supported", &prefill_attention_supported,
        "whether prefill_attention runs here (AVX-512, or AVX2 and FMA: fp32 FMAs, float caches)");
  m.def("prefill_attention_quantized_supported", &prefill_attention_quantized_supported,
        "whether prefill_attention reads an int8 or int4 cache here (AVX-512)");
  m.def("prefill_attention", &prefill_attention, "causal prefill attention of every span of a step (CPU, AVX-512)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scales"),
        py::arg("v_scales"), py::arg("spans"), py::arg("slots"), py::arg("scale"), py::arg("window"), py::arg("out"),
        py::arg("dot") = 0);
  m.def("packed_gemm_supported", &packed_gemm_supported, "whether bf16_gemm and int8w_gemm run here (AVX-512)");
  m.def("bf16_pack", &bf16_pack, "bf16 [N, K] weight -> the block layout bf16_gemm reads");
  m.def("bf16_gemm", &bf16_gemm, "x @ W^T (+ bias), bf16 weights packed: fp32 FMAs (path=0, AVX-512), vdpbf16ps "
        "(path=1, AVX512-BF16) or AMX tiles (path=2, AMX-BF16) (CPU)", py::arg("x"), py::arg("packed"), py::arg("n"),
        py::arg("bias") = py::none(), py::arg("path") = 0, py::arg("glu") = false);
  m.def("bf16_dot_supported", &bf16_dot_supported, "whether bf16_gemm's path=1 runs here (AVX512-BF16)");
  m.def("amx_bf16_supported", &amx_bf16_supported, "whether bf16_gemm's path=2 runs here (AMX-BF16, granted by the OS)");
  m.def("int8w_gemm", &int8w_gemm, "x @ (W * scale)^T (+ bias), int8 weights packed by w8a8_pack: x in int16 per row "
        "(vpdpwssd, or AMX-INT8 tiles from amx_rows rows, or vpmaddwd on AVX2: the same bits) or fp32 (FMAs, AVX-512)", py::arg("x"),
        py::arg("packed"), py::arg("scale"), py::arg("bias") = py::none(), py::arg("a16") = -1,
        py::arg("amx_rows") = -1);
  m.def("int8w_supported", &int8w_supported, "whether int8w_gemm runs here (AVX-512, or AVX2 and FMA)");
  m.def("int8w_default_a16", &int8w_default_a16, "whether int8w_gemm's default quantizes x to int16 here");
  m.def("fp32_gemm_supported", &fp32_gemm_supported, "whether fp32_gemm runs here (AVX2 and FMA)");
  m.def("fp32_pack", &fp32_pack, "fp32 [N, K] weight -> the block layout fp32_gemm reads");
  m.def("fp32_gemm", &fp32_gemm, "x @ W^T (+ bias), fp32 weights packed by fp32_pack, fp32 FMAs on AVX2 (CPU)",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  m.def("int8w_a16_supported", &int8w_a16_supported, "whether int8w_gemm can take 16-bit activations (AVX512-VNNI)");
  m.def("quantize_rows_int8", &quantize_rows_int8, "weight [N, K] -> (int8 [N, K], fp32 scales [N]), symmetric per row");
  m.def("w8a8_pack", &w8a8_pack, "int8 [N, K] weight -> the VNNI block layout w8a8_linear reads");
  m.def("w8a8_linear", &w8a8_linear, "int8 weights (packed) x int8 per-row activations, VNNI GEMM, from amx_rows rows "
        "on AMX-INT8 tiles where the CPU has them (the same bits; 0: never; < 0: the kernel's default) (CPU)",
        py::arg("x"), py::arg("packed"), py::arg("w_scale"), py::arg("wsum"), py::arg("bias") = py::none(),
        py::arg("amx_rows") = -1);
  m.def("sample_rows", &sample_rows, "per row: temperature, top-k, top-p, min-p, then one inverse-CDF draw from u; "
        "temperature 0 is argmax; -1 for rows left to the torch path (CPU)", py::arg("logits"), py::arg("temperature"),
        py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("u"));
  m.def("argmax_rows", &argmax_rows, "first maximum of each row; -1 for rows holding a NaN (CPU)");
  m.def("apply_token_bitmask_", &apply_token_bitmask_, "structured output: -inf where the rows' bitmask bit is 0, in "
        "place (CPU)");
  m.def("verify_rows", &verify_rows, "speculative verification per row: (token, draft accepted) under the filters of "
        "sample_rows, a rejected draft's replacement drawn from u2 over the rest; token -1 for rows left to the torch "
        "path (CPU)", py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"),
        py::arg("u"), py::arg("drafts"), py::arg("u2"));
  m.def("logprob_rows", &logprob_rows, "log-probabilities of raw logits per row: (the token's, its rank, top_n values, "
        "top_n ids); rank -1 for rows left to log_softmax (CPU)", py::arg("logits"), py::arg("tokens"),
        py::arg("top_n"));
  m.def("sampling_avx512", &sampling_avx512, "whether sample_rows and argmax_rows run on AVX-512 here "
        "(LLMSERVE_SAMPLING_AVX512=0: the scalar passes)");
  m.def("work_queue_trace", &work_queue_trace, "which thread ran each unit of parallel_units, in what order, and "
        "the upcoming unit it named (tests)", py::arg("total"), py::arg("run"), py::arg("spin_us") = 0);
  m.def("work_queue_enabled", &work_queue_enabled, "whether the kernels share out their units from a queue here "
        "(LLMSERVE_WORK_QUEUE=0: equal contiguous shares)");
  bind_decoder_stack(m);
  bind_qblocks(m);
}
