"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over flat, unpadded tokens.

One implementation; the architectures differ only in what `DecoderSpec` says (biases, per-head
q/k norm, per-layer sliding windows). Shapes: T tokens this step (all requests concatenated),
H query heads, KVH key/value heads, D head_dim, E hidden size, I intermediate size.

Parameter names mirror the HF checkpoint except the fused projections (`qkv_proj` from
q/k/v_proj, `gate_up_proj` from gate/up_proj); `load_weights` maps between them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmserve.attention import Attention, AttentionMetadata
from llmserve.distributed.state import shard as tp_share
from llmserve.distributed.state import tp_state
from llmserve.errors import ModelLoadError
from llmserve.kernels import calibrate, native
from llmserve.kernels.choice import ChoiceTable, OpChoice
from llmserve.layers.activation import SiluAndMul
from llmserve.layers.embedding import VocabEmbedding
from llmserve.layers.linear import Linear, MeasuredMatmul, MergedLinear, ShapeMismatch, int8_packed_ok
from llmserve.layers.norm import RMSNorm
from llmserve.layers.rotary import RotaryEmbedding, apply_rotary, rope_config, rotate_
from llmserve.models import decoder_stack


@dataclass(frozen=True)
class DecoderSpec:
    """What varies across the family, read from the HF config by each architecture class."""

    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k, per head, before rotary
    sliding_windows: tuple[int | None, ...]  # one per layer; None = full causal attention


