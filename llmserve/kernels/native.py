"""The C++ CPU kernels, compiled lazily on first use: the paged decode kernel (kernels/cpu/paged_decode.cpp),
the fused rotary / add+RMSNorm ops of the decoder layer (kernels/cpu/fused_ops.cpp), the int8-activation linear
(kernels/cpu/w8a8_linear.cpp), the GEMMs over packed bf16 or int8 weights (kernels/cpu/packed_gemm.cpp), the K/V
writers (kernels/cpu/kv_int8.cpp), prefill attention (kernels/cpu/prefill_attention.cpp), a step's decoder layers
in one call (kernels/cpu/decoder_stack.cpp), the sampler's token choice (kernels/cpu/sampling.cpp) and the linears over
block-quantized weights (kernels/cpu/qblock_gemm.cpp), one extension.

Compiling takes tens of seconds, so it never happens at import: `load()` builds on first call
(torch caches the build under ~/.cache/torch_extensions, so later processes only link it) and is
thread-safe. A failed build logs one warning and returns None for the rest of the process, so
callers fall back to the torch reference.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

# Longest compile first (ninja starts them in this order, a few at once): listed last, qblock_gemm.cpp (97 s of a 179 s
# build on 2 cores) started when the rest were nearly done and ended alone.
_SOURCES = [Path(__file__).parent / "cpu" / name
            for name in ("qblock_gemm.cpp", "bindings.cpp", "decoder_stack.cpp", "packed_gemm.cpp",
                         "prefill_attention.cpp", "paged_decode.cpp", "kv_int8.cpp", "sampling.cpp", "w8a8_linear.cpp",
                         "amx_gemm.cpp", "fused_ops.cpp")]
NAME = "llmserve_cpu_kernels"  # the extension torch builds and caches
# A build (or a wait for another process's) longer than this is announced in the log, and its time logged at the end.
BUILD_NOTICE_S = 3.0
_lock = threading.Lock()
_module: ModuleType | None = None
_failed = False


def _cflags() -> list[str]:
    # Not -march=native: the cache may be shared by machines of different generations. AVX2+FMA
    # only where torch itself found them on this CPU (AVX512 machines have both too).
    # -ffp-contract=off: no implicit a*b+c -> fma, so the fused elementwise ops round exactly as the torch
    # ops they replace (explicit _mm256_fmadd_ps in the attention kernel is unaffected).
    flags = ["-O3", "-fopenmp", "-ffp-contract=off"]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma", "-mf16c"]  # F16C: fp16 caches (every AVX2 CPU has it)
    return flags


def load() -> ModuleType | None:
    """The compiled extension, or None if it cannot be built here."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is None and not _failed:
            try:
                from torch.utils.cpp_extension import load as cpp_load

                done = threading.Event()
                # the time is taken here, not in the thread: this thread holds the GIL into cpp_load, which may make
                # its own lock before the watcher's first line runs (it then took that lock for an old one, and a
                # 5-minute build on a 2-core Xeon lost its lock and failed)
                began = time.time()
                threading.Thread(target=_watch_build_lock, args=(done, 5.0, began), daemon=True).start()
                # a first start compiles the kernels for minutes without a word: say so once it has taken a while
                notice = threading.Timer(BUILD_NOTICE_S, log.info, (
                    "building the native CPU kernels: once per machine and llmserve version, 2.5 minutes on a 2-core "
                    "Zen 4 (cached in %s)", _build_dir()))
                notice.daemon = True
                notice.start()
                try:
                    _module = cpp_load(name=NAME, sources=[str(p) for p in _SOURCES],
                                       extra_cflags=_cflags(), extra_ldflags=["-fopenmp"], verbose=False)
                finally:
                    done.set()
                    notice.cancel()
                if (took := time.time() - began) >= BUILD_NOTICE_S:
                    log.info("native CPU kernels ready after %.0f s", took)
            except Exception as e:  # noqa: BLE001 - any build or link failure means "use the fallback"
                _failed = True
                log.warning("native CPU kernels unavailable, using torch: %s", e)
    return _module


