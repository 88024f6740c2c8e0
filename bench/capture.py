"""Hidden-state capture throughput on the embedded target, as a share of the fp32 matmul peak.

    python -m bench.capture [--num-conversations 32] [--rounds 3] [--batch-tokens 1024[,2048...]]

Modes, each a pass over the same ShareGPT samples (max_length 512) in capture's own batches
(``plan_batches``: longest first, right-padded, ``--batch-tokens`` padded tokens a forward):

* ``eager``: ``capture_samples`` = target forwards (no logits) + copies into the storage dtype
* ``compiled``: the same with ``compile=True`` (torch.compile; its one-off compilation is timed
  separately and not in the rates)
* ``disk``: ``capture_offline`` into a fresh temp dir (compiled unless ``--no-compile``): +
  data fingerprint, safetensors write, fsync, sha256, manifest
* ``hf``: plain HF ``model(input_ids, attention_mask)`` forwards (with logits) on the same batches

The machine is shared with other jobs whose load comes and goes within seconds, so a peak
measured once per round can land in a busier or quieter moment than the pass it divides.
Instead a short fp32 matmul peak window (bench/machine.py) runs before every batch, and

* ``% peak`` = sum of the batches' FLOPs / sum of (batch seconds x the peak measured right
  before it): useful work over what the matmul units did deliver around the same moments;
* ``best/best`` = the fastest batch's FLOP rate / the best peak window of the pass: both are
  estimates of the uncontended machine (interference only ever slows a window down).
The disk pass is timed as a whole (its writes are per shard) against the peaks before and after.
The run also reports how much CPU other processes took meanwhile.

FLOPs per token counted (decoder layers only, the useful work of a capture):
    2 * (weights of every nn.Linear in the decoder layers)
  + 4 * layers * heads * head_dim * (n + 1) / 2    (causal QK^T and PV for a sample of n
                                                    tokens, per token; padding not counted)
Not counted: embedding lookup, norms, RoPE, softmax, SiLU and the lm_head (HF computes it,
capture does not; counting the same work for both keeps their "% of peak" comparable).
A closing profiler pass shows where capture's time goes (matmul / attention / the rest).
The command and the table rewrite BENCHMARKS.md's "Hidden-state capture throughput" section
(the section it replaces moves to bench/HISTORY.md).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.machine import cpu_name, measure_fp32_peak
from bench.sections import append_benchmarks

from draftlab.data.capture import resolve_layers
from draftlab.data.offline import STORAGE_DTYPES, capture_offline, capture_samples, plan_batches

REPO = Path(__file__).resolve().parent.parent
PEAK_WINDOW_S = 0.3  # before every batch: 3 shapes x 0.1 s
MODES = {"eager": "capture (eager)", "compiled": "capture (compile)", "disk": "capture to disk", "hf": "HF model()"}


def decoder_flops(target, n: int) -> tuple[float, float]:
    """(linear, attention) decoder FLOPs of one sample of ``n`` tokens (formula above)."""
    layers = target.model.model.layers
    linear_weights = sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))
    c = target.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2.0 * linear_weights * n, 4.0 * c.num_hidden_layers * c.num_attention_heads * head_dim * n * (n + 1) / 2


class Machine:
    """CPU seconds used by other processes between ``start`` and ``stop`` (Linux /proc/stat)."""

    @staticmethod
    def _busy() -> float:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except OSError:
            return float("nan")
        idle = fields[3] + fields[4]
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def start(self):
        self.t0, self.busy0, self.own0 = time.perf_counter(), self._busy(), self._own()
        return self

    def stop(self) -> str:
        wall = time.perf_counter() - self.t0
        busy, own = self._busy() - self.busy0, self._own() - self.own0
        cores = os.cpu_count() or 1
        return (f"during the timed passes other processes used {max(0.0, busy - own):.0f} CPU-s of "
                f"{wall * cores:.0f} available ({100 * max(0.0, busy - own) / (wall * cores):.0f}% of {cores} cores), "
                f"this run {own:.0f} CPU-s")


def run_batches(steps, peak_s: float) -> dict:
    """``steps``: list of (callable, tokens, flops). Peak window before each step."""
    recs = []
    for fn, tokens, flops in steps:
        peak = measure_fp32_peak(peak_s, windows=1)
        t0 = time.perf_counter()
        fn()
        recs.append((tokens, flops, time.perf_counter() - t0, peak))
    return summarize(recs)


def summarize(recs) -> dict:
    tokens = sum(r[0] for r in recs)
    secs = sum(r[2] for r in recs)
    return {
        "tok_s": tokens / secs,
        "share": 100.0 * sum(r[1] for r in recs) / sum(r[2] * r[3] for r in recs),
        "best": 100.0 * max(r[1] / r[2] for r in recs) / max(r[3] for r in recs),
        "peak": statistics.median(r[3] for r in recs),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="default")
    p.add_argument("--num-conversations", type=int, default=32)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--layers", default="eagle3")
    p.add_argument("--dtype", default="bfloat16", choices=tuple(STORAGE_DTYPES))
    p.add_argument("--batch-tokens", default="1024", help="comma-separated values to compare")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd capture")
    p.add_argument("--no-hf", action="store_true", help="skip the HF model() comparison")
    p.add_argument("--no-profile", action="store_true", help="skip the profiler breakdown")
    p.add_argument("--no-append", action="store_true", help="print only, do not rewrite this benchmark's section of BENCHMARKS.md")
    args = p.parse_args(argv)

    from draftlab.data.dataset import DataSpec, build_samples
    from draftlab.models.target import Target

    target = Target.load(args.target)
    spec = DataSpec(source="sharegpt", num_conversations=args.num_conversations, max_length=args.max_length, heldout=0)
    samples = build_samples(spec, target.tokenizer).train
    lengths = [s["input_ids"].numel() for s in samples]
    tokens = sum(lengths)
    layers = resolve_layers(args.layers, target.num_layers)
    dtype = STORAGE_DTYPES[args.dtype]
    flops = {i: sum(decoder_flops(target, n)) for i, n in enumerate(lengths)}
    lin = sum(decoder_flops(target, n)[0] for n in lengths) / tokens
    att = sum(decoder_flops(target, n)[1] for n in lengths) / tokens
    batch_sizes = [int(b) for b in args.batch_tokens.split(",")]
    compiled = not args.no_compile
    notes = [f"{len(samples)} ShareGPT samples, {tokens} tokens (mean {tokens / len(samples):.0f}, "
             f"{sum(n == args.max_length for n in lengths)} at max_length {args.max_length})",
             f"{(lin + att) / 1e6:.1f} M decoder FLOPs/token = {lin / 1e6:.1f} M linear + {att / 1e6:.1f} M causal attention"]
    print("; ".join(notes) + f"; {torch.get_num_threads()} threads", flush=True)

    capture_samples(target, samples[:4], layers, dtype, batch_sizes[0])  # warm-up (allocator, thread pool)
    if compiled:
        t0 = time.perf_counter()
        for bt in batch_sizes:  # the dynamic graph, then the batch-of-1 specialisation
            capture_samples(target, samples[:4], layers, dtype, bt, compile=True)
            capture_samples(target, samples[:1], layers, dtype, bt, compile=True)
        notes.append(f"torch.compile warm-up {time.perf_counter() - t0:.0f} s (once per process, not in the rates)")
        print(notes[-1], flush=True)

    rows = []
    machine = Machine().start()
    for r in range(args.rounds):
        for bt in batch_sizes:
            plan = plan_batches(lengths, bt)
            row = {"round": r + 1, "batch_tokens": bt}

            def capture_steps(compile_):
                return [(lambda b=b: capture_samples(target, [samples[i] for i in b], layers, dtype, bt, compile=compile_),
                         sum(lengths[i] for i in b), sum(flops[i] for i in b)) for b in plan]

            row["eager"] = run_batches(capture_steps(False), PEAK_WINDOW_S)
            if compiled:
                row["compiled"] = run_batches(capture_steps(True), PEAK_WINDOW_S)
            row["disk"] = time_disk(target, samples, layers, args.dtype, bt, compiled, tokens, sum(flops.values()))
            if not args.no_hf:
                row["hf"] = run_batches(hf_steps(target, samples, plan, lengths, flops), PEAK_WINDOW_S)
            rows.append(row)
            print(fmt_row(row), flush=True)
    notes.append(machine.stop())
    print(notes[-1])

    table = make_table(rows, batch_sizes)
    if not args.no_profile:
        for mode in (False, True) if compiled else (False,):
            table += "\n\n" + profile_breakdown(target, samples, layers, dtype, batch_sizes[0], lin, mode)
    print()
    print(table)
    if not args.no_append:
        append_result(argv, args, notes, layers, table, compiled)
    return 0


def time_disk(target, samples, layers, dtype_name, batch_tokens, compile_, tokens, flops) -> dict:
    with tempfile.TemporaryDirectory(prefix="draftlab-bench-") as d:
        before = measure_fp32_peak(1.0)
        t0 = time.perf_counter()
        capture_offline(target, samples, Path(d) / "cap", layers, storage_dtype=dtype_name,
                        batch_tokens=batch_tokens, progress=False, compile=compile_)
        secs = time.perf_counter() - t0
        peak = (before + measure_fp32_peak(1.0)) / 2
    return {"tok_s": tokens / secs, "share": 100.0 * flops / (secs * peak), "best": None, "peak": peak}


def hf_steps(target, samples, plan, lengths, flops):
    steps = []
    for b in plan:
        T = lengths[b[0]]
        ids = torch.zeros(len(b), T, dtype=torch.long)
        mask = torch.zeros(len(b), T, dtype=torch.long)
        for r, i in enumerate(b):
            ids[r, : lengths[i]] = samples[i]["input_ids"]
            mask[r, : lengths[i]] = 1

        @torch.inference_mode()
        def fn(ids=ids, mask=mask):
            target.model(input_ids=ids, attention_mask=mask)

        steps.append((fn, sum(lengths[i] for i in b), sum(flops[i] for i in b)))
    return steps


def profile_breakdown(target, samples, layers, dtype, batch_tokens: int, linear_per_token: float, compile_: bool) -> str:
    """Where capture's time goes (torch.profiler self times over a few batches): the matmuls'
    own FLOP rate inside the model bounds what the whole forward can reach."""
    from torch.profiler import ProfilerActivity, profile

    sub = samples[:8]
    lengths = [s["input_ids"].numel() for s in sub]
    padded = sum(len(b) * lengths[b[0]] for b in plan_batches(lengths, batch_tokens))
    capture_samples(target, sub, layers, dtype, batch_tokens, compile=compile_)  # warm
    peak = measure_fp32_peak(1.0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        capture_samples(target, sub, layers, dtype, batch_tokens, compile=compile_)
        wall = time.perf_counter() - t0
    peak = max(peak, measure_fp32_peak(1.0))
    events = prof.key_averages()
    mm = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm", "aten::bmm")) / 1e6
    attn = sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key) / 1e6
    mm_rate = linear_per_token * padded / mm
    return (f"Profile, {'compiled' if compile_ else 'eager'} capture ({len(sub)} samples, batch {batch_tokens}): "
            f"matmul {100 * mm / wall:.0f}% of the time, running at {mm_rate / 1e9:.0f} GFLOP/s = "
            f"{100 * mm_rate / peak:.0f}% of the better peak window around it ({peak / 1e9:.0f} GFLOP/s); "
            f"attention {100 * attn / wall:.0f}%; everything else {100 * (wall - mm - attn) / wall:.0f}%.")


def fmt_row(row: dict) -> str:
    parts = [f"round {row['round']} batch {row['batch_tokens']}"]
    for k, name in MODES.items():
        if k in row:
            m = row[k]
            best = f", best/best {m['best']:.1f}%" if m["best"] is not None else ""
            parts.append(f"{name} {m['tok_s']:.0f} tok/s = {m['share']:.1f}% of {m['peak'] / 1e9:.0f} GFLOP/s{best}")
    return " | ".join(parts)


def make_table(rows: list[dict], batch_sizes: list[int]) -> str:
    modes = [k for k in MODES if k in rows[0]]
    head = "| round | batch tokens | " + " | ".join(f"{MODES[k]}: tok/s, % peak (best/best)" for k in modes)
    lines = [head + " | compile / HF |" if "hf" in modes and "compiled" in modes else head + " |"]
    lines.append("|---" * (len(lines[0].split("|")) - 2) + "|")

    def cell(m):
        best = f" ({m['best']:.1f}%)" if m["best"] is not None else ""
        return f"{m['tok_s']:.0f}, {m['share']:.1f}%{best}"

    for row in rows:
        line = f"| {row['round']} | {row['batch_tokens']} | " + " | ".join(cell(row[k]) for k in modes) + " |"
        if "hf" in modes and "compiled" in modes:
            line += f" {row['compiled']['tok_s'] / row['hf']['tok_s']:.2f}x |"
        lines.append(line)
    for bt in batch_sizes:
        sel = [r for r in rows if r["batch_tokens"] == bt]
        cells = []
        for k in modes:
            tok = statistics.median(r[k]["tok_s"] for r in sel)
            share = statistics.median(r[k]["share"] for r in sel)
            bests = [r[k]["best"] for r in sel if r[k]["best"] is not None]
            cells.append(f"{tok:.0f}, **{share:.1f}%**" + (f" ({statistics.median(bests):.1f}%)" if bests else ""))
        line = f"| **median** | {bt} | " + " | ".join(cells) + " |"
        if "hf" in modes and "compiled" in modes:
            line += f" {statistics.median(r['compiled']['tok_s'] / r['hf']['tok_s'] for r in sel):.2f}x |"
        lines.append(line)
    return "\n".join(lines)


def append_result(argv, args, notes, layers, table, compiled) -> None:
    cmd = "python -m bench.capture " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    cpu = cpu_name()
    text = (
        f"\n## Hidden-state capture throughput ({datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')})\n\n"
        f"Command: `{cmd.strip()}`\n\n"
        f"Target {args.target}, layers {layers}, storage {args.dtype}; {'; '.join(notes[:-1])}. "
        f"Capture to disk runs {'with' if compiled else 'without'} compile. {cpu}, {torch.get_num_threads()} torch "
        f"threads, torch {torch.__version__}. Per mode: real tokens/s of the pass, % of fp32 matmul peak = batch FLOPs / "
        f"(batch seconds x peak window measured right before that batch), and in brackets the fastest batch over the best "
        f"peak window (method and FLOP formula in bench/capture.py). Shared machine: {notes[-1]}; compare ratios, "
        f"not absolute rates.\n\n{table}\n"
    )
    append_benchmarks(text)


if __name__ == "__main__":
    sys.exit(main())
