"""Decoding engine speed: plain decoding per batch size, kernels and host reads per step, and the
speedup of drafters (the oracle, the engine's ceiling, among them) on the main job's prompts.

    python -m bench.gpu_decode [--target default] [--recipe recipes/smollm2-135m-eagle3.yaml]
        [--batch-sizes 1,4,16,64] [--steps 64] [--num-prompts 8] [--max-new-tokens 64]
        [--drafter NAME=CHECKPOINT[:K]] ... [--out gpu_decode.json]

The one command to run on a GPU machine, first and last (it runs on CPU too, smaller). In one
process, on one target:

1. **plain decoding** of ``--steps`` tokens per row (no eos: every row runs every step) at each
   batch size, for each engine the device has (``reference``: the target's reference layer;
   ``fused``: the Triton decode layer, CUDA only) and, on CUDA, eager and replayed as CUDA
   graphs: ms per step (decode time over steps, prefill excluded) and tokens/s;
2. **kernels per step** (CUDA: the profiler's kernel count over eager plain steps at batch 1)
   and **host reads per step** (values of device tensors the host read: ``item``, ``tolist``,
   ``cpu``, ``numpy``, truth tests, at batch 1 and 16);
3. **drafters**, each decoded in lockstep with plain decoding on the recipe's held-out prompts
   (``evaluate``, batch 1, greedy, CUDA graphs on CUDA): the oracle (the target's own greedy
   continuation: τ = k+1, the most this engine gives at k) at k = 1 and 3, Jacobi lookahead, and
   each ``--drafter`` checkpoint (a trained family; chain k, default 1): τ, speedup, greedy match.

Writes one JSON (``--out``) and prints one Markdown table per part.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import traceback
from pathlib import Path

import torch

from bench.runs import main_with_errors

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def count_host_reads(device: torch.device):
    """Count reads of ``device`` tensors' values by the host (on CUDA each one waits for the
    device): a Counter by method, filled while the block runs."""
    from collections import Counter

    counts: Counter = Counter()
    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
    originals = {n: getattr(torch.Tensor, n) for n in names}

    def wrap(name, fn):
        def counted(self, *a, **k):
            if self.device == device:
                counts[name] += 1
            return fn(self, *a, **k)
        return counted

    for n, fn in originals.items():
        setattr(torch.Tensor, n, wrap(n, fn))
    try:
        yield counts
    finally:
        for n, fn in originals.items():
            setattr(torch.Tensor, n, fn)


def _rows(prompts, B):
    return [prompts[i % len(prompts)].prompt_ids for i in range(B)]


def plain_speed(target, prompts, batch_sizes, steps: int, graphs: str | None, loop: str = "host") -> list[dict]:
    """ms/step and tok/s of plain decoding at each batch size (after one warm-up decoding);
    ``graphs``: None (eager), "cuda" or "replay" (:class:`GraphedTarget`'s modes); ``loop``: the
    decoder's (host: a graph per forward; device: a graph per whole step)."""
    from draftlab.inference.decoder import Decoder
    from draftlab.inference.graphs import GraphedTarget

    # buffers as large as the longest decoding from the start: no capture inside a timed decoding
    room = max(len(p.prompt_ids) for p in prompts[: max(batch_sizes)]) + steps + 1
    model = GraphedTarget(target, mode=graphs, min_len=room) if graphs else target
    out = []
    for B in batch_sizes:
        rows = _rows(prompts, B)
        dec = Decoder(model, loop=loop)
        dec.generate(rows, min(steps, 8), None)  # warm-up: kernels compiled, graphs captured
        if target.device.type == "cuda":
            torch.cuda.synchronize()
        if graphs == "cuda" and loop == "host":
            model.replay_marks = []  # each replay's device time: a step's forward, without the host's share
        res = dec.generate(rows, steps, None)
        decode_s = res.total_time - res.prefill_time
        forward = {}
        if graphs == "cuda" and model.replay_marks:
            forward["forward_ms"] = sum(a.elapsed_time(b) for a, b in model.replay_marks) / len(model.replay_marks)
            model.replay_marks = None
        out.append({"batch": B, "ms_per_step": 1e3 * decode_s / res.num_steps,
                    "tokens_per_s": res.num_tokens / decode_s, "steps": res.num_steps, **forward,
                    **({"graphs_report": model.report()} if graphs and loop == "host" else {})})
    return out


def kernels_per_step(target, prompts, steps: int = 16) -> float | None:
    """CUDA kernels launched per eager plain decode step at batch 1 (profiler count; None off CUDA)."""
    if target.device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from draftlab.inference.decoder import Decoder

    dec = Decoder(target)
    rows = _rows(prompts, 1)
    dec.generate(rows, 4, None)
    counts = []
    for n in (steps, 2 * steps):  # the difference cancels the prefill's kernels
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            dec.generate(rows, n + 1, None)
            torch.cuda.synchronize()
        counts.append(sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA))
    return (counts[1] - counts[0]) / steps


