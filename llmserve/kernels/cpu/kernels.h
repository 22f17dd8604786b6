// The extension's entry points, declared once: the Python binding (bindings.cpp) and the decode stack
// (decoder_stack.cpp), which calls the kernels directly, see them; each is defined in its own file. The ATen headers
// only: <torch/extension.h> (pybind11, libtorch) is for the two files that deal in Python objects.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

// paged_decode.cpp
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                        at::Tensor block_tables, at::Tensor lens, double scale, int64_t window,
                        c10::optional<at::Tensor> k_scales, c10::optional<at::Tensor> v_scales,
                        int64_t splits, int64_t dot);
bool int8_kv_decode_supported();
int64_t decode_splits(int64_t items, int64_t max_context);
// kv_int8.cpp
void write_kv_int8(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                   at::Tensor k_scales, at::Tensor v_scales, at::Tensor slots);
void write_kv_int4(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                   at::Tensor k_scales, at::Tensor v_scales, at::Tensor slots);
void write_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots);
// fused_ops.cpp
void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin);
void add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
at::Tensor silu_mul(at::Tensor x);
// prefill_attention.cpp
bool prefill_attention_supported();
bool prefill_attention_quantized_supported();  // an int8 or int4 cache's (AVX-512)
void prefill_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_cache,
                       at::Tensor v_cache, c10::optional<at::Tensor> k_scales,
                       c10::optional<at::Tensor> v_scales, at::Tensor spans, at::Tensor slots, double scale,
                       int64_t window, at::Tensor out, int64_t path);
// w8a8_linear.cpp
bool w8a8_linear_supported();
at::Tensor w8a8_pack(at::Tensor qweight);
std::vector<at::Tensor> quantize_rows_int8(at::Tensor weight);
at::Tensor w8a8_linear(at::Tensor x, at::Tensor packed, at::Tensor w_scale, at::Tensor wsum,
                       c10::optional<at::Tensor> bias, int64_t amx_rows = -1);
// packed_gemm.cpp
bool packed_gemm_supported();
at::Tensor bf16_pack(at::Tensor weight);
at::Tensor bf16_gemm(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias,
                     int64_t path, bool glu = false);
bool bf16_dot_supported();
// amx_gemm.cpp (bf16_gemm's path 2; bias fp32 [N] or nullptr)
bool amx_bf16_supported();
// AMX-TILE and AMX-INT8 (and AVX512-VNNI), granted by the OS: qblock_linear's int8 activations on tiles
bool amx_int8_supported();
// glu (N = 2 I, I a multiple of 16; gate then up): silu(gate) * up [M, I], each rounded as the unfused GEMM and
// silu_mul round them, so the same bits
at::Tensor bf16_gemm_amx(const at::Tensor& x, const at::Tensor& packed, int64_t N, const float* bias,
                         bool glu = false);
// x [M, K] bf16 @ W^T (+ bias) on AMX tiles, W's NB blocks of 16 outputs (N outputs in all) given by block(b, scratch):
// a pointer to block b in bf16_pack's layout ([K / 2][16][2]), which may be scratch (K * 16 bf16) filled by the call.
// plain: where the blocks lie one after the other in memory (block b at plain + b * K * 16), so the next pair's can be
// asked for ahead; null where block() makes them.
at::Tensor amx_gemm_blocks(const at::Tensor& x, int64_t NB, int64_t N, const float* bias,
                           const std::function<const uint16_t*(int64_t, uint16_t*)>& block, bool glu = false,
                           const uint16_t* plain = nullptr);
// amx_gemm_blocks' epilogue for one unit: c fp32 [rows][32] (pair p: blocks 2p and 2p + 1, or with glu gate block p
// and up block p + NB / 2) plus bias, rounded to bf16, into y (the unit's first row of the [M, N] or [M, N / 2] output)
void amx_store_pair(const float* c, int64_t rows, int64_t p, int64_t N, const float* bias, at::BFloat16* y, bool glu);
at::Tensor int8w_gemm(at::Tensor x, at::Tensor packed, at::Tensor scale, c10::optional<at::Tensor> bias,
                      int64_t a16, int64_t amx_rows);
