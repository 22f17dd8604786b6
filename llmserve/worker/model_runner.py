"""Runs one scheduled step: flatten the batch, run the model over the paged cache, sample.

The runner owns the device side: the model, the KV-cache tensors (one per layer, bound to the
attention layers) and the sampler. It never decides what to run; the scheduler does.
"""

from __future__ import annotations

import logging
import math
import mmap
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmserve.attention import SeqSpec, build_attention_metadata, registry
from llmserve.attention.metadata import Workspace
from llmserve.engine.pooling import Pooling
from llmserve.engine.request import Request
from llmserve.engine.scheduler import ScheduledRequest
from llmserve.errors import InvalidRequestError
from llmserve.kernels import calibrate
from llmserve.kernels.choice import ChoiceTable
from llmserve.models.loader import LoadedModel
from llmserve.sampling.logprobs import TokenLogprobs, logprob_parts, logprobs_of_logits, token_logprobs
from llmserve.sampling.sampler import Sampler, SamplerOutput, SamplingBatch, SequenceState
from llmserve.vl.inputs import ImageItem, MRopePositions
from llmserve.worker.cpu_tuning import configure_cpu, trim_heap, use_onednn

if TYPE_CHECKING:
    from llmserve.distributed.workers import TPWorkers
    from llmserve.lora import LoRAAdapter, LoRAManager
    from llmserve.worker.cuda_graphs import CudaGraphDecoder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # int8: quantized, with one fp32 scale per token, head and K/V; uint8: int4, two values a byte (rows of
    # head_dim / 2), with an fp16 scale and zero point each (torch_backend.quantize_int4)
    dtype: torch.dtype

    @property
    def quantized(self) -> bool:
        return self.dtype in (torch.int8, torch.uint8)

    @property
    def row(self) -> int:
        """The last dimension of the cache: head_dim elements, or head_dim / 2 bytes of packed int4."""
        return self.head_dim // 2 if self.dtype == torch.uint8 else self.head_dim

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """What each row's scale tensor adds to [2, num_blocks, block_size, kv_heads]: int4's (scale, zero)."""
        return (2,) if self.dtype == torch.uint8 else ()

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float16 if self.dtype == torch.uint8 else SCALE_DTYPE

    @property
    def bytes_per_token(self) -> int:
        row = self.row * self.dtype.itemsize
        if self.quantized:
            row += math.prod(self.scale_shape) * self.scale_dtype.itemsize
        return 2 * self.num_layers * self.num_kv_heads * row


SCALE_DTYPE = torch.float32  # of int8 caches


@dataclass(frozen=True)
class CpuOptions:
    """How the runner sets up a CPU: torch's threads (None: default_num_threads) and the kernel choice (auto: measured
    on this machine, or pins such as "bf16_linear=fma"; kernels/choice.py)."""

    num_threads: int | None = None
    kernel_choice: str | None = None
    rows: calibrate.RowLimits = calibrate.RowLimits()  # the batch sizes the kernels are timed at (the engine's limits)


@dataclass(frozen=True)
class GraphOptions:
    """CUDA graphs of decode steps (worker/cuda_graphs.py): whether to capture, and for what."""

    enabled: bool = False
    max_batch_size: int = 128
    max_tokens_per_seq: int = 0  # the longest context a request can reach (its block table's width)