def _build_dir() -> Path:
    """Where torch builds and caches the extension (under TORCH_EXTENSIONS_DIR, else its default root)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(NAME, verbose=False))


# A build that was killed (Ctrl-C, a test timeout) leaves torch's build lock behind, and torch waits on
# it forever. A whole build takes ~30-60 s on a fast machine and 4-5 minutes on a 2-core Xeon, so age alone does not
# tell a dead build from a slow one: a lock is stale when it and everything in the build directory (a live build
# writes an object file every minute or so) are older than this.
STALE_LOCK_S = 300


def _newest_mtime(directory: Path) -> float:
    """The latest modification time of the directory's entries (0 where there are none)."""
    newest = 0.0
    try:
        for entry in directory.iterdir():
            try:
                newest = max(newest, entry.stat().st_mtime)
            except OSError:
                continue
    except OSError:
        pass
    return newest


def _watch_build_lock(done: threading.Event, period_s: float = 5.0, started: float | None = None) -> None:
    """While load() builds or waits for another process's build, remove the lock once it is stale (it, and the
    build directory's files, older than STALE_LOCK_S). Only a lock that was there before this process started loading
    (`started`): its own build's lock (made after) is never taken away from it, however slow the build."""
    started = time.time() if started is None else started
    lock = _build_dir() / "lock"
    while True:
        try:
            made = lock.stat().st_mtime
        except OSError:
            made = started  # no lock: nobody is building
        age = time.time() - max(made, _newest_mtime(lock.parent))
        # a second's slack: a file's mtime comes from a coarse clock, which may read a few ms behind time.time()
        if made < started - 1.0 and age > STALE_LOCK_S:
            log.warning("removing a stale build lock (nothing in its build directory changed for %.0f s) left by an "
                        "interrupted build: %s", age, lock)
            lock.unlink(missing_ok=True)
        if done.wait(period_s):
            return


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor,
                 scale: float, sliding_window: int | None, kv_scales: torch.Tensor | None = None,
                 splits: int = -1, dot: bool = False) -> torch.Tensor:
    """q: [nd, heads, head_dim]; kv_cache: [2, num_blocks, block_size, kv_heads, head_dim];
    block_tables: [nd, max_blocks] int64; lens: [nd] int64 -> [nd, heads, head_dim]. An int8 cache, or an int4 one
    (uint8, head_dim / 2 bytes per row: torch_backend.pack_int4), comes with kv_scales [2, num_blocks, block_size,
    kv_heads] fp32 (and needs int8_kv_decode_usable()). splits: parts each
    context is split into across threads (-1: the kernel decides; long contexts of small batches). dot: the scores by
    AVX512-BF16 dot products on the keys as stored, for a bf16 query over a bf16 cache (needs bf16_dot_usable();
    other dtypes keep FMAs). Needs load()."""
    assert _module is not None, "call load() first"
    k_scales, v_scales = (None, None) if kv_scales is None else (kv_scales[0], kv_scales[1])
    return _module.paged_decode(q, kv_cache[0], kv_cache[1], block_tables, lens, scale,
                                -1 if sliding_window is None else sliding_window, k_scales, v_scales, splits,
                                1 if dot else 0)


# prefill attention's paths (prefill_attention.cpp): fp32 FMAs, AVX512-BF16 dot products for the scores, AMX tiles for
# both products
ATTENTION_PATHS = {"fp32": 0, "dot": 1, "amx": 2}


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      kv_scales: torch.Tensor | None, spans: torch.Tensor, slots: torch.Tensor, scale: float,
                      sliding_window: int | None, out: torch.Tensor, kernel: str = "fp32") -> None:
    """Causal attention of every prefill span into out's rows: q [T, heads, D], k/v [T, kv_heads, D] (this step's
    rows), kv_cache [2, NB, BS, kv_heads, D] (+ kv_scales for int8; int4: uint8 [.., D / 2] with kv_scales [2, NB, BS,
    kv_heads, 2] fp16, write_kv_int4's); spans [S, 4] int64 (q_start, q_len,
    num_cached, offset into slots), slots: the spans' context slots concatenated. A fresh prompt reads this step's
    K/V, any other span its whole context from the cache (as torch_backend.paged_attention). Needs
    prefill_attention_usable(). kernel (ATTENTION_PATHS), where q and the keys are bf16: "dot", the scores by
    AVX512-BF16 dot products (needs bf16_dot_usable()), the PV product by fp32 FMAs; "amx", both products on AMX tiles
    (needs prefill_amx_usable(); head_dim a multiple of 32, else "dot"); "fp32" and other dtypes: fp32 FMAs."""
    k_scales, v_scales = (None, None) if kv_scales is None else (kv_scales[0], kv_scales[1])
    _module.prefill_attention(q, k, v, kv_cache[0], kv_cache[1], k_scales, v_scales, spans, slots, scale,
                              -1 if sliding_window is None else sliding_window, out, ATTENTION_PATHS[kernel])