def head_dim_of(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def rotary_dim_of(cfg: Any) -> int:
    """How many of each head's first dims rotary rotates (all but with a partial_rotary_factor)."""
    return int(head_dim_of(cfg) * rope_config(cfg).partial_rotary_factor)


def layer_sliding_windows(cfg: Any) -> tuple[int | None, ...]:
    """Qwen-style per-layer windows, as transformers applies them.

    transformers 5 configs carry `layer_types`; older ones `use_sliding_window` + `max_window_layers`
    (layers with index >= max_window_layers use the window: transformers' reading, which we follow).
    """
    n, window = cfg.num_hidden_layers, getattr(cfg, "sliding_window", None)
    if not getattr(cfg, "use_sliding_window", False) and getattr(cfg, "layer_types", None) is None:
        return (None,) * n
    types = getattr(cfg, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if i >= cfg.max_window_layers else "full_attention" for i in range(n)]
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown or len(types) != n:
        raise ModelLoadError(f"config.json layer_types {types} is not supported: expected {n} entries of "
                             "'full_attention' or 'sliding_attention'")
    return tuple(window if t == "sliding_attention" else None for t in types)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Process-wide while a model is built (layers allocate with plain torch.empty); models are built
    # before the engine starts stepping, so nothing else allocates concurrently.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def tp_heads(num_heads: int, num_kv_heads: int) -> tuple[int, int, list[int]]:
    """(first query head, query heads, the KV heads it keeps) of this tensor-parallel rank.

    The query heads are split into contiguous ranges, as evenly as they go (9 heads over 2 ranks: 5 and 4). A rank
    keeps the KV heads its query heads read: a share of them when the split follows the KV groups, the one they
    share when there are fewer KV heads than ranks (replicated). Where a rank's heads cover KV groups unevenly
    (SmolLM2's 9 heads in 3 groups over 2 ranks), it keeps one KV row per query head, in order (attention then runs
    as multi-head on that rank: the same values, a larger cache)."""
    state = tp_state()
    if state.size == 1:
        return 0, num_heads, list(range(num_kv_heads))
    if num_heads < state.size:
        raise ModelLoadError(f"tp={state.size}: the model has only {num_heads} attention heads; use tp <= {num_heads}")
    base, extra = divmod(num_heads, state.size)
    count = base + (state.rank < extra)
    first = state.rank * base + min(state.rank, extra)
    group = num_heads // num_kv_heads
    reads = [h // group for h in range(first, first + count)]  # each local query head's KV head
    kept = sorted(set(reads))
    if count % len(kept) == 0 and all(reads.count(k) == count // len(kept) for k in kept):
        return first, count, kept  # grouped as in the model: local head i reads kept[i // (count / len(kept))]
    return first, count, reads


def tp_qkv_rows(q0: int, num_heads: int, kv_heads: list[int], h: int, kvh: int, d: int) -> dict | None:
    """The checkpoint's q/k/v rows of a rank's heads (MergedLinear's tp_rows); None with tp = 1."""
    if tp_state().size == 1:
        return None
    if kv_heads == list(range(kv_heads[0], kv_heads[0] + len(kv_heads))):
        kv = (kv_heads[0] * d, kvh * d)
    else:  # rows gathered head by head
        kv = ([k * d + i for k in kv_heads for i in range(d)], kvh * d)
    return {"q": (q0 * d, h * d), "k": kv, "v": kv}


def init_attention_projections(attn: nn.Module, cfg: Any, spec: DecoderSpec) -> None:
    """Set attn's head_dim, num_heads, num_kv_heads (this rank's: all of them with tp = 1), its fused qkv_proj
    (column-parallel over the heads) and o_proj (row-parallel): Llama's and Gemma's attention alike."""
    attn.head_dim = d = head_dim_of(cfg)
    h, kvh = cfg.num_attention_heads, cfg.num_key_value_heads
    q0, attn.num_heads, kv_heads = tp_heads(h, kvh)
    attn.num_kv_heads = len(kv_heads)
    attn.qkv_proj = MergedLinear(cfg.hidden_size, {"q": attn.num_heads * d, "k": attn.num_kv_heads * d,
                                                   "v": attn.num_kv_heads * d}, bias=spec.qkv_bias,
                                 tp_rows=tp_qkv_rows(q0, attn.num_heads, kv_heads, h, kvh, d))
    attn.o_proj = Linear(h * d, cfg.hidden_size, bias=spec.o_bias, tp="row", tp_share=(q0 * d, attn.num_heads * d))


def gated_mlp_projections(hidden_size: int, intermediate_size: int, bias: bool) -> tuple[MergedLinear, Linear]:
    """(gate_up_proj, down_proj) of a gated MLP: gate/up column-parallel by rows, down row-parallel by columns (the
    whole of each with tp = 1)."""
    i, tp_rows, share = intermediate_size, None, intermediate_size
    if tp_state().size > 1:  # this rank's share of the intermediate features
        start, share = tp_share(i, "intermediate_size")
        tp_rows = {"gate": (start, i), "up": (start, i)}
    gate_up = MergedLinear(hidden_size, {"gate": share, "up": share}, bias=bias, tp_rows=tp_rows)
    return gate_up, Linear(i, hidden_size, bias=bias, tp="row")


class LlamaAttention(nn.Module):
    def __init__(self, cfg: Any, spec: DecoderSpec, layer: int) -> None:
        super().__init__()
        init_attention_projections(self, cfg, spec)
        d = self.head_dim
        self.rotary_dim = rotary_dim_of(cfg)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if spec.qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, d**-0.5, spec.sliding_windows[layer])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
                ) -> torch.Tensor:
        t, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, (H + 2 KVH) D]
        if self.q_norm is None and self.rotary_dim == d:
            # q and k are adjacent in qkv: rotate both heads at once, [T, H + KVH, D]
            qk = rotate_(qkv[:, :(h + kvh) * d].view(t, h + kvh, d), cos, sin)
            q, k = qk[:, :h], qk[:, h:]
            v = qkv[:, (h + kvh) * d:]
        else:
            q, k, v = self.qkv_proj.split(qkv)
            q, k = q.view(t, h, d), k.view(t, kvh, d)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)  # per head, before rotary
            q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        o = self.attn(q.reshape(t, -1), k.reshape(t, -1), v, meta)  # [T, H*D]
        return self.o_proj(o)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[T, heads, D]: rotary over the first rotary_dim dims of each head (cos/sin [T, 1, rotary_dim/2])."""
        if self.rotary_dim == self.head_dim:
            return rotate_(x, cos, sin)
        r = self.rotary_dim
        return torch.cat((apply_rotary(x[..., :r], cos, sin), x[..., r:]), dim=-1)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any, spec: DecoderSpec, intermediate_size: int | None = None) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ModelLoadError(f"config.json hidden_act={cfg.hidden_act!r} is not supported (only 'silu')")
        i = intermediate_size or cfg.intermediate_size  # another size: a MoE model's shared expert (models/moe.py)
        self.gate_up_proj, self.down_proj = gated_mlp_projections(cfg.hidden_size, i, spec.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))  # [T, E] -> [T, 2I] -> [T, I] -> [T, E]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, spec: DecoderSpec, layer: int, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, spec, layer)
        self.mlp = LlamaMLP(cfg, spec) if mlp is None else mlp  # [T, E] -> [T, E]; another: a MoE block
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the next norm adds them."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: Any, spec: DecoderSpec) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, spec, i, self.make_mlp(cfg, spec, i))
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(rotary_dim_of(cfg), rope_config(cfg))
        self._stack: Any = None  # the native decoder stack over the caches bound when it was built (see decoder_stack)
        self._stack_cache: torch.Tensor | None = None
        self._stack_prefills = False  # whether it runs steps with prefill chunks too
        self.lora_manager: Any = None  # LoRA adapters' steps run layer by layer (llmserve/lora)

    def make_mlp(self, cfg: Any, spec: DecoderSpec, layer: int) -> nn.Module:
        """Layer `layer`'s MLP: Llama's everywhere; a MoE model's sparse blocks where its config puts them."""
        return LlamaMLP(cfg, spec)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, E]
        if embeds is not None:  # (rows, values): inputs other than token embeddings at these rows (image features)
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
        cos, sin = self.rotary_emb(positions, x.dtype)  # shared by every layer
        if decoder_stack.covers(x) and (self.lora_manager is None or self.lora_manager.step is None):
            stack = self.native_stack()
            if stack is not None and (not meta.prefills or self._stack_prefills):
                return self.run_decoder_stack(stack, x, cos, sin, meta)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, meta)
        x, _ = self.norm(x, residual)
        return x

    def native_stack(self) -> Any:
        """The native decoder stack, or None where it does not cover this model. Built on the first step after the
        model runner binds the caches, and again if they are bound anew."""
        cache = self.layers[0].self_attn.attn.kv_cache
        if self._stack_cache is not cache:
            self._stack = decoder_stack.build(self) if self.norm.eps == self.layers[0].input_layernorm.eps else None
            self._stack_prefills = self._stack is not None and decoder_stack.runs_prefills(self)
            self._stack_cache = cache
        return self._stack

    def run_decoder_stack(self, stack: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          meta: AttentionMetadata) -> torch.Tensor:
        """Every decoder layer and the final norm of a step in one native call: [T, E] -> [T, E]."""
        return decoder_stack.forward(stack, x, cos, sin, meta, self.norm.weight)


