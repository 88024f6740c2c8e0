"""Verify kernels on a GPU: the decoder's accept step (``accept_chains`` / ``accept_trees``,
greedy and sampling) on the Triton kernels against the torch reference, by batch size, draft
length and vocabulary size.

    python -m bench.kernels [--batch-sizes 1,8,64] [--ks 3,7] [--vocabs 49152,128256]
                            [--repeats 30] [--no-append]

Each configuration runs the whole accept call the decoder makes (the target's logits in, the
emitted tokens out as Python lists, so a host sync included), on the same inputs and generator
seed for both backends, whose outputs must be equal; the time is the median of ``--repeats``
calls after 3 warm-ups. Chains: B rows of k drafts, draft probabilities when sampling (EAGLE's
case). Trees: B trees of 1 + 2k nodes (two candidates at each of k levels, the second under
the first). Needs a CUDA device: on CPU the decoder never runs Triton (only its interpreter,
for the tests). Unless ``--no-append``, the results rewrite this benchmark's section of
BENCHMARKS.md (the section it replaces moves to bench/HISTORY.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone

from bench.runs import main_with_errors
from bench.sections import append_run


def parse_args(argv):
    from draftlab.inference.batch_eval import parse_batch_sizes

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--ks", default="3,7")
    p.add_argument("--vocabs", default="49152,128256")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--no-append", action="store_true", help="print only, do not rewrite this benchmark's section of BENCHMARKS.md")
    args = p.parse_args(argv)
    args.batch_sizes = parse_batch_sizes(args.batch_sizes)
    args.ks = parse_batch_sizes(args.ks, "--ks")
    args.vocabs = parse_batch_sizes(args.vocabs, "--vocabs")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def _inputs(kind: str, B: int, k: int, V: int, gen):
    """(call args but the sampling and backend) of one accept call on the GPU."""
    import torch

    dev = "cuda"
    if kind == "chain":
        drafts = [torch.randint(0, V, (k,), generator=gen).to(dev) for _ in range(B)]
        logits = torch.randn(B, k + 1, V, generator=gen).to(dev) * 3
        for b, d in enumerate(drafts):  # the target agrees with about half the drafts
            agree = torch.rand(k, generator=gen).to(dev) < 0.5
            logits[b, torch.arange(k, device=dev)[agree], d[agree]] += 30
        probs = [torch.softmax(torch.randn(k, V, generator=gen).to(dev), -1) for _ in range(B)]
        return drafts, logits, probs
    n = 1 + 2 * k
    tokens = torch.randint(0, V, (B, n), generator=gen)
    tokens[:, 2::2] = (tokens[:, 1::2] + 1) % V  # siblings carry distinct tokens
    parents = torch.tensor([-1] + [max(0, 2 * d - 1) for d in range(k) for _ in range(2)]).repeat(B, 1)
    logits = torch.randn(B, n, V, generator=gen) * 3
    rows = torch.arange(B)[:, None]  # the target agrees with about half the nodes
    logits[rows, parents[:, 1:], tokens[:, 1:]] += 30 * (torch.rand(B, n - 1, generator=gen) < 0.5)
    return tokens.to(dev), parents.to(dev), logits.to(dev)


def _call(kind: str, inputs, sampling, backend: str):
    from draftlab.kernels import accept_chains, accept_trees

    if kind == "chain":
        drafts, logits, probs = inputs
        return accept_chains(drafts, logits, sampling, probs, backend=backend)
    tokens, parents, logits = inputs
    path, emitted, num = accept_trees(tokens, parents, logits, sampling, backend=backend)
    return path.tolist(), emitted, num


def measure(kind: str, B: int, k: int, V: int, temperature: float, repeats: int) -> dict:
    """Median seconds of one accept call on each backend; their outputs checked equal."""
    import torch

    from draftlab.inference.sampling import Sampling

    inputs = _inputs(kind, B, k, V, torch.Generator().manual_seed(B * 1000 + k))
    gen = torch.Generator(device="cuda")
    seconds, outputs = {}, {}
    for backend in ("torch", "triton"):
        times = []
        for r in range(3 + repeats):
            gen.manual_seed(r)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = _call(kind, inputs, Sampling(temperature, 0, 1.0, gen), backend)
            times.append(time.perf_counter() - t0)  # the call ends in .tolist(): synchronised
            outputs.setdefault(backend, []).append(out)
        seconds[backend] = statistics.median(times[3:])
    if outputs["torch"] != outputs["triton"]:
        from draftlab.errors import DraftlabError

        raise DraftlabError(f"{kind} B={B} k={k} V={V} T={temperature}: the Triton and torch outputs differ")
    return seconds


def run(argv, args) -> int:
    import torch

    from draftlab.errors import DraftlabError

    if not torch.cuda.is_available():
        raise DraftlabError("needs a CUDA device (on CPU the decoder verifies with the torch reference)")
    import triton

    started = datetime.now(timezone.utc)
    rows = []
    for kind in ("chain", "tree"):
        for temperature in (0.0, 1.0):
            for V in args.vocabs:
                for B in args.batch_sizes:
                    for k in args.ks:
                        s = measure(kind, B, k, V, temperature, args.repeats)
                        rows.append((kind, "greedy" if temperature == 0 else "sampling", V, B, k, s["torch"], s["triton"]))
                        print(f"{kind} {rows[-1][1]} V={V} B={B} k={k}: torch {1e3 * s['torch']:.3f} ms, "
                              f"triton {1e3 * s['triton']:.3f} ms", flush=True)
    lines = ["| verify | mode | vocab | batch | k | torch ms | Triton ms | torch / Triton |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {kind} | {mode} | {V} | {B} | {k} | {1e3 * t:.3f} | {1e3 * tt:.3f} | {t / tt:.2f}x |"
              for kind, mode, V, B, k, t, tt in rows]
    text = "\n".join(lines)
    note = (f"\nEach row: the median of {args.repeats} whole accept calls (logits in, emitted tokens out as lists) "
            f"after 3 warm-ups, both backends on the same inputs and seeds, outputs equal in every call. "
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}.")
    print(text + note)
    if not args.no_append:
        append_run("Verify kernels on a GPU", started, "bench.kernels", argv, text + "\n" + note)
    return 0


def main(argv=None) -> int:
    return main_with_errors("bench.kernels", parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