@contextlib.contextmanager
def count_syncs(device: torch.device):
    """On CUDA, count the operations that synchronise the host with the device (torch's sync
    debug mode: reads, blocking copies, explicit synchronize); a list holding the count, or None
    off CUDA."""
    if device.type != "cuda":
        yield None
        return
    import warnings

    box = [0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield box
        finally:
            torch.cuda.set_sync_debug_mode("default")
    box[0] = sum("synchroniz" in str(w.message) for w in caught)


def host_reads_per_step(target, prompts, batch_sizes, steps: int = 16) -> dict[str, float]:
    """Host reads of device values (and, on CUDA, host-device syncs) per plain decode step at each
    batch size (the difference of two decodings' counts cancels the prefill's)."""
    from draftlab.inference.decoder import Decoder

    dec = Decoder(target)
    out = {}
    for B in batch_sizes:
        rows = _rows(prompts, B)
        reads, syncs = [], []
        for n in (steps, 2 * steps):
            with count_host_reads(target.device) as counts, count_syncs(target.device) as box:
                dec.generate(rows, n + 1, None)
            reads.append(sum(counts.values()))
            syncs.append(box)
        out[f"host_reads_b{B}"] = (reads[1] - reads[0]) / steps
        if syncs[0] is not None:
            out[f"syncs_b{B}"] = (syncs[1][0] - syncs[0][0]) / steps
    return out


def drafter_runs(target, prompts, specs, max_new_tokens: int, graphs: bool) -> list[dict]:
    from draftlab.inference.evaluate import evaluate
    from draftlab.inference.lookahead import LookaheadProposer
    from draftlab.inference.oracle import OracleProposer
    from draftlab.inference.proposer import load_proposer
    from draftlab.inference.shapes import Chain, DynamicTree

    eos = target.tokenizer.eos_token_id
    out = []
    for label, kind, arg, k in specs:
        if kind == "oracle":
            proposer, shape = OracleProposer(target), Chain(k)  # the harness prepares it
        elif kind == "lookahead":
            proposer, shape = LookaheadProposer(W=5, N=4, G=5), DynamicTree(3, 5, 16)
        else:
            shape = Chain(k)
            proposer = load_proposer(arg, target, shape)
        t0 = time.perf_counter()
        rep = evaluate(target, proposer, prompts, shape=shape, max_new_tokens=max_new_tokens, eos_token_id=eos,
                       cuda_graphs=graphs, label=label)
        out.append({"drafter": label, "shape": rep.get("method"), "k": k, "tau": rep["tau"], "speedup": rep["speedup"],
                    "tokens_per_s": rep["tokens_per_s"], "baseline_tokens_per_s": rep["baseline_tokens_per_s"],
                    "greedy_match": rep["greedy_match"], "seconds": time.perf_counter() - t0,
                    **{key: rep[key] for key in ("draft_time_s", "verify_time_s", "prefill_time_s", "total_time_s",
                                                 "baseline_time_s", "new_tokens")},
                    **({"cuda_graphs": rep["cuda_graphs"]} if "cuda_graphs" in rep else {})})
        print(f"  {label}: tau {rep['tau']:.2f}, speedup {rep['speedup']:.2f}x", flush=True)
    return out


def profile_steps(target, prompts, proposer_shape=None, steps: int = 32) -> tuple[str, float]:
    """Graphed decoding at batch 1 (plain, or drafting ``proposer_shape`` = (proposer, shape))
    under the profiler: its table by device time over ``2 * steps`` tokens (a captured step's
    kernels are listed one by one), and kernels per step (the difference of two decodings' counts
    cancels the prefill's)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from draftlab.inference.decoder import Decoder
    from draftlab.inference.graphs import GraphedTarget

    model = GraphedTarget(target, mode="cuda" if target.device.type == "cuda" else "replay")
    proposer, shape = proposer_shape or (None, None)
    dec = Decoder(model, proposer)
    rows = _rows(prompts, 1)
    dec.generate(rows, steps, shape)
    counts = []
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    for n in (steps, 2 * steps):
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            res = dec.generate(rows, n, shape)
            sync()
        counts.append((sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA), res.num_steps))
    per_step = (counts[1][0] - counts[0][0]) / max(1, counts[1][1] - counts[0][1])
    return prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30), per_step


def _drafter_spec(value: str):
    name, eq, rest = value.partition("=")
    if not name or not eq or not rest:
        raise argparse.ArgumentTypeError(f"--drafter: expected NAME=CHECKPOINT[:K], got {value!r}")
    path, _, k = rest.partition(":")
    if not Path(path).is_dir():
        raise argparse.ArgumentTypeError(f"--drafter {name}: no checkpoint directory at {path}")
    if k and not k.isdigit():
        raise argparse.ArgumentTypeError(f"--drafter {name}: K must be a positive integer, got {k!r}")
    return name, "checkpoint", path, int(k or 1)


def table(rows: list[dict], keys: list[str]) -> str:
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="default")
    p.add_argument("--recipe", default=str(REPO / "recipes" / "smollm2-135m-eagle3.yaml"),
                   help="whose eval data (held-out prompts) the drafters decode")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--batch-sizes", default=None, help="default: 1,4,16,64 on CUDA, 1,4 on CPU")
    p.add_argument("--steps", type=int, default=None, help="plain decode steps per row (default: 64 on CUDA, 16 on CPU)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--drafter", type=_drafter_spec, action="append", default=[], help="NAME=CHECKPOINT[:K] (chain K, default 1)")
    p.add_argument("--no-drafters", action="store_true", help="plain decoding only")
    p.add_argument("--replay-graphs", action="store_true", help="on CPU: also run the graphed path in replay mode (a check)")
    p.add_argument("--profile", action="store_true", help="CUDA: also profile graphed steps at batch 1 (plain, oracle k=3, each --drafter): "
                   "kernels a step, device time by kernel")
    p.add_argument("--out", default="gpu_decode.json")
    return p.parse_args(argv)


def run(argv, args) -> int:

    from draftlab.atomic import write_json
    from draftlab.inference.batch_eval import parse_batch_sizes
    from draftlab.inference.evaluate import device_name
    from draftlab.inference.prompts import prompt_conversations, tokenize_prompts
    from draftlab.models.target import Target
    from draftlab.recipe import load_recipe

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    batch_sizes = parse_batch_sizes(args.batch_sizes) if args.batch_sizes else [1, 4, 16, 64] if cuda else [1, 4]
    steps = args.steps or (64 if cuda else 16)
    recipe = load_recipe(args.recipe)
    convs = prompt_conversations(recipe.eval.data, args.num_prompts, data_spec=recipe.data)
    t0 = time.perf_counter()
    target = Target.load(args.target, dtype=args.dtype, device=str(device))
    prompts = tokenize_prompts(convs, target.tokenizer)
    report = {"device": device_name(device), "torch": torch.__version__, "dtype": str(target.dtype).removeprefix("torch."),
              "target": target.identity.get("name"), "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "load_s": time.perf_counter() - t0, "steps": steps, "plain": [], "drafters": []}
    engines = (["fused"] if target.fused_decode else []) + ["reference"]  # the default engine first
    default_engine = engines[0]
    # (graphs, loop): the device loop (a graph per whole step) is CUDA's default
    graph_modes = [("cuda", "device"), ("cuda", "host"), (None, "host")] if cuda else \
        [(None, "host")] + ([("replay", "host"), ("replay", "device")] if args.replay_graphs else [])

    def section(name: str, fn) -> None:
        """Run one part; a failure is recorded and the rest still runs (the JSON is rewritten after each)."""
        print(name, flush=True)
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a report with every part that ran beats none
            report.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            traceback.print_exc()  # a GPU machine is lent for minutes: its log must say where it broke
            print(f"  FAILED: {report['errors'][name]}", flush=True)
        write_json(args.out, report)

    def plain(engine, mode, loop):
        target.fused_decode = engine == "fused"
        for row in plain_speed(target, prompts, batch_sizes, steps, mode, loop):
            report["plain"].append({"engine": engine, "graphs": mode or "eager", "loop": loop, **row})

    def counts(engine):
        target.fused_decode = engine == "fused"
        report.setdefault("kernels_per_step", {})[engine] = kernels_per_step(target, prompts)
        report.setdefault("host_reads_per_step", {})[engine] = host_reads_per_step(target, prompts, [1, 16] if cuda else [1, 4])

    def drafters():
        target.fused_decode = default_engine == "fused"
        specs = [("oracle k=1", "oracle", None, 1), ("oracle k=3", "oracle", None, 3), ("lookahead", "lookahead", None, 0)]
        report["drafters"] = drafter_runs(target, prompts, specs + args.drafter, args.max_new_tokens, cuda)

    def profiles():
        from draftlab.inference.graphs import GraphedTarget
        from draftlab.inference.oracle import OracleProposer
        from draftlab.inference.shapes import Chain

        from draftlab.inference.proposer import load_proposer

        target.fused_decode = default_engine == "fused"
        oracle = OracleProposer(target)
        oracle.prepare(GraphedTarget(target), [prompts[0].prompt_ids], 128, target.tokenizer.eos_token_id)
        cases = [("plain", None), ("oracle k=3", (oracle, Chain(3)))]
        cases += [(f"{name} k={k}", (load_proposer(path, target, Chain(k)), Chain(k))) for name, _, path, k in args.drafter]
        for label, ps in cases:
            table_, per_step = profile_steps(target, prompts, ps)
            report.setdefault("profile_kernels_per_step", {})[label] = per_step
            print(f"\n{label}, batch 1, graphed steps: {per_step:.0f} kernels a step; device time by kernel:\n{table_}")

    for mode, loop in graph_modes:
        section(f"plain decoding: {default_engine} layer, graphs {mode or 'off'}, {loop} loop", lambda: plain(default_engine, mode, loop))
    section(f"kernels and host reads per step: {default_engine} layer", lambda: counts(default_engine))
    if not args.no_drafters:
        section(f"drafters ({default_engine} layer{', CUDA graphs' if cuda else ''})", drafters)
    for engine in engines[1:]:
        for mode, loop in graph_modes:
            section(f"plain decoding: {engine} layer, graphs {mode or 'off'}, {loop} loop", lambda: plain(engine, mode, loop))
        section(f"kernels and host reads per step: {engine} layer", lambda: counts(engine))
    report["engine"] = default_engine
    if args.profile and cuda:
        section("profiles", profiles)
    target.fused_decode = default_engine == "fused"
    print(f"\n{report['device']}, {report['dtype']}, torch {report['torch']}\n")
    print(table(report["plain"], ["engine", "graphs", "loop", "batch", "ms_per_step", "forward_ms", "tokens_per_s"]))
    counted = [e for e in engines if e in report.get("host_reads_per_step", {})]
    if counted:
        print(table([{"engine": e, "kernels_per_step": report["kernels_per_step"][e], **report["host_reads_per_step"][e]}
                     for e in counted], ["engine", "kernels_per_step", *report["host_reads_per_step"][counted[0]]]))
    if report["drafters"]:
        print(table(report["drafters"], ["drafter", "k", "tau", "speedup", "tokens_per_s", "baseline_tokens_per_s", "greedy_match"]))
    for name, why in report.get("errors", {}).items():
        print(f"FAILED {name}: {why}")
    print(f"wrote {args.out}")
    return 1 if report.get("errors") else 0


def main(argv=None) -> int:
    return main_with_errors("bench.gpu_decode", parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