bool int8w_a16_supported();
// fp32 weights (AVX2 and FMA): fp32_pack's layout [N/16][K][16], fp32 x -> fp32 y
bool fp32_gemm_supported();
at::Tensor fp32_pack(at::Tensor weight);
at::Tensor fp32_gemm(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias);
bool int8w_supported();
bool int8w_default_a16();
// sampling.cpp
at::Tensor sample_rows(at::Tensor logits, at::Tensor temperature, at::Tensor top_k, at::Tensor top_p,
                       at::Tensor min_p, at::Tensor u);
at::Tensor argmax_rows(at::Tensor logits);
void apply_token_bitmask_(at::Tensor logits, at::Tensor bitmask, at::Tensor rows);
bool sampling_avx512();
std::vector<at::Tensor> logprob_rows(at::Tensor logits, at::Tensor tokens, int64_t top_n);
std::vector<at::Tensor> verify_rows(at::Tensor logits, at::Tensor temperature, at::Tensor top_k,
                                    at::Tensor top_p, at::Tensor min_p, at::Tensor u, at::Tensor drafts,
                                    at::Tensor u2);

// qblock_gemm.cpp: a weight of 4-, 5-, 6- or 8-bit codes with a scale and a min per group of columns (w = d * q + m; no
// mins: m = -zero * d), in the tile layout qblock_gemm.cpp describes (llmserve/layers/quant_blocks.py packs it)
struct QBlockWeight {
  QBlockWeight(at::Tensor codes, at::Tensor scales, c10::optional<at::Tensor> mins, int64_t n, int64_t k,
               int64_t bits, int64_t group, int64_t zero);
  at::Tensor codes;                // uint8 [ceil(n / 16), k / 32, bits * 64]
  at::Tensor scales;               // fp16 or fp32 [ceil(n / 16), k / group, 16]
  c10::optional<at::Tensor> mins;  // like scales, or none
  int64_t n, k, bits, group, zero;
  // From this many rows of x, qblock_linear's int8 activations run on AMX-INT8 tiles (the VNNI kernel's bits, so a
  // pure speed choice): measured per op at calibration (llmserve/kernels/calibrate.py, add_amx8_rows); 16 where
  // nothing measured it.
  int64_t amx8_rows = 16;
  // From this many rows of x, qblock_linear's VNNI kernel widens each work unit's codes to bytes once, before its rows
  // go past them, rather than in every register tile (4-, 5- and 6-bit codes; the same bits): measured per op at
  // calibration (add_wide_rows); never (2^62) where nothing measured it.
  int64_t wide_rows = int64_t{1} << 62;
  // qblock_linear's auto path (vnni=-1) runs fp32 FMAs on the widened codes rather than int8 activations (a choice
  // between two numerics, one for every batch size: measured per op at calibration, kernels/calibrate.py's blocks_fma).
  bool fma = false;
};
bool qblock_linear_supported();
// qblock_linear's fp32-FMA path (vnni=0: AVX-512, or AVX2 and FMA) and its AVX2 int8 kernel (vnni=3; the int8 path
// without AVX-512)
bool qblock_fma_supported();
bool qblock_avx2_supported();
at::Tensor qblock_linear(at::Tensor x, const QBlockWeight& weight, c10::optional<at::Tensor> bias,
                         int64_t vnni);
// bf16 x on AMX tiles, each tile of the weight dequantized to bf16 as it is read (amx_bf16_supported())
at::Tensor qblock_linear_amx(at::Tensor x, const QBlockWeight& weight, c10::optional<at::Tensor> bias,
                             bool glu = false);
// qblock_linear_amx's bits by AVX-512 dot products over the blocks, for a few rows (qblock_amx_dot_supported())
bool qblock_amx_dot_supported();
at::Tensor qblock_linear_amx_dot(at::Tensor x, const QBlockWeight& weight, c10::optional<at::Tensor> bias,
                                 bool glu = false);
at::Tensor qblock_pack(at::Tensor codes, int64_t bits);
at::Tensor gguf_nibbles(at::Tensor raw, int64_t offset, int64_t size);
at::Tensor qblock_dequantize_bf16(const QBlockWeight& qw);
// fp32 rows ids [R] of the weight, exactly the format's values (an embedding lookup)
at::Tensor qblock_rows(const QBlockWeight& qw, at::Tensor ids);
bool qblock_vnni_supported();