@functools.cache
def prefill_attention_usable() -> bool:
    """Whether the native prefill attention runs here: the extension builds and the CPU has AVX-512, or AVX2 and FMA
    (fp32 FMAs over a float cache: prefill_quantized_usable() says whether an int8 or int4 cache's runs too)."""
    return load() is not None and _module.prefill_attention_supported()


@functools.cache
def prefill_quantized_usable() -> bool:
    """Whether the native prefill attention reads an int8 or int4 KV cache here (AVX-512)."""
    return prefill_attention_usable() and _module.prefill_attention_quantized_supported()


def prefill_amx_usable() -> bool:
    """Whether prefill attention's amx path runs here: AMX-BF16 (with the OS's permission) and AVX512-BF16."""
    return prefill_attention_usable() and amx_usable() and bf16_dot_usable()


def int8_kv_decode_usable() -> bool:
    """Whether paged_decode reads an int8 or int4 cache here: the AVX-512 path (asked each time: tests turn it off
    with LLMSERVE_DECODE_AVX512=0)."""
    return load() is not None and _module.int8_kv_decode_supported()


def write_kv_int8(kv_cache: torch.Tensor, kv_scales: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Quantize k, v [T, kv_heads, head_dim] into the int8 cache and its scales at slot_mapping [T], exactly as
    torch_backend.quantize_int8 does. Needs load()."""
    assert _module is not None, "call load() first"
    _module.write_kv_int8(k, v, kv_cache[0], kv_cache[1], kv_scales[0], kv_scales[1], slot_mapping)


def write_kv_int4(kv_cache: torch.Tensor, kv_scales: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Quantize k, v [T, kv_heads, head_dim] into the int4 cache (uint8 [2, NB, BS, kv_heads, head_dim / 2]) and its
    scales at slot_mapping [T], exactly as torch_backend.quantize_int4 does. Needs load()."""
    assert _module is not None, "call load() first"
    _module.write_kv_int4(k, v, kv_cache[0], kv_cache[1], kv_scales[0], kv_scales[1], slot_mapping)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Copy k, v [T, kv_heads, head_dim] into a 16- or 32-bit cache at slot_mapping [T], converted to its dtype as
    .to() does (one call for K and V instead of two index_copy_). Needs load()."""
    assert _module is not None, "call load() first"
    _module.write_kv(k, v, kv_cache[0], kv_cache[1], slot_mapping)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x: [T, heads, D] (rows may be strided), rotated in place; cos/sin: [T, D/2] in x's dtype. Needs load()."""
    assert _module is not None, "call load() first"
    _module.rotary_(x, cos, sin)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x, then x = weight * rms_norm(residual). [T, E] contiguous. Needs load()."""
    assert _module is not None, "call load() first"
    _module.add_rms_norm_(x, residual, weight, eps)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] (gate, then up; contiguous, CPU) -> silu(gate) * up [T, I], silu rounded to x's dtype before the
    product as torch's F.silu(gate) * up. Needs load()."""
    assert _module is not None, "call load() first"
    return _module.silu_mul(x)


def fused_ops_enabled() -> bool:
    """LLMSERVE_FUSED_OPS=0 keeps the torch layers (for A/B measurements and as the reference)."""
    return os.environ.get("LLMSERVE_FUSED_OPS", "1") != "0"


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (fp32/bf16/fp16, CPU) -> (int8 [N, K], fp32 scales [N]), symmetric per row, byte for byte
    layers.linear.quantize_rows_torch. Needs load()."""
    assert _module is not None, "call load() first"
    return _module.quantize_rows_int8(weight)


def w8a8_pack(qweight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] weight -> the block layout w8a8_linear reads: [ceil(N/16), ceil(K/4), 16, 4] int8, for each 16
    output rows the columns in groups of 4 (zero padded). Needs w8a8_usable()."""
    return _module.w8a8_pack(qweight)


def w8a8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, wsum: torch.Tensor,
                bias: torch.Tensor | None, amx_rows: int = -1) -> torch.Tensor:
    """x [M, K] (fp32/bf16) quantized per row to int8 (asymmetric), times the int8 weight [N, K] (packed by
    w8a8_pack) in the VNNI GEMM, rescaled by scale [N] (+ bias); wsum [N]: the weight's row sums. [M, N] in
    x's dtype. amx_rows: batches of at least this many rows run on AMX-INT8 tiles where w8a8_amx_usable() and K >= 64,
    the same bits (0: never; < 0: the kernel's default, 16; calibrate.measure_w8a8 measures it). Needs
    w8a8_usable()."""
    return _module.w8a8_linear(x, packed, scale, wsum, bias, amx_rows)