@dataclass
class InFlight:
    """A decode step launched with async scheduling (`ModelRunner.launch`) whose tokens the host has not read yet."""

    tokens: torch.Tensor  # [n] int64 on the device: where the next step takes its inputs from
    host: torch.Tensor  # [n] int64 on the host (pinned with CUDA), filled by a copy queued after the step
    done: torch.cuda.Event | None  # recorded after the copies; None where the step ran synchronously (CPU)
    # the rows asking for logprobs, their top-N counts and logprob_parts' tensors (copied to the host with CUDA)
    logprob_rows: tuple[int, ...] = ()
    num_top: tuple[int, ...] = ()
    parts: tuple[torch.Tensor, ...] = ()
    _result: tuple[list[int], list[TokenLogprobs | None]] | None = None

    def result(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The step's tokens and logprobs (None where not asked), in its requests' order: waits for the step."""
        if self._result is None:
            self._result = self._read()
        return self._result

    def _read(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        if self.done is not None:
            self.done.synchronize()
        tokens = self.host.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(tokens)
        if self.logprob_rows:
            chosen = torch.tensor([tokens[i] for i in self.logprob_rows])
            for i, lp in zip(self.logprob_rows, token_logprobs(chosen, *self.parts, list(self.num_top)), strict=True):
                logprobs[i] = lp
        return tokens, logprobs


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int,
                 cpu: CpuOptions | None = None, kv_cache_dtype: str = "auto",
                 graphs: GraphOptions | None = None) -> None:
        # the measured (or cached, or pinned) kernels of bf16 and fp32 matmuls (and bf16 attention)
        self.kernel_choices: ChoiceTable | None = None
        # native prefill and decode attention by AVX512-BF16 dot products: their measured kernels (else fp32 FMAs)
        self.prefill_kernel, self.decode_dot = "fp32", False
        if loaded.device.type == "cpu":
            cpu = cpu or CpuOptions()
            threads = configure_cpu(cpu.num_threads)
            if use_onednn(loaded):
                self.kernel_choices = calibrate.plan(loaded.model, threads, cpu.kernel_choice, dtype=loaded.dtype,
                                                     rows=cpu.rows)
                if self.kernel_choices is not None:
                    logger.info("kernel choice: %s", self.kernel_choices.describe())
                    if not self.kernel_choices.reused:
                        trim_heap()  # the candidates' temporaries
                loaded.model.pack_for_cpu(self.kernel_choices)
                if self.kernel_choices is not None:  # None: fp32 FMAs, the only path here
                    self.prefill_kernel = self._attention_kernel(loaded, calibrate.PREFILL_ATTENTION)
                    self.decode_dot = self._attention_kernel(loaded, calibrate.DECODE_ATTENTION) == "dot"
        self.model = loaded.model
        self.device = loaded.device
        self.mrope = bool(getattr(self.model, "mrope", False))  # 3-row rotary positions (models/qwen2_vl.py)
        self.vocab_size = loaded.hf_config.vocab_size
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.sampler = Sampler()
        self.workspace = Workspace()  # decode gather buffers, reused across steps
        spec = cache_spec(loaded, kv_cache_dtype)
        layers = self.model.attention_layers()
        # graphs need the Triton decode kernel: its shapes follow the batch, the torch reference's the contexts; and a
        # model that reads nothing back to the host within a step (not MoE's grouping by expert: graph_capturable)
        use_graphs = (graphs is not None and graphs.enabled and getattr(self.model, "graph_capturable", True)
                      and registry.triton_decode_covers(self.device, spec.head_dim, loaded.dtype, spec.dtype))
        # CUDA graphs: one more block, never allocated, where the padding rows of a captured batch write
        shape = (len(layers), 2, num_blocks + use_graphs, block_size, spec.num_kv_heads)
        pool = zeroed((*shape, spec.row), spec.dtype, self.device)
        scales = (zeroed((*shape, *spec.scale_shape), spec.scale_dtype, self.device) if spec.quantized
                  else [None] * len(layers))
        for layer, cache, scale in zip(layers, pool, scales):
            layer.kv_cache = cache  # [2, num_blocks, block_size, kv_heads, head_dim], contiguous
            layer.kv_scales = scale  # [2, num_blocks, block_size, kv_heads(, 2 for int4)] or None
        self.lora: LoRAManager | None = None  # the engine's, when LoRA adapters are enabled
        self.tp_workers: TPWorkers | None = None  # tp > 1: the other ranks run every forward and block copy too
        self.graphs: CudaGraphDecoder | None = None
        if use_graphs:
            from llmserve.worker.cuda_graphs import CudaGraphDecoder

            assert graphs is not None
            self.graphs = CudaGraphDecoder(self.model, self.device, block_size,
                                           -(-graphs.max_tokens_per_seq // block_size), num_blocks,
                                           graphs.max_batch_size, spec.num_kv_heads)
            self._warm_up_mixed_step(num_blocks)

    def _warm_up_mixed_step(self, scratch_block: int) -> None:
        """One eager step of a decode row and a two-token prefill chunk over the graphs' scratch block, so that the
        Triton kernels an eager step runs (prefill attention, the fused elementwise ops) compile at start, not in the
        first requests' steps: Triton compiles each new variant on first use. Measured on an H100 (64-request
        benchmark, BENCHMARKS.md): with variants still compiling mid-run a first process took 3.39 s against 2.05 s
        for a later one; with this warm-up and one variant per kernel (attention/metadata.py), 1.72 s, as later ones."""
        start = time.perf_counter()
        self._forward([Span([0], 0, [scratch_block], 1), Span([0, 0], 0, [scratch_block], 1)])
        torch.cuda.synchronize(self.device)
        logger.info("warmed up an eager mixed step in %.1f s", time.perf_counter() - start)

    def _attention_kernel(self, loaded: LoadedModel, kind: str) -> str:
        """The measured kernel of the model's `kind` attention op (fp32, dot, amx), fp32 where none was chosen."""
        choice = self.kernel_choices.ops.get(calibrate.attention_op(loaded.model, kind, loaded.dtype) or "")
        return choice.kernel if choice is not None else "fp32"

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest], block_tables: list[list[int]]) -> SamplerOutput:
        """Run one step. Returns one sampled token per scheduled request whose `samples` is true, in
        scheduled order; a request carrying draft tokens gets one row per draft plus one (see
        `Sampler.verify`). Decode (single-token) requests must come first."""
        spans: list[Span] = []
        states: list[SequenceState] = []
        drafts: list[int] = []
        for s, table in zip(scheduled, block_tables):
            r, start = s.request, s.request.num_computed_tokens
            num_real = s.num_new_tokens - len(s.draft_token_ids)
            samples = s.samples and r.pooling is None  # (an embedding's last step pools instead)
            spans.append(Span(r.token_ids[start:start + num_real] + list(s.draft_token_ids), start, table,
                              1 + len(s.draft_token_ids) if samples else 0, _prompt_logprobs(r, start, num_real),
                              _image_rows(r, start, num_real), r.mm.mrope if r.mm is not None else None, r.lora,
                              r.pooling))
            if samples:
                masks = r.grammar.masks_with_drafts(s.draft_token_ids) if r.grammar is not None else None
                for i in range(len(s.draft_token_ids) + 1):
                    states.append(_sequence_state(r, s.draft_token_ids[:i], None if masks is None else masks[i]))
                    drafts.append(s.draft_token_ids[i] if i < len(s.draft_token_ids) else -1)
        logits = self.forward(spans)
        if logits is None:
            return SamplerOutput([], [])
        batch = SamplingBatch.build(states, self.vocab_size, self.device)
        if any(d >= 0 for d in drafts):
            return self.sampler.verify(logits, batch, drafts)
        return self.sampler(logits, batch)

    @torch.inference_mode()
    def launch(self, requests: list[Request], positions: list[int], block_tables: list[list[int]],
               prev: tuple[InFlight, list[int]] | None = None, known: list[int] | None = None,
               prompts: list[tuple[Request, int, list[int]]] = ()) -> InFlight:
        """Async scheduling (engine: LLMEngine._launch): one decode step of `requests`, a token each at positions[i],
        sampled on the device and not read back, so the host can prepare the next step while this one runs. The
        tokens are each request's at its position; with `prev` (a step in flight, rows), request i's is that step's
        token of row rows[i]. `known`: those tokens, where the host has read them, for requests whose sampling reads
        their output (penalties, bad words and min_tokens count them as generated; a grammar's mask follows them). Not
        for beams. Logprobs are computed here and copied back with the tokens.
        `prompts` (request, n, block table): requests that start in this step, computing the last n tokens of their
        prompt (the rest is cached) and sampling their first token, after the decodes' rows (single-token ones
        first, as `forward` requires); such a step runs eagerly."""
        n = len(requests)
        ids = [0] * n if prev is not None else [r.token_ids[p] for r, p in zip(requests, positions)]
        mrope = [r.mm.mrope if r.mm is not None else None for r in requests]  # a decode is past every image
        # (adapters run eagerly, as in execute: the graphs hold the base model's layers only)
        if (self.graphs is not None and not prompts and all(r.lora is None for r in requests)
                and self.graphs.fits(n, max(len(t) for t in block_tables))):
            deltas = [m.delta if m is not None else 0 for m in mrope] if self.mrope else None
            logits = self.graphs.run(ids, positions, block_tables, deltas,
                                     prev=None if prev is None else (prev[0].tokens, prev[1]))
        else:
            on_device = None
            if prev is not None:
                # (int64 even when empty: a step whose decodes all left, only new prompts, gives no rows)
                rows = torch.tensor(prev[1], dtype=torch.long, device=prev[0].tokens.device)
                on_device = prev[0].tokens.index_select(0, rows)
            spans = [Span([i], p, t, 1, mrope=m, lora=r.lora) for i, p, t, m, r in
                     zip(ids, positions, block_tables, mrope, requests, strict=True)]
            for r, num, table in prompts:
                start = r.num_tokens - num
                spans.append(Span(r.token_ids[start:], start, table, 1, lora=r.lora))
            logits = self._forward(spans, on_device)
        assert logits is not None
        states = [_state_ahead(r, None if known is None else known[i]) for i, r in enumerate(requests)]
        for r, _, _ in prompts:  # nothing generated yet: a grammar's first mask
            states.append(_sequence_state(r, (), None if r.grammar is None else r.grammar.masks_with_drafts(())[0]))
        requests = [*requests, *(r for r, _, _ in prompts)]
        batch = SamplingBatch.build(states, self.vocab_size, self.device)
        raw = None if batch.logprob_rows is None else logits.index_select(0, batch.logprob_rows)  # before processing
        tokens = self.sampler.choose(logits, batch)
        rows = tuple(i for i, r in enumerate(requests) if r.sampling.logprobs is not None)
        num_top = tuple(requests[i].sampling.logprobs for i in rows)
        parts = () if raw is None else logprob_parts(raw, tokens.index_select(0, batch.logprob_rows),
                                                     min(max(num_top), raw.shape[-1]))
        if tokens.device.type != "cuda":  # (the CPU: only in tests, which force it on; the same path but the copies)
            return InFlight(tokens, tokens, None, rows, num_top, parts)
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                for t in (tokens, *parts)]
        done = torch.cuda.Event()
        done.record()
        return InFlight(tokens, host[0], done, rows, num_top, tuple(host[1:]))

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks, source -> destination, in every layer (copy-on-write of forked beams)."""
        if not pairs:
            return
        if self.tp_workers is not None:
            self.tp_workers.copy_blocks(pairs)
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for layer in self.model.attention_layers():
            layer.kv_cache[:, dst] = layer.kv_cache[:, src]
            if layer.kv_scales is not None:
                layer.kv_scales[:, dst] = layer.kv_scales[:, src]

    @torch.inference_mode()
    def forward(self, spans: list[Span]) -> torch.Tensor | None:
        """Run the model over each span's tokens (K/V written to the span's blocks) and return the
        logits of the last `num_logits` tokens of every span, in span order: [sum num_logits, V].
        Single-token spans must come first."""
        if self.tp_workers is not None:
            self.tp_workers.forward(spans)
            try:
                return self._forward(spans)
            except Exception as e:  # the ranks are out of step after a failure inside a forward: nothing can go on
                raise self.tp_workers.failed(e) from e
        return self._forward(spans)

    def _forward(self, spans: list[Span], decode_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """decode_ids: the ids of the first len(decode_ids) spans (single tokens), on the device (async scheduling);
        their spans' token_ids are not read."""
        if decode_ids is None and self.graphs is not None and self._graph_step(spans):
            # M-RoPE: a decode's token is past every image (a sampled token with no image rows is the last of
            # its sequence), so its three rows are equal, start + delta: plain rotary there
            deltas = [span.mrope.delta if span.mrope is not None else 0 for span in spans] if self.mrope else None
            return self.graphs.run([span.token_ids[0] for span in spans], [span.start for span in spans],
                                   [span.block_table for span in spans], deltas)
        input_ids: list[int] = []
        positions: list[int] = []
        seqs: list[SeqSpec] = []
        logit_rows: list[int] = []
        image_rows: list[tuple[int, ImageRows]] = []  # (batch row of the span's sequence position 0, its image rows)
        for span in spans:
            image_rows.extend((len(input_ids) - span.start, rows) for rows in span.images)
            input_ids.extend(span.token_ids)
            positions.extend(range(span.start, span.start + len(span.token_ids)))
            seqs.append(SeqSpec(span.start, len(span.token_ids), span.block_table))
            logit_rows.extend(range(len(input_ids) - span.num_logits, len(input_ids)))
        meta = build_attention_metadata(seqs, self.block_size, self.device, self.workspace)
        meta.prefill_kernel, meta.decode_dot = self.prefill_kernel, self.decode_dot
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        if decode_ids is not None:
            ids[:len(decode_ids)] = decode_ids
        if self.mrope:
            pos = _mrope_positions(spans, positions).to(self.device)
        else:
            pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        embeds = self._image_embeds(image_rows) if image_rows else None
        if self.lora is not None:
            with self.lora.stepping([span.lora for span in spans], [len(span.token_ids) for span in spans]):
                hidden = self.model(ids, pos, meta, embeds) if embeds is not None else self.model(ids, pos, meta)
        else:
            hidden = self.model(ids, pos, meta, embeds) if embeds is not None else self.model(ids, pos, meta)
        self._prompt_logprobs(hidden, spans)
        self._pool(hidden, spans)
        if not logit_rows:
            return None
        return self.model.compute_logits(hidden[torch.tensor(logit_rows, device=self.device)])

    def _image_embeds(self, image_rows: list[tuple[int, ImageRows]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch rows, features) of the image placeholders this step computes: the vision encoder runs first, in one
        batched pass over the step's images that its cache does not hold."""
        features = self.model.embed_images([r.item for _, r in image_rows])
        rows, values = [], []
        for (offset, r), feats in zip(image_rows, features):
            rows.extend(offset + p for p in r.item.positions[r.j0:r.j1])
            values.append(feats[r.j0:r.j1])
        return torch.tensor(rows, dtype=torch.long, device=self.device), torch.cat(values).to(self.device)

    def _prompt_logprobs(self, hidden: torch.Tensor, spans: list[Span]) -> None:
        """Fill the prompt logprobs the spans ask for, from the step's hidden states: the LM head and logprobs over
        PROMPT_LOGPROB_ROWS rows at a time, so a long prefill chunk never holds its [tokens, V] logits at once."""
        offset = 0
        for span in spans:
            task = span.prompt_logprobs
            if task is not None:
                for lo in range(0, len(task.rows), PROMPT_LOGPROB_ROWS):
                    rows = task.rows[lo:lo + PROMPT_LOGPROB_ROWS]
                    index = torch.tensor([offset + i for i in rows], device=self.device)
                    logits = self.model.compute_logits(hidden[index]).float()
                    targets = torch.tensor(task.targets[lo:lo + PROMPT_LOGPROB_ROWS], device=self.device)
                    for pos, lp in zip(rows, logprobs_of_logits(logits, targets, [task.num_top] * len(rows))):
                        task.sink[span.start + pos + 1] = lp
            offset += len(span.token_ids)

    @staticmethod
    def _pool(hidden: torch.Tensor, spans: list[Span]) -> None:
        """Hand each embedding's span its rows of the step's final hidden states (engine/pooling.py)."""
        offset = 0
        for span in spans:
            if span.pooling is not None:
                span.pooling.add(hidden[offset:offset + len(span.token_ids)], span.start)
            offset += len(span.token_ids)

    def _graph_step(self, spans: list[Span]) -> bool:
        """Whether a captured graph runs this step: decodes only (one token, its logits), within the sizes."""
        assert self.graphs is not None
        # (a step with image rows or LoRA adapters runs eagerly: the graph's inputs are token ids, not image
        # features, and its layers run without the adapters' hooks)
        return (bool(spans) and all(len(s.token_ids) == 1 and s.num_logits == 1 and not s.images and s.lora is None
                                    for s in spans)
                and self.graphs.fits(len(spans), max(len(s.block_table) for s in spans)))


@dataclass(frozen=True)
class PromptLogprobTask:
    """Prompt logprobs a span computes: at each of `rows` (offsets in the span), the logprob of the next prompt
    token (`targets`), written to sink[start + row + 1]."""

    rows: list[int]
    targets: list[int]
    num_top: int
    sink: list  # Request.prompt_logprobs


@dataclass(frozen=True)
class Span:
    """Tokens of one sequence to run at positions start.. over its blocks; keep the last num_logits logits."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    num_logits: int
    prompt_logprobs: PromptLogprobTask | None = None
    images: tuple[ImageRows, ...] = ()  # image placeholders among the span's tokens
    mrope: MRopePositions | None = None  # an M-RoPE model's request with images: its prompt's 3-D positions
    lora: LoRAAdapter | None = None  # the sequence's LoRA adapter (None: the base model)
    pooling: Pooling | None = None  # an embedding request's: the span's final hidden states go to it


@dataclass(frozen=True, eq=False)
class ImageRows:
    """An image's feature rows [j0, j1) that go to placeholders this span computes."""

    item: ImageItem
    j0: int
    j1: int


def _image_rows(r: Request, start: int, num_real: int) -> tuple[ImageRows, ...]:
    if r.mm is None or start >= r.num_prompt_tokens:
        return ()
    out = []
    for item in r.mm.images:
        j0, j1 = item.rows_in(start, start + num_real)
        if j0 < j1:
            out.append(ImageRows(item, j0, j1))
    return tuple(out)


def _mrope_positions(spans: list[Span], positions: list[int]) -> torch.Tensor:
    """An M-RoPE model's step positions [3, T] (positions: the tokens' sequence indices): a prompt's own 3-D positions
    where its spans cover its prompt, sequence index + delta in all three rows after it, and the sequence index in
    all three for a request without images."""
    shifted = list(positions)
    prompt_parts: list[tuple[int, torch.Tensor]] = []  # (first batch column, the prompt's positions [3, n] there)
    column = 0
    for span in spans:
        m, n = span.mrope, len(span.token_ids)
        if m is not None:
            for i in range(column, column + n):
                shifted[i] += m.delta
            if span.start < m.prompt.shape[1]:
                prompt_parts.append((column, m.prompt[:, span.start:span.start + n]))
        column += n
    pos = torch.tensor(shifted, dtype=torch.long).expand(3, -1).contiguous()
    for column, part in prompt_parts:
        pos[:, column:column + part.shape[1]] = part
    return pos


# Rows of prompt logprobs computed together: [256, V] fp32 logits is 50 MB at a 49k vocabulary.
PROMPT_LOGPROB_ROWS = 256


def _prompt_logprobs(r: Request, start: int, num_real: int) -> PromptLogprobTask | None:
    """The prompt positions this step computes whose next token is a prompt token (the last prompt position's
    logits are the first sampled token's)."""
    if r.prompt_logprobs is None:
        return None
    end = min(start + num_real, r.num_prompt_tokens - 1)
    if end <= start:
        return None
    return PromptLogprobTask(list(range(end - start)), r.token_ids[start + 1:end + 1], r.sampling.prompt_logprobs or 0,
                             r.prompt_logprobs)


def _state_ahead(r: Request, token: int | None) -> SequenceState:
    """Async scheduling: a request's sampling state for the step after the one in flight, which samples `token` (None:
    no step in flight, or one whose token the request's sampling does not read). The token counts as generated, and
    a grammar's mask is the one after it (the matcher accepts it for the mask and rolls back: the engine accepts it
    when it reads the step). A token the grammar refuses (a NaN row) ends the request when its step is read: the
    mask does not matter then."""
    mask = None
    if r.grammar is not None:
        valid = token is not None and r.grammar.valid_prefix([token]) == [token]
        mask = r.grammar.masks_with_drafts((token,))[1] if valid else r.grammar.masks_with_drafts(())[0]
    return _sequence_state(r, () if token is None else (token,), mask)


def _sequence_state(r: Request, drafts: tuple[int, ...] = (), token_mask: torch.Tensor | None = None) -> SequenceState:
    # A draft row sees the drafts before it as generated (penalties, bans and min_tokens count them), and its
    # grammar mask is the one after them.
    output = r.output_token_ids + list(drafts) if drafts else r.output_token_ids
    return SequenceState(params=r.sampling, prompt_token_ids=r.prompt_token_ids,
                         output_token_ids=output, generator=r.generator, token_mask=token_mask)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zero-filled memory for the KV pool. Zeros, not garbage: the torch decode path reads padded
    slots under a -inf mask, and those must be finite (NaN * 0 is NaN inside softmax).

    On CPU it is an anonymous mapping: pages the OS maps, already zero, on first touch, so start-up does
    not write the whole pool (measured: ~1 s for the default 2 GiB) and the pool becomes resident as it is
    used. Shared (Python's mmap default), so 4 KiB pages: a private mapping with MADV_HUGEPAGE does get
    transparent huge pages, and decode attention read them ~10% faster (28-30 against 30-34 ms per step,
    64 requests, int8 KV), but faulting each 2 MiB page in (zeroing, and compacting memory to find one)
    cost more than that on a pool's first use: 2.0 s of prefill attention against 1.2 in a 64-request
    run, 3% slower overall, and a stall of milliseconds for the request that touches a new page."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def cache_spec(loaded: LoadedModel, kv_cache_dtype: str = "auto") -> CacheSpec:
    """kv_cache_dtype: "auto" (the model's dtype), a torch dtype name, int8 included, or int4 (stored as uint8,
    two values a byte) (EngineConfig.kv_cache_dtype)."""
    layers = loaded.model.attention_layers()
    head_dim = layers[0].head_dim
    if kv_cache_dtype == "int4":
        if head_dim % 2:
            raise InvalidRequestError(f"kv_cache_dtype: int4 packs head_dim in pairs; this model's is {head_dim} "
                                      "(use int8)", param="kv_cache_dtype")
        dtype = torch.uint8
    else:
        dtype = loaded.dtype if kv_cache_dtype == "auto" else getattr(torch, kv_cache_dtype)
    return CacheSpec(len(layers), layers[0].num_kv_heads, head_dim, dtype)


def num_blocks_for(loaded: LoadedModel, block_size: int, cache_max_bytes: int | None,
                   cache_max_entry_count: float, draft: LoadedModel | None = None,
                   kv_cache_dtype: str = "auto") -> int:
    """KV blocks that fit the budget: a byte budget on CPU, a fraction of free memory on GPU. A draft
    model keeps a cache of the same blocks, so it shares the budget."""
    per_token = cache_spec(loaded, kv_cache_dtype).bytes_per_token
    per_token += cache_spec(draft, kv_cache_dtype).bytes_per_token if draft else 0
    per_block = per_token * block_size
    if loaded.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(loaded.device)
        budget = int(free * cache_max_entry_count) if cache_max_bytes is None else cache_max_bytes
    else:
        budget = cache_max_bytes if cache_max_bytes is not None else default_cpu_cache_bytes()
    return max(1, budget // per_block)


def default_cpu_cache_bytes() -> int:
    """A quarter of available RAM, at most 2 GiB (the whole pool becomes resident once it is used)."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        available = info.get("MemAvailable", 8 << 30)
    except OSError:
        available = 8 << 30
    return min(available // 4, 2 << 30)
