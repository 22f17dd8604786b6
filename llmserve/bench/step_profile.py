"""Where an engine step's time goes: `bench throughput --profile-steps`.

The engine is instrumented from outside, by wrapping methods of its instances (scheduler, runner,
model layers, sampler) with wall-clock timers, so the engine itself carries no profiling code. Each
phase is timed exclusively: time spent in an inner timed call (a linear layer inside the model
forward) is counted there, not in the enclosing phase. The phases:

- schedule: the scheduler's decision (admission, block allocation, preemption);
- prepare inputs: flattening the batch, attention metadata, input tensors, the sampling batch;
- linear / decode attention / attention / other model ops: the forward pass, split by layer kind.
  Decode attention is the native paged decode kernel; attention is the rest of the attention layers
  (prefill attention, writing K/V to the cache, and decodes where the torch reference runs); other is
  embedding, norms, rotary, activation, residual adds;
- LM head: logits of the sampled rows;
- sampling: logits processors, choosing tokens, logprobs;
- grammar: structured output's share: masking the logits of constrained rows, gathering their masks into
  the step's bitmask, and advancing each constrained sequence's matcher by its new token (which fills the
  next mask);
- outputs: advancing the requests, detokenization, stop checks, building outputs;
- rest of step: the engine's step outside all of the above (session expiry, speculative drafts).

Decode steps that run in the native decoder stack (llmserve/models/decoder_stack.py) are split by the stack's own
timers (linear, decode attention, the K/V write as attention; norms, rotary and SiLU stay other model ops).

The wrappers cost about a microsecond per call, a few hundred per step, so the split is close to
an unprofiled run's; the benchmark's throughput line is measured in the same run, timers on.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict

from llmserve.attention.layer import Attention
from llmserve.bench.throughput import synchronize
from llmserve.engine.llm_engine import LLMEngine
from llmserve.kernels import native
from llmserve.layers.linear import Linear
from llmserve.sampling import batch as batch_module
from llmserve.sampling import sampler as sampler_module
from llmserve.sampling.sampler import Sampler
from llmserve.structured.matcher import GrammarState

# kernels/cpu/decoder_stack.cpp's timers, in its order, as phases here (None: its other ops, already other model ops)
STACK_PHASES = ("linear", "decode attention", "attention", None)
PHASES = ("schedule", "prepare inputs", "linear", "decode attention", "attention", "other model ops", "LM head",
          "sampling", "grammar", "outputs", "rest of step")


class StepProfile:
    def __init__(self, sync=None) -> None:
        # CUDA: a synchronize at both ends of each timed call, so asynchronous kernels are counted where they
        # were launched (the syncs slow the run itself down; read the split, not that run's throughput)
        self.sync = sync
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list] = []  # [phase, start, time taken by timed calls inside]
        self._undo: list[tuple[object, str, object]] = []  # module attributes to put back in restore()

    def wrap(self, obj: object, attr: str, phase: str) -> None:
        """Time every call of obj.attr as `phase` (exclusive of timed calls inside it)."""
        setattr(obj, attr, self.timed(getattr(obj, attr), phase))

    def timed(self, fn, phase: str):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self.sync is not None:
                self.sync()
            frame = [phase, time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                if self.sync is not None:
                    self.sync()
                self._stack.pop()
                took = time.perf_counter() - frame[1]
                self.seconds[phase] += took - frame[2]
                self.calls[phase] += 1
                if self._stack:
                    self._stack[-1][2] += took

        return timed

    def wrap_module_function(self, module: object, name: str, phase: str) -> None:
        """Like wrap, for a module-level function that others look up at call time; undone by restore()."""
        self._undo.append((module, name, getattr(module, name)))
        self.wrap(module, name, phase)

    def credit(self, phase: str, seconds: float) -> None:
        """Count seconds measured inside the current timed call (by native timers) as `phase` instead."""
        self.seconds[phase] += seconds
        if self._stack:
            self._stack[-1][2] += seconds

    def wrap_decoder_stack(self, model: object) -> None:
        """Time the native decoder stack's phases: its timers on for each call, their seconds credited."""
        run = model.run_decoder_stack

        def profiled(stack, *args):
            stack.set_profiling(True)
            try:
                return run(stack, *args)
            finally:
                for phase, seconds in zip(STACK_PHASES, stack.take_profile()):
                    if phase is not None:
                        self.credit(phase, seconds)

        model.run_decoder_stack = profiled

    def restore(self) -> None:
        for module, name, fn in reversed(self._undo):
            setattr(module, name, fn)
        self._undo.clear()

    def total(self) -> float:
        return sum(self.seconds.values())

    def rows(self) -> list[tuple[str, float, float]]:
        """(phase, seconds, share of the timed total), in PHASES order."""
        total = self.total() or 1.0
        return [(p, self.seconds.get(p, 0.0), self.seconds.get(p, 0.0) / total) for p in PHASES]

    def as_dict(self) -> dict:
        return {"steps": self.calls.get("rest of step", 0),
                "phases": {p: {"seconds": round(s, 6), "share": round(f, 6)} for p, s, f in self.rows()}}


def instrument(engine: LLMEngine) -> StepProfile:
    """Wrap the engine's parts in place; returns the profile that fills as the engine steps. The engine
    stays wrapped; the profile's restore() puts back the module-level function it wraps."""
    runner, model = engine.runner, engine.runner.model
    device = runner.device
    prof = StepProfile(sync=functools.partial(synchronize, device) if device.type == "cuda" else None)
    prof.wrap(engine, "step", "rest of step")
    prof.wrap(engine.scheduler, "schedule", "schedule")
    prof.wrap(engine, "_process", "outputs")
    prof.wrap(engine.scheduler, "update_after_step", "outputs")
    prof.wrap(runner, "execute", "prepare inputs")  # what execute does outside the calls below
    prof.wrap(model, "forward", "other model ops")
    prof.wrap(model, "compute_logits", "LM head")
    runner.sampler = _TimedSampler(runner.sampler, prof)
    prof.wrap_module_function(native, "paged_decode", "decode attention")
    prof.wrap_module_function(sampler_module, "apply_grammar_masks", "grammar")
    prof.wrap_module_function(batch_module, "_grammar_masks", "grammar")
    prof.wrap_module_function(GrammarState, "accept", "grammar")
    prof.wrap_module_function(GrammarState, "masks_with_drafts", "grammar")
    for module in model.modules():
        if hasattr(module, "run_decoder_stack"):
            prof.wrap_decoder_stack(module)
        if isinstance(module, Linear):
            prof.wrap(module, "forward", "linear")
        elif isinstance(module, Attention):
            prof.wrap(module, "forward", "attention")
    return prof


class _TimedSampler:
    """The runner calls its sampler (`sampler(logits, batch)`, `sampler.verify(...)`): a special method
    cannot be wrapped on an instance, so the sampler is wrapped whole."""

    def __init__(self, sampler: Sampler, prof: StepProfile) -> None:
        self._sampler = sampler
        self._call = prof.timed(sampler.__call__, "sampling")
        self.verify = prof.timed(sampler.verify, "sampling")

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._sampler, name)


def format_profile(prof: StepProfile) -> str:
    steps = prof.calls.get("rest of step", 0)
    lines = [f"step time split ({steps} steps, {prof.total():.2f} s):"]
    for phase, seconds, share in prof.rows():
        lines.append(f"  {phase:<18}{seconds:>9.2f} s{100 * share:>7.1f}%{1000 * seconds / max(steps, 1):>9.2f} ms/step")
    return "\n".join(lines)