@functools.cache
def w8a8_usable() -> bool:
    """Whether the W8A8 kernel runs here: the extension builds and the CPU has AVX-512 with VNNI."""
    return load() is not None and _module.w8a8_linear_supported()


@functools.cache
def w8a8_amx_usable() -> bool:
    """Whether w8a8_linear runs the larger batches on AMX-INT8 tiles here (the OS grants the tiles)."""
    return w8a8_usable() and _module.qblock_amx8_supported()


def work_queue_trace(total: int, run: int, spin_us: int = 0) -> torch.Tensor:
    """How the kernels' shared work queue (kernels/cpu/work_queue.h) handed out `total` units in runs of `run`: int64
    [total, 3], per unit the thread that ran it, its place in that thread's order and the unit the thread was told it
    runs next (-1: none). Each unit spins spin_us microseconds. For tests; needs load()."""
    return _module.work_queue_trace(total, run, spin_us)


def work_queue_enabled() -> bool:
    """Whether the kernels hand out their units from a queue (the default), or split them in equal contiguous shares
    (LLMSERVE_WORK_QUEUE=0, read once per process). Needs load()."""
    return _module.work_queue_enabled()


def bf16_pack(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] weight -> the block layout bf16_gemm reads: [ceil(N/16), ceil(K/2), 16, 2] bf16, for each 16
    output rows the columns in pairs (zero padded). Needs packed_gemm_usable()."""
    return _module.bf16_pack(weight)


BF16_PATHS = {"fma": 0, "dot": 1, "amx": 2}  # bf16_gemm's kernels, as the extension numbers them


def bf16_gemm(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None,
              kernel: str = "fma", glu: bool = False) -> torch.Tensor:
    """x [M, K] bf16 @ the weight [n, K] (packed by bf16_pack) ^T (+ bias) -> [M, n] bf16, each output summed over k in
    an order that does not depend on M: kernel "fma" (fp32 FMAs on the widened weights), "dot" (vdpbf16ps on the packed
    pairs; needs bf16_dot_usable()) or "amx" (AMX tiles; needs amx_usable() and K a multiple of 32). Which is faster
    depends on the CPU and the rows (kernels/choice.py measures it). glu ("amx" only; n = 2 I, I a multiple of 16, the
    weight gate then up): silu(gate) * up [M, I] in the GEMM's epilogue, bit for bit silu_mul of the plain result.
    Needs packed_gemm_usable()."""
    return _module.bf16_gemm(x, packed, n, bias, BF16_PATHS[kernel], glu)


@functools.cache
def amx_usable() -> bool:
    """Whether bf16_gemm's amx path runs here: the packed GEMMs do, the CPU has AMX-TILE and AMX-BF16, and Linux
    granted this process the tile state."""
    return packed_gemm_usable() and _module.amx_bf16_supported()


@functools.cache
def bf16_dot_usable() -> bool:
    """Whether bf16_gemm's dot path runs here: the packed GEMMs do and the CPU has AVX512-BF16."""
    return packed_gemm_usable() and _module.bf16_dot_supported()


