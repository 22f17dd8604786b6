// The extension's entry points, declared once: the Python binding (paged_decode.cpp) and the decode stack
// (decoder_stack.cpp), which calls the kernels directly, see them; each is defined in its own file.
#pragma once

#include <torch/extension.h>

#include <functional>

// paged_decode.cpp
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor lens, double scale, int64_t window,
                           c10::optional<torch::Tensor> k_scales, c10::optional<torch::Tensor> v_scales,
                           int64_t splits, int64_t dot);
bool int8_kv_decode_supported();
// kv_int8.cpp
void write_kv_int8(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor k_scales, torch::Tensor v_scales, torch::Tensor slots);
void write_kv_int4(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor k_scales, torch::Tensor v_scales, torch::Tensor slots);
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots);
// fused_ops.cpp
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor x);
// prefill_attention.cpp
bool prefill_attention_supported();
void prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                       torch::Tensor v_cache, c10::optional<torch::Tensor> k_scales,
                       c10::optional<torch::Tensor> v_scales, torch::Tensor spans, torch::Tensor slots, double scale,
                       int64_t window, torch::Tensor out, int64_t path);
// w8a8_linear.cpp
bool w8a8_linear_supported();
torch::Tensor w8a8_pack(torch::Tensor qweight);
std::vector<torch::Tensor> quantize_rows_int8(torch::Tensor weight);
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor w_scale, torch::Tensor wsum,
                          c10::optional<torch::Tensor> bias);
// packed_gemm.cpp
bool packed_gemm_supported();
torch::Tensor bf16_pack(torch::Tensor weight);
torch::Tensor bf16_gemm(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias,
                        int64_t path, bool glu = false);
bool bf16_dot_supported();
// amx_gemm.cpp (bf16_gemm's path 2; bias fp32 [N] or nullptr)
bool amx_bf16_supported();
// AMX-TILE and AMX-INT8 (and AVX512-VNNI), granted by the OS: qblock_linear's int8 activations on tiles
bool amx_int8_supported();
// glu (N = 2 I, I a multiple of 16; gate then up): silu(gate) * up [M, I], each rounded as the unfused GEMM and
// silu_mul round them, so the same bits
torch::Tensor bf16_gemm_amx(const torch::Tensor& x, const torch::Tensor& packed, int64_t N, const float* bias,
                            bool glu = false);
// x [M, K] bf16 @ W^T (+ bias) on AMX tiles, W's NB blocks of 16 outputs (N outputs in all) given by block(b, scratch):
// a pointer to block b in bf16_pack's layout ([K / 2][16][2]), which may be scratch (K * 16 bf16) filled by the call.
// plain: where the blocks lie one after the other in memory (block b at plain + b * K * 16), so the next pair's can be
// asked for ahead; null where block() makes them.
torch::Tensor amx_gemm_blocks(const torch::Tensor& x, int64_t NB, int64_t N, const float* bias,
                              const std::function<const uint16_t*(int64_t, uint16_t*)>& block, bool glu = false,
                              const uint16_t* plain = nullptr);
// amx_gemm_blocks' epilogue for one unit: c fp32 [rows][32] (pair p: blocks 2p and 2p + 1, or with glu gate block p
// and up block p + NB / 2) plus bias, rounded to bf16, into y (the unit's first row of the [M, N] or [M, N / 2] output)
void amx_store_pair(const float* c, int64_t rows, int64_t p, int64_t N, const float* bias, at::BFloat16* y, bool glu);
torch::Tensor int8w_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, c10::optional<torch::Tensor> bias,
                         int64_t a16);
bool int8w_a16_supported();
// sampling.cpp
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k, torch::Tensor top_p,
                          torch::Tensor min_p, torch::Tensor u);
torch::Tensor argmax_rows(torch::Tensor logits);
void apply_token_bitmask_(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows);
bool sampling_avx512();
std::vector<torch::Tensor> logprob_rows(torch::Tensor logits, torch::Tensor tokens, int64_t top_n);
std::vector<torch::Tensor> verify_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k,
                                       torch::Tensor top_p, torch::Tensor min_p, torch::Tensor u, torch::Tensor drafts,
                                       torch::Tensor u2);

// qblock_gemm.cpp: a weight of 4-, 5-, 6- or 8-bit codes with a scale and a min per group of columns (w = d * q + m; no
// mins: m = -zero * d), in the tile layout qblock_gemm.cpp describes (llmserve/layers/quant_blocks.py packs it)
struct QBlockWeight {
  QBlockWeight(torch::Tensor codes, torch::Tensor scales, c10::optional<torch::Tensor> mins, int64_t n, int64_t k,
               int64_t bits, int64_t group, int64_t zero);
  torch::Tensor codes;                // uint8 [ceil(n / 16), k / 32, bits * 64]
  torch::Tensor scales;               // fp16 or fp32 [ceil(n / 16), k / group, 16]
  c10::optional<torch::Tensor> mins;  // like scales, or none
  int64_t n, k, bits, group, zero;
  // From this many rows of x, qblock_linear's int8 activations run on AMX-INT8 tiles (the VNNI kernel's bits, so a
  // pure speed choice): measured per op at calibration (llmserve/kernels/calibrate.py, add_amx8_rows); 16 where
  // nothing measured it.
  int64_t amx8_rows = 16;
};
bool qblock_linear_supported();
torch::Tensor qblock_linear(torch::Tensor x, const QBlockWeight& weight, c10::optional<torch::Tensor> bias,
                            int64_t vnni);
// bf16 x on AMX tiles, each tile of the weight dequantized to bf16 as it is read (amx_bf16_supported())
torch::Tensor qblock_linear_amx(torch::Tensor x, const QBlockWeight& weight, c10::optional<torch::Tensor> bias,
                                bool glu = false);
// qblock_linear_amx's bits by AVX-512 dot products over the blocks, for a few rows (qblock_amx_dot_supported())
bool qblock_amx_dot_supported();
torch::Tensor qblock_linear_amx_dot(torch::Tensor x, const QBlockWeight& weight, c10::optional<torch::Tensor> bias,
                                    bool glu = false);
void bind_qblocks(pybind11::module_& m);

// decoder_stack.cpp
void bind_decoder_stack(pybind11::module_& m);
