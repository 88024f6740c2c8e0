"""Hidden-state capture throughput on the embedded target, as a share of the fp32 matmul peak.

    python bench/capture.py [--num-conversations 48] [--rounds 3] [--batch-tokens 1024[,2048...]]

Each round measures, back to back: the fp32 matmul peak (bench/peak.py), capture without
disk (``capture_samples``: forwards + copies into the storage dtype), eager and with
``--compile`` (torch.compile; its one-off compilation is timed separately), capture with disk
(``capture_offline`` into a fresh temp dir: + fingerprint, safetensors write, fsync, sha256,
manifest) and plain HF ``model(input_ids, attention_mask)`` forwards (with logits) over the
same padded batches. Throughput counts real tokens only (padding is waste). A closing
profiler pass shows where capture's time goes (matmul / attention / everything else).

FLOPs per token counted (decoder layers only, the useful work of a capture):
    2 * (weights of every nn.Linear in the decoder layers)
  + 4 * layers * heads * head_dim * (n + 1) / 2    (causal QK^T and PV, averaged over a
                                                    sample of n tokens, weighted by tokens)
Not counted: embedding lookup, norms, RoPE, softmax, SiLU and the lm_head (HF computes it,
capture does not; counting the same work for both keeps their "% of peak" comparable).
share of peak = FLOPs/token * tokens/s / peak, with the peak measured in the same round.
The rows and the command are appended to BENCHMARKS.md at the repo root.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak import measure_fp32_peak  # noqa: E402

from draftlab.data.capture import (  # noqa: E402
    STORAGE_DTYPES,
    capture_offline,
    capture_samples,
    plan_batches,
    resolve_layers,
)

REPO = Path(__file__).resolve().parent.parent


def decoder_flops_per_token(target, lengths: list[int]) -> tuple[float, float, float]:
    """(total, linear, attention) FLOPs per real token, formula in the module docstring."""
    layers = target.model.model.layers
    linear_weights = sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))
    c = target.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    tokens = sum(lengths)
    attn_total = sum(4 * c.num_hidden_layers * c.num_attention_heads * head_dim * n * (n + 1) / 2 for n in lengths)
    linear = 2.0 * linear_weights
    return linear + attn_total / tokens, linear, attn_total / tokens


def padded_batches(samples, batch_tokens: int):
    """The right-padded [B, T] batches capture runs, for the HF comparison."""
    lengths = [s["input_ids"].numel() for s in samples]
    out = []
    for batch in plan_batches(lengths, batch_tokens):
        T = lengths[batch[0]]
        ids = torch.zeros(len(batch), T, dtype=torch.long)
        mask = torch.zeros(len(batch), T, dtype=torch.long)
        for r, i in enumerate(batch):
            ids[r, : lengths[i]] = samples[i]["input_ids"]
            mask[r, : lengths[i]] = 1
        out.append((ids, mask))
    return out


def time_capture(target, samples, layers, dtype, batch_tokens, compile: bool) -> float:
    t0 = time.perf_counter()
    capture_samples(target, samples, layers, dtype, batch_tokens, compile=compile)
    return time.perf_counter() - t0


def time_capture_disk(target, samples, layers, dtype_name, batch_tokens, compile: bool) -> float:
    with tempfile.TemporaryDirectory(prefix="draftlab-bench-") as d:
        t0 = time.perf_counter()
        capture_offline(target, samples, Path(d) / "cap", layers, storage_dtype=dtype_name,
                        batch_tokens=batch_tokens, progress=False, compile=compile)
        return time.perf_counter() - t0  # whole call: fingerprint, writes, manifest included


def profile_breakdown(target, samples, layers, dtype, batch_tokens: int, linear_flops: float, peak: float) -> str:
    """Where capture's time goes (torch.profiler self times over a few batches): the matmuls'
    own FLOP rate inside the model bounds what the whole forward can reach."""
    from torch.profiler import ProfilerActivity, profile

    sub = samples[:8]
    lengths = [s["input_ids"].numel() for s in sub]
    padded = sum(len(b) * lengths[b[0]] for b in plan_batches(lengths, batch_tokens))
    capture_samples(target, sub, layers, dtype, batch_tokens)  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        capture_samples(target, sub, layers, dtype, batch_tokens)
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    mm = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm", "aten::bmm")) / 1e6
    attn = sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key) / 1e6
    mm_rate = linear_flops * padded / mm
    return (f"time inside capture ({len(sub)} samples, batch {batch_tokens}): matmul {100 * mm / wall:.0f}% "
            f"(running at {mm_rate / 1e9:.0f} GFLOP/s = {100 * mm_rate / peak:.0f}% of a peak of {peak / 1e9:.0f} "
            f"measured just before), attention {100 * attn / wall:.0f}%, everything else {100 * (wall - mm - attn) / wall:.0f}%")


@torch.inference_mode()
def time_hf(target, batches) -> float:
    t0 = time.perf_counter()
    for ids, mask in batches:
        target.model(input_ids=ids, attention_mask=mask)
    return time.perf_counter() - t0


# measured columns: key -> header
COLUMNS = {
    "eager": "capture (eager)",
    "compiled": "capture (--compile)",
    "disk": "capture to disk",
    "hf": "HF model()",
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="default")
    p.add_argument("--num-conversations", type=int, default=48)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--layers", default="eagle3")
    p.add_argument("--dtype", default="bfloat16", choices=tuple(STORAGE_DTYPES))
    p.add_argument("--batch-tokens", default="1024", help="comma-separated values to compare")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peak-seconds", type=float, default=3.0)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd capture")
    p.add_argument("--no-hf", action="store_true", help="skip the HF model() comparison")
    p.add_argument("--no-profile", action="store_true", help="skip the profiler breakdown")
    p.add_argument("--no-append", action="store_true", help="print only, do not append to BENCHMARKS.md")
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
    flops, linear, attn = decoder_flops_per_token(target, lengths)
    batch_sizes = [int(b) for b in args.batch_tokens.split(",")]
    compiled = not args.no_compile
    notes = [f"{len(samples)} ShareGPT samples, {tokens} tokens (mean {tokens / len(samples):.0f}, "
             f"{sum(n == args.max_length for n in lengths)} at max_length {args.max_length})"]
    print(notes[0] + f"; decoder FLOPs/token {flops / 1e6:.1f} M (linear {linear / 1e6:.1f} M + attention "
          f"{attn / 1e6:.1f} M); {torch.get_num_threads()} threads")

    capture_samples(target, samples[:4], layers, dtype, batch_sizes[0])  # warm-up (allocator, thread pool)
    if compiled:
        t0 = time.perf_counter()
        for bt in batch_sizes:  # compile once, then the B=1 specialisation (short plans end with one row)
            capture_samples(target, samples[:4], layers, dtype, bt, compile=True)
            capture_samples(target, samples[:1], layers, dtype, bt, compile=True)
        notes.append(f"torch.compile warm-up took {time.perf_counter() - t0:.0f} s (once per process, not in the rates)")
        print(notes[-1])
    rows = []
    for r in range(args.rounds):
        for bt in batch_sizes:
            peak = measure_fp32_peak(args.peak_seconds)
            row = {"round": r + 1, "batch_tokens": bt, "peak": peak}
            row["eager"] = tokens / time_capture(target, samples, layers, dtype, bt, False)
            if compiled:
                row["compiled"] = tokens / time_capture(target, samples, layers, dtype, bt, True)
            row["disk"] = tokens / time_capture_disk(target, samples, layers, args.dtype, bt, compiled)
            if not args.no_hf:
                row["hf"] = tokens / time_hf(target, padded_batches(samples, bt))
            rows.append(row)
            print(fmt_row(row, flops), flush=True)

    table = make_table(rows, flops, batch_sizes)
    if not args.no_profile:
        peak = measure_fp32_peak(args.peak_seconds)
        table += "\n\n" + profile_breakdown(target, samples, layers, dtype, batch_sizes[0], linear, peak)
    print()
    print(table)
    if not args.no_append:
        append_benchmarks(argv, args, notes, flops, linear, attn, layers, table, compiled)
    return 0


def share(tps: float, flops: float, peak: float) -> float:
    return 100.0 * tps * flops / peak


def fmt_row(row: dict, flops: float) -> str:
    parts = [f"round {row['round']} batch {row['batch_tokens']}: peak {row['peak'] / 1e9:.1f} GFLOP/s"]
    parts += [f"{name} {row[k]:.0f} tok/s = {share(row[k], flops, row['peak']):.1f}%" for k, name in COLUMNS.items() if k in row]
    return " | ".join(parts)


def make_table(rows: list[dict], flops: float, batch_sizes: list[int]) -> str:
    cols = [k for k in COLUMNS if k in rows[0]]
    ratio = "hf" in cols
    best = "compiled" if "compiled" in cols else "eager"
    head = "| round | batch tokens | fp32 peak GFLOP/s | " + " | ".join(f"{COLUMNS[k]} tok/s | % peak" for k in cols) + " |"
    sep = "|---" * (3 + 2 * len(cols)) + "|"
    if ratio:
        head += f" {COLUMNS[best]} / HF |"
        sep += "---|"
    lines = [head, sep]
    for row in rows:
        cells = [str(row["round"]), str(row["batch_tokens"]), f"{row['peak'] / 1e9:.1f}"]
        for k in cols:
            cells += [f"{row[k]:.0f}", f"{share(row[k], flops, row['peak']):.1f}%"]
        if ratio:
            cells.append(f"{row[best] / row['hf']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    for bt in batch_sizes:
        sel = [r for r in rows if r["batch_tokens"] == bt]
        med = lambda f: statistics.median(f(r) for r in sel)  # noqa: E731
        cells = ["**median**", str(bt), f"{med(lambda r: r['peak']) / 1e9:.1f}"]
        for k in cols:
            cells += [f"{med(lambda r: r[k]):.0f}", f"**{med(lambda r: share(r[k], flops, r['peak'])):.1f}%**"]
        if ratio:
            cells.append(f"{med(lambda r: r[best] / r['hf']):.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def append_benchmarks(argv, args, notes, flops, linear, attn, layers, table, compiled) -> None:
    path = REPO / "BENCHMARKS.md"
    cmd = "python bench/capture.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = (
        f"\n## Hidden-state capture throughput ({datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')})\n\n"
        f"Command: `{cmd.strip()}`\n\n"
        f"Target {args.target} ({flops / 1e6:.1f} M decoder FLOPs/token = {linear / 1e6:.1f} M linear + "
        f"{attn / 1e6:.1f} M causal attention, formula in bench/capture.py), layers {layers}, storage {args.dtype}; "
        f"{'; '.join(notes)}. Capture to disk runs {'with' if compiled else 'without'} --compile. "
        f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}. "
        f"Each row measured back to back in one run; % peak = FLOPs/token x tokens/s / fp32 matmul peak of that row "
        f"(shared machine: compare ratios, not absolute rates).\n\n{table}\n"
    )
    new = not path.exists()
    with open(path, "a") as f:
        if new:
            f.write("# draftlab benchmarks\n\nMeasured results, appended by the scripts in bench/ (newest last).\n")
        f.write(text)
    print(f"appended to {path}")


if __name__ == "__main__":
    sys.exit(main())