def int8w_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               a16: bool | int | None = None, amx_rows: int = -1) -> torch.Tensor:
    """Weight-only int8: x [M, K] (fp32/bf16) @ (the int8 weight [N, K] packed by w8a8_pack, times scale [N] per row)^T
    (+ bias) -> [M, N] in x's dtype. a16 (default: where int8w_a16_usable()): each row of x quantized to int16 and the
    products summed in int32 by VNNI, twice the fp32 FMAs' rate; else fp32 FMAs on the widened weights. Either way each
    output is summed over k in order, whatever the other rows. With a16, batches of at least amx_rows rows (0: never;
    < 0: the kernel's default, 16) run on AMX-INT8 tiles where the CPU has them and K % 64 == 0: the same bits.
    On a CPU with AVX2 but not AVX-512, x is always quantized to int16 (vpmaddwd: the VNNI path's bits); a16=2 runs
    that path on any CPU with AVX2 (tests compare it with VNNI's). Needs int8w_usable()."""
    return _module.int8w_gemm(x, packed, scale, bias, -1 if a16 is None else int(a16), int(amx_rows))


@functools.cache
def int8w_a16_usable() -> bool:
    """Whether int8w_gemm can quantize x to int16 here (a CPU with AVX512-VNNI)."""
    return load() is not None and _module.int8w_a16_supported()


@functools.cache
def int8w_usable() -> bool:
    """Whether int8w_gemm runs here: the extension builds and the CPU has AVX-512, or AVX2 and FMA (16-bit activations
    only there: not with LLMSERVE_INT8W_A16=0)."""
    return load() is not None and _module.int8w_supported()


def int8w_default_a16() -> bool:
    """Whether int8w_gemm's default quantizes x to int16 here (VNNI, unless LLMSERVE_INT8W_A16=0; AVX2-only CPUs)."""
    return int8w_usable() and _module.int8w_default_a16()


def fp32_pack(weight: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] weight -> the block layout fp32_gemm reads: [ceil(N/16), K, 16, 1] fp32, for each 16 output rows
    each column's 16 elements together (zero padded). Needs fp32_gemm_usable()."""
    return _module.fp32_pack(weight)


