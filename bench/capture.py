"""Hidden-state capture throughput on the embedded target, as a share of the fp32 matmul peak.

    python bench/capture.py [--num-conversations 48] [--rounds 3] [--batch-tokens 1024[,2048...]]

Each round measures, back to back: the fp32 matmul peak (bench/peak.py), capture without
disk (``capture_samples``: forwards + copies into the storage dtype), capture with disk
(``capture_offline`` into a fresh temp dir: + safetensors write, fsync, sha256) and plain HF
``model(input_ids, attention_mask)`` forwards (with logits) over the same padded batches.
Throughput counts real tokens only (padding is waste).

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


def time_capture(target, samples, layers, dtype, batch_tokens) -> float:
    t0 = time.perf_counter()
    capture_samples(target, samples, layers, dtype, batch_tokens)
    return time.perf_counter() - t0


def time_capture_disk(target, samples, layers, dtype_name, batch_tokens) -> float:
    with tempfile.TemporaryDirectory(prefix="draftlab-bench-") as d:
        t0 = time.perf_counter()
        capture_offline(target, samples, Path(d) / "cap", layers, storage_dtype=dtype_name,
                        batch_tokens=batch_tokens, progress=False)
        return time.perf_counter() - t0  # whole call: fingerprint, writes, manifest included


@torch.inference_mode()
def time_hf(target, batches) -> float:
    t0 = time.perf_counter()
    for ids, mask in batches:
        target.model(input_ids=ids, attention_mask=mask)
    return time.perf_counter() - t0


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
    p.add_argument("--no-hf", action="store_true", help="skip the HF model() comparison")
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
    print(f"{len(samples)} ShareGPT samples, {tokens} tokens (mean {tokens / len(samples):.0f}, "
          f"{sum(n == args.max_length for n in lengths)} at max_length {args.max_length}); "
          f"decoder FLOPs/token {flops / 1e6:.1f} M (linear {linear / 1e6:.1f} M + attention {attn / 1e6:.1f} M); "
          f"{torch.get_num_threads()} threads")

    capture_samples(target, samples[:4], layers, dtype, batch_sizes[0])  # warm-up (allocator, thread pool)
    rows = []
    for r in range(args.rounds):
        for bt in batch_sizes:
            peak = measure_fp32_peak(args.peak_seconds)
            row = {"round": r + 1, "batch_tokens": bt, "peak": peak}
            row["capture"] = tokens / time_capture(target, samples, layers, dtype, bt)
            row["disk"] = tokens / time_capture_disk(target, samples, layers, args.dtype, bt)
            if not args.no_hf:
                row["hf"] = tokens / time_hf(target, padded_batches(samples, bt))
            rows.append(row)
            print(fmt_row(row, flops), flush=True)

    table = make_table(rows, flops, batch_sizes, args.no_hf)
    print()
    print(table)
    if not args.no_append:
        append_benchmarks(argv, args, samples, tokens, flops, linear, attn, layers, table)
    return 0


def share(tps: float, flops: float, peak: float) -> float:
    return 100.0 * tps * flops / peak


def fmt_row(row: dict, flops: float) -> str:
    s = (f"round {row['round']} batch {row['batch_tokens']}: peak {row['peak'] / 1e9:.1f} GFLOP/s | capture "
         f"{row['capture']:.0f} tok/s = {share(row['capture'], flops, row['peak']):.1f}% | +disk {row['disk']:.0f} tok/s = "
         f"{share(row['disk'], flops, row['peak']):.1f}%")
    if "hf" in row:
        s += f" | HF model() {row['hf']:.0f} tok/s = {share(row['hf'], flops, row['peak']):.1f}%"
    return s


def make_table(rows: list[dict], flops: float, batch_sizes: list[int], no_hf: bool) -> str:
    head = "| round | batch tokens | fp32 peak GFLOP/s | capture tok/s | capture % peak | capture+disk tok/s | +disk % peak |"
    sep = "|---|---|---|---|---|---|---|"
    if not no_hf:
        head += " HF model() tok/s | HF % peak | capture / HF |"
        sep += "---|---|---|"
    lines = [head, sep]

    for row in rows:
        line = (f"| {row['round']} | {row['batch_tokens']} | {row['peak'] / 1e9:.1f} | {row['capture']:.0f} | "
                f"{share(row['capture'], flops, row['peak']):.1f}% | {row['disk']:.0f} | "
                f"{share(row['disk'], flops, row['peak']):.1f}% |")
        if not no_hf:
            line += f" {row['hf']:.0f} | {share(row['hf'], flops, row['peak']):.1f}% | {row['capture'] / row['hf']:.2f}x |"
        lines.append(line)
    for bt in batch_sizes:
        sel = [r for r in rows if r["batch_tokens"] == bt]
        med = lambda f: statistics.median(f(r) for r in sel)  # noqa: E731
        line = (f"| **median** | {bt} | {med(lambda r: r['peak']) / 1e9:.1f} | {med(lambda r: r['capture']):.0f} | "
                f"**{med(lambda r: share(r['capture'], flops, r['peak'])):.1f}%** | {med(lambda r: r['disk']):.0f} | "
                f"{med(lambda r: share(r['disk'], flops, r['peak'])):.1f}% |")
        if not no_hf:
            line += (f" {med(lambda r: r['hf']):.0f} | {med(lambda r: share(r['hf'], flops, r['peak'])):.1f}% | "
                     f"{med(lambda r: r['capture'] / r['hf']):.2f}x |")
        lines.append(line)
    return "\n".join(lines)


def append_benchmarks(argv, args, samples, tokens, flops, linear, attn, layers, table) -> None:
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
        f"{len(samples)} ShareGPT samples, {tokens} tokens, max_length {args.max_length}. "
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