# Checkpoint name fragment -> (our fused parameter's fragment, shard).
_STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", "gate"),
    (".up_proj.", ".gate_up_proj.", "up"),
)


class LlamaForCausalLM(nn.Module):
    model_class: type[nn.Module] = LlamaModel  # the decoder; other families put their own here (models/gemma2.py)
    headless = False  # a checkpoint with no LM head (models/loader.py: decoder_checkpoint): embeddings only

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.config = hf_config
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        spec = self.decoder_spec(hf_config)
        # Parameters are allocated (uninitialised) straight on the target device in the target
        # dtype; load_weights fills every one of them exactly once.
        with torch.device(device), _default_dtype(dtype):
            self.model = self.model_class(hf_config, spec)
            self.lm_head = None if self.tied else VocabEmbedding(hf_config.vocab_size, hf_config.hidden_size)

    @classmethod
    def decoder_spec(cls, cfg: Any) -> DecoderSpec:
        bias = bool(getattr(cfg, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
                           qk_norm=False, sliding_windows=(None,) * cfg.num_hidden_layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final hidden states [T, E]. embeds: (rows [R] int64, values [R, E]) to
        use instead of the token embeddings at those rows (a vision-language model's image features)."""
        return self.model(input_ids, positions, meta, embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, E] -> [N, vocab] float32."""
        return self.logits_head().logits(hidden)

    def logits_head(self) -> VocabEmbedding:
        """The table the logits are computed with: the LM head, or the embedding where they are tied."""
        return self.model.embed_tokens if self.lm_head is None else self.lm_head

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def pack_for_cpu(self, choices: ChoiceTable | None = None) -> None:
        """Switch every matmul to its CPU form (after load_weights; see layers.linear): bf16 and fp32 weights to the
        kernels measured fastest on this machine (choices, kernels/calibrate.py), the rest to oneDNN-blocked weights. A layer on
        block-quantized weights stays on them unless its measured choice is a bf16 kernel over the dequantized weight."""
        few: dict[int, tuple[object, int]] = {}  # id(module): (its blocks, up to how many rows they run)
        packed: dict[int, tuple[torch.Tensor, int]] = {}  # id(module): (its dequantized weight in bf16_pack's layout, rows)

        def choice(module: nn.Module, keep_plain: bool = False) -> OpChoice | None:
            if choices is None:
                return None
            blocks_op = calibrate.qblock_op(module)
            if blocks_op is not None:
                c = choices.ops.get(blocks_op)
                if c is None or c.kernel in ("blocks", "blocks_amx", "blocks_fma"):
                    module.qblocks.amx = c is not None and c.kernel == "blocks_amx"
                    # fp32 FMAs on the codes, else int8 activations where they run (the same for every batch)
                    module.qblocks.native.fma = c is not None and c.kernel == "blocks_fma"
                    module.qblocks.few_rows = c.few_rows if module.qblocks.amx else 0
                    if c is not None and c.amx8_rows is not None:  # measured: from how many rows AMX-INT8 runs
                        module.qblocks.native.amx8_rows = c.amx8_rows or calibrate.AMX8_NEVER
                    if c is not None and c.wide_rows is not None:  # measured: from how many rows codes widen once
                        module.qblocks.native.wide_rows = c.wide_rows or calibrate.WIDE_NEVER
                    return None
                if c.kernel == "amx" and c.few_rows:  # the blocks stay beside the bf16 weight, for a few rows
                    few[id(module)] = (module.qblocks.native, c.few_rows)
                n = module.qblocks.n
                w = calibrate.unblock(module, packed=c.kernel in native.BF16_PATHS and not keep_plain)
                if w is not None:
                    packed[id(module)] = (w, n)
                return c
            int8 = calibrate.w8a8_op(module) or calibrate.int8w_op(module)
            if int8 is not None:  # int8 weights: from how many rows its batches run on AMX-INT8 tiles (the same bits)
                if int8 in choices.ops:
                    module.amx8_rows = calibrate.int8_amx_rows(choices.ops[int8])
                return None
            return None if module.weight is None else choices.ops.get(calibrate.op_name(module.weight))

        def pack(module: nn.Module, c: OpChoice | None, **kw: bool) -> None:
            if id(module) in packed:
                weight, rows = packed.pop(id(module))
                module.matmul = MeasuredMatmul(weight, c, rows=rows)
            else:
                module.pack_for_cpu(choice=c, **kw)
            if id(module) in few and module.matmul is not None:
                module.matmul.few = few[id(module)]

        for module in self.modules():
            if isinstance(module, Linear):
                pack(module, choice(module))
        head = self.logits_head()
        tied = self.lm_head is None
        pack(head, choice(head, keep_plain=tied), keep_plain=tied)

    def quantize(self, method: str) -> None:
        """After load_weights. int8: weight-only int8 for every linear layer and the embedding / LM head.
        w8a8: int8 weights for the decoder's linear layers, which also quantize their inputs to int8 per token; the LM
        head gets weight-only int8 where kernels/cpu/packed_gemm.cpp runs (half the bytes a decode step reads there; SmolLM2-135M
        perplexity 6.7293 -> 6.7307 with an int8 cache, scripts/perplexity.py) and the embedding lookup stays in the
        model dtype (int8 activations in the LM head measured +0.5% perplexity, so it never takes those)."""
        for module in self.modules():
            if isinstance(module, Linear) and method == "w8a8":
                module.quantize_w8a8()
            elif isinstance(module, Linear) or (isinstance(module, VocabEmbedding) and method == "int8"):
                module.quantize_int8()
        head = self.logits_head()
        if method == "w8a8" and int8_packed_ok(head.weight):
            head.quantize_head_int8()

    @torch.no_grad()
    def init_dummy_weights(self, std: float, seed: int = 0) -> None:
        """Random weights in place of a checkpoint (load_format=dummy): matrices normal(0, std), as transformers
        initialises a fresh model, RMSNorm weights 1 and biases 0 (so activations keep a sane scale)."""
        generator = torch.Generator(device=next(self.parameters()).device).manual_seed(seed)
        for name, param in self.named_parameters():
            if param.dim() == 1:
                param.fill_(0.0 if name.endswith("bias") else 1.0)
            else:
                param.normal_(0.0, std, generator=generator)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from HF-named tensors; each must arrive exactly once with its shape."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, str | None]] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.tied and name == "lm_head.weight"):
                continue  # derived from the config / the same tensor as the embedding
            target, shard = self.fused_name(name)
            param = params.get(target)
            if param is None:
                raise ModelLoadError(f"unexpected tensor {name!r} in the checkpoint: {type(self).__name__} has "
                                     "no such parameter (does config.json match the weights?)")
            if (target, shard) in loaded:
                raise ModelLoadError(f"tensor {name!r} appears more than once in the checkpoint")
            try:
                param.weight_loader(param, tensor, shard)
            except ShapeMismatch as e:
                raise ModelLoadError(f"tensor {name!r}: {e}; config.json does not match the weights") from None
            loaded.add((target, shard))
        expected = {(n, s) for n, p in params.items() for s in p.shards
                    if not (self.headless and n == "lm_head.weight")}  # (models/loader.py: decoder_checkpoint)
        missing = sorted(self.checkpoint_name(n, s) for n, s in expected - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ModelLoadError(f"checkpoint is missing tensor(s): {shown}")

    def fused_name(self, name: str) -> tuple[str, str | None]:
        """A checkpoint tensor's name -> (our parameter's name, the shard it fills; None: all of it)."""
        return _fused_name(name)

    def checkpoint_name(self, param: str, shard: str | None) -> str:
        """The checkpoint name of a parameter's shard (fused_name's inverse), for what a checkpoint lacks."""
        return _checkpoint_name(param, shard)


def _fused_name(name: str) -> tuple[str, str | None]:
    for ckpt, ours, shard in _STACKED:
        if ckpt in name:
            return name.replace(ckpt, ours), shard
    return name, None


def _checkpoint_name(param: str, shard: str | None) -> str:
    for ckpt, ours, s in _STACKED:
        if s == shard and ours in param:
            return param.replace(ours, ckpt)
    return param