def fp32_gemm(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] fp32 @ the weight [n, K] (packed by fp32_pack) ^T (+ bias) -> [M, n] fp32 by AVX2 FMAs, each output
    summed over k in order whatever M (a row's result does not depend on the batch). Needs fp32_gemm_usable()."""
    return _module.fp32_gemm(x, packed, n, bias)


@functools.cache
def fp32_gemm_usable() -> bool:
    """Whether fp32_gemm runs here: the extension builds and the CPU has AVX2 and FMA."""
    return load() is not None and _module.fp32_gemm_supported()


@functools.cache
def packed_gemm_usable() -> bool:
    """Whether the packed GEMMs run here with every path: the extension builds and the CPU has AVX-512 (int8w_gemm's
    16-bit path runs on AVX2 too: int8w_usable)."""
    return load() is not None and _module.packed_gemm_supported()


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of logits [B, V] fp32 (not changed): x = logits / temperature, then top-k (top_k >= V: off),
    top-p (>= 1 or inf: off) and min-p (0: off) as the torch sampler applies them, then the first token in id order
    whose cumulative probability exceeds u times the total; temperature 0 is the argmax. [B] parameters (top_k
    int64, the rest fp32) -> [B] int64, -1 for a row holding a NaN or no finite logit. Needs load()."""
    return _module.sample_rows(logits, temperature, top_k, top_p, min_p, u)


def verify_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, u: torch.Tensor, drafts: torch.Tensor, u2: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
    """Speculative verification per row, under sample_rows' filters: a draft token d (drafts [B] int64, -1: none) is
    accepted when u < p(d) (greedy rows: when it is the argmax); a rejected one is replaced by a draw from p without d,
    renormalised, with u2; rows without a draft draw from p with u. -> (tokens [B] int64, -1 for a row holding a NaN
    or no finite logit; accepted [B] bool). Needs load()."""
    tokens, accepted = _module.verify_rows(logits, temperature, top_k, top_p, min_p, u, drafts, u2)
    return tokens, accepted


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, top_n: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                             torch.Tensor, torch.Tensor]:
    """Log-probabilities (log_softmax) of raw logits [R, V] fp32: per row the token's (tokens [R] int64), its rank (1 +
    tokens strictly more likely), and the top_n most likely as values [R, top_n] and ids [R, top_n], most likely
    first (ties in no set order). Rank -1 for a row holding a NaN or no finite logit. Needs load()."""
    token_lp, rank, top_lp, top_ids = _module.logprob_rows(logits, tokens, top_n)
    return token_lp, rank, top_lp, top_ids


def sampling_usable() -> bool:
    """Whether the sampler takes sample_rows / argmax_rows here: the extension builds and their passes run on AVX-512
    (asked each time: tests turn it off with LLMSERVE_SAMPLING_AVX512=0)."""
    return load() is not None and _module.sampling_avx512()


def sampling_enabled(logits: torch.Tensor) -> bool:
    """Whether the sampler's kernels (sample_rows, verify_rows, argmax_rows, logprob_rows) take these logits: [B, V]
    fp32 on the CPU, sampling_usable(), and the torch path not forced (LLMSERVE_SAMPLER=torch)."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and os.environ.get("LLMSERVE_SAMPLER") != "torch" and sampling_usable())


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits [B, V] fp32: -inf wherever bit t of bitmask[r] ([B, ceil(V / 32)] int32, xgrammar's layout) is 0, for
    each r of rows [R] int64; in place. Needs load()."""
    _module.apply_token_bitmask_(logits, bitmask, rows)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The first maximum of each row of logits [B, V] fp32 -> [B] int64, -1 for a row holding a NaN. Needs load()."""
    return _module.argmax_rows(logits)


def qblock_weight(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, n: int, k: int, bits: int,
                  group: int, zero: int) -> object:
    """The native handle of a block-quantized weight (layers/quant_blocks.py's layout; the tensors are shared, not
    copied): what qblock_linear and the decoder stack take. Needs qblock_usable()."""
    return _module.QBlockWeight(codes, scales, mins, n, k, bits, group, zero)


def qblock_linear(x: torch.Tensor, weight: object, bias: torch.Tensor | None, vnni: bool | int | None = None) -> torch.Tensor:
    """x [M, K] (fp32/bf16) @ the block-quantized weight [n, K] ^T (+ bias) -> [M, n] in x's dtype. vnni (default:
    where qblock_int8_usable() and the weight's measured `fma` is not set): x quantized to int8 per block of 32 and
    exact int32 block sums (batches of the weight's amx8_rows rows and more on AMX-INT8 tiles where
    qblock_amx8_usable(), the same bits; vnni=2: VNNI alone; without AVX-512, and with vnni=3 where
    qblock_avx2_usable(), the AVX2 kernel: the same bits again); else (vnni=False) fp32 FMAs on the widened codes
    (without AVX-512, and with vnni=4 where qblock_avx2_usable(), the AVX2 FMA kernel: the same bits). Either way a
    row's result does not depend on the other rows. Needs qblock_usable()."""
    return _module.qblock_linear(x, weight, bias, -1 if vnni is None else int(vnni))


def qblock_linear_amx(x: torch.Tensor, weight: object, bias: torch.Tensor | None, glu: bool = False) -> torch.Tensor:
    """x [M, K] bf16 @ the block-quantized weight [n, K] ^T (+ bias) -> [M, n] bf16 on AMX tiles, each tile of the
    weight dequantized to bf16 as it is read: bit for bit bf16_gemm(..., "amx") over the dequantized weight (exactly
    the format's values rounded to bf16), reading the blocks' bytes. glu: as bf16_gemm's. Needs qblock_amx_usable()."""
    return _module.qblock_linear_amx(x, weight, bias, glu)


def qblock_linear_amx_dot(x: torch.Tensor, weight: object, bias: torch.Tensor | None, glu: bool = False) -> torch.Tensor:
    """qblock_linear_amx's result, bit for bit, computed by AVX512-BF16 dot products over the blocks in the tiles' order (two
    sums a 32-column tile, the even and the odd columns'): for a few rows, where the tiles idle and reading the weight
    bounds the step. Needs qblock_amx_dot_usable()."""
    return _module.qblock_linear_amx_dot(x, weight, bias, glu)


@functools.cache
def qblock_amx_dot_usable() -> bool:
    """Whether qblock_linear_amx_dot runs here (AVX512-BF16 and VBMI); it stands in for the tiles only where they run
    too (qblock_amx_usable())."""
    return qblock_amx_usable() and _module.qblock_amx_dot_supported()


def qblock_dequantize_bf16(weight: object) -> torch.Tensor:
    """A QBlockWeight [n, K] dequantized to bf16 in bf16_pack's layout ([ceil(n / 16), K / 2, 16, 2], zero past n):
    exactly the format's values rounded to bf16. Needs qblock_usable() and bf16_dot_usable()."""
    return _module.qblock_dequantize_bf16(weight)


def qblock_rows(weight: object, ids: torch.Tensor) -> torch.Tensor:
    """fp32 rows ids [R] int64 of a QBlockWeight [n, K]: exactly the format's values, as BlockWeight.rows computes them
    (an embedding lookup). Needs qblock_usable()."""
    return _module.qblock_rows(weight, ids)


def qblock_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [n, k] -> qblock_linear's layout (layers/quant_blocks.pack_codes, the same bytes). Needs load()."""
    return _module.qblock_pack(codes, bits)


def gguf_nibbles(raw: torch.Tensor, offset: int, size: int) -> torch.Tensor:
    """GGUF Q4_0 / Q4_1 rows, uint8 [rows, blocks * size] -> their codes, uint8 [rows, blocks * 32] (byte j of a block's
    16 at `offset`: column j low, j + 16 high). Needs load()."""
    return _module.gguf_nibbles(raw, offset, size)


@functools.cache
def qblock_usable() -> bool:
    """Whether qblock_linear runs here: the extension builds and the CPU has AVX-512, or AVX2 and FMA (int8
    activations only)."""
    return load() is not None and _module.qblock_linear_supported()


@functools.cache
def qblock_fma_usable() -> bool:
    """Whether qblock_linear's fp32-FMA path (vnni=False) runs here (AVX-512, or AVX2 and FMA)."""
    return qblock_usable() and _module.qblock_fma_supported()


@functools.cache
def qblock_avx2_usable() -> bool:
    """Whether qblock_linear's AVX2 kernel runs here (vnni=3; the int8 path of CPUs without AVX-512)."""
    return qblock_usable() and _module.qblock_avx2_supported()


@functools.cache
def qblock_int8_usable() -> bool:
    """Whether qblock_linear's int8-activation product runs here: VNNI, or the AVX2 kernel (the same bits)."""
    return qblock_vnni_usable() or qblock_avx2_usable()


@functools.cache
def qblock_amx_usable() -> bool:
    """Whether qblock_linear_amx runs here (AMX-BF16, and AVX512-BF16 to round the dequantized tiles)."""
    return qblock_usable() and amx_usable() and bf16_dot_usable()


@functools.cache
def qblock_amx8_usable() -> bool:
    """Whether qblock_linear's int8-activation path runs the larger batches on AMX-INT8 tiles here (from the weight's
    amx8_rows rows, measured at calibration; the VNNI kernel's bits; vnni=2 keeps VNNI alone)."""
    return qblock_vnni_usable() and _module.qblock_amx8_supported()


@functools.cache
def qblock_vnni_usable() -> bool:
    """Whether qblock_linear's int8-activation path runs here (AVX512-VNNI)."""
    return qblock_usable() and _module.qblock_vnni_supported()
