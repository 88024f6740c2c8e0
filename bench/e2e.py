"""End-to-end greedy decoding speed on the embedded target: draftlab's engine vs HF transformers.

    python -m bench.e2e [--drafter CKPT] [--num-prompts 24] [--max-new-tokens 128] [--k 5]
                        [--tree-depth 5] [--tree-topk 8] [--tree-total 48] [--threads N] [--quick]

Target ``Target.load("default")`` (SmolLM2-135M-Instruct, fp32, CPU), Spec-Bench prompts
(first turn, round-robin over categories), greedy, stopping at max_new_tokens or the
tokenizer's eos, every row on the same prompts, in one process. Rows:

1. draftlab plain greedy (``generate_plain``),
2. HF ``model.generate`` greedy on ``target.model`` (the same weights),
3. HF prompt-lookup decoding (``prompt_lookup_num_tokens=K``, ``max_matching_ngram_size`` =
   ``--ngram-max``, so it drafts like row 4; note HF takes the *earliest* match, draftlab the
   most recent),
4. draftlab n-gram prompt lookup, chain K,
5. draftlab EAGLE-3 chain K and 6. EAGLE-3 tree (only with ``--drafter``),
7. with ``--min-confidence C``: EAGLE-3 chain K that stops where the drafter's confidence
   falls below C; with ``--lookup-min-match N``: prompt lookup first (n-gram of >= N tokens),
   EAGLE-3 chain K otherwise, and, when both are given, the two combined.

Rows 1-3 are timed here per prompt, back to back, the order rotating every prompt, after one
warm-up each. Rows 4-6 come from ``evaluate(...)``, which times draftlab plain and the
speculative decoder back to back per prompt. Every speedup is a ratio of runs that alternated
on the same prompts, so slow drift of the shared machine cancels:
  vs draftlab plain: rows 2-3 from the rows 1-3 loop; rows 4-6 the ``evaluate`` speedup.
  vs HF generate: rows 1-3 from their loop; rows 4-6 = (their ``evaluate`` speedup) x
  (draftlab plain / HF generate from the loop): a product of two paired ratios.
tau = 1 + sum_j a_j (tokens per verify step, prefill excluded, methods.md) from the reports;
"tok/fwd" = new tokens / target forwards including the prefill, for every row (HF rows:
forwards counted with a hook on ``target.model``), the one measure that HF prompt lookup (whose
first forward prefills and verifies at once) and draftlab share.

Engine measurements, same process (context = the first prompt plus half of its plain
continuation; (a)-(c) interleaved: every round runs each forward once, in rotating order, so
their ratios are paired; medians and best of ``--reps`` rounds after warm-up):
(a) draftlab decode step (1 token, KV cache, ``logits="last"``, as ``generate_plain``) vs the
    weight-streaming limit: fp32 bytes of the weights one forward reads (decoder layers, final
    norm and lm_head; the embedding lookup excluded, the tied lm_head counted once) divided by
    the copy bandwidth of a 256 MiB ``Tensor.copy_`` (read + write bytes / time, best of reps).
(b) draftlab verify forward of K+1 tokens (``logits="all"``, as ``_chain_step``) and of
    tree_total+1 tokens with an explicit mask (as ``_tree_step``), vs 1 token.
(c) HF forward (DynamicCache, ``logits_to_keep`` as generate uses it) for 1 and K+1 tokens.
(d) the verify kernels (``backend="torch"``, vocab 49152) timed alone, plus the decoder-side
    inputs they need (argmax; softmax + Exp(1) noise for sampling), as shares of the measured
    per-step time of the matching speculative row.
(e) draft vs verify time per step from the ``evaluate`` reports. The target handed to
    ``evaluate`` is a timing proxy (:class:`TimedTarget`), so the verify forward's own time and
    the 1-token forwards of the interleaved plain runs are measured inside the same runs:
    "verify fwd / plain step" is (b) measured in situ, and "verify overhead" = verify time per
    step minus that forward (verification, cache roll-back, Python).

On a machine whose load exceeds its cores, run with ``--threads 1``: OpenMP workers wait at
every barrier for descheduled peers, and multi-threaded forwards get several times slower
(and noisier) than single-threaded ones. Runtime: roughly (3 + 2 x speculative rows) plain
generations per prompt, plus the tree row's slower steps.

The command, the tables and the machine load rewrite this benchmark's section of BENCHMARKS.md
(not with --quick or --no-append; the section it replaces moves to bench/HISTORY.md). The
machine is shared: compare ratios, not absolute rates.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.machine import LoadWindow, cpu_name, load_note
from bench.sections import append_benchmarks

from draftlab.errors import DraftlabError
from draftlab.cli_decode import FLAGS
from draftlab.inference.decoding_spec import DecodingSpec, check_spec
from draftlab.inference.shapes import Chain, DynamicTree

REPO = Path(__file__).resolve().parent.parent
COPY_MIB = 256  # bandwidth probe: far beyond any cache level


# ------------------------------------------------------------------------------ timing helpers
def copy_bandwidth(reps: int) -> float:
    """Bytes/s of a large ``copy_`` (read + write), best of ``reps``: interference only slows."""
    n = COPY_MIB * (1 << 20) // 4
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)
    best = float("inf")
    for _ in range(max(reps, 3)):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def streamed_weight_bytes(target) -> dict:
    """Bytes of weights one forward reads: every parameter except the embedding table (a
    lookup reads T rows), plus the lm_head (counted once when tied to the embedding)."""
    embed = target.embed_tokens.weight
    head = target.lm_head.weight
    params = {p.data_ptr(): p for p in target.model.parameters()}
    params.pop(embed.data_ptr(), None)
    params[head.data_ptr()] = head
    total = sum(p.numel() * p.element_size() for p in params.values())
    return {"total": total, "lm_head": head.numel() * head.element_size(), "tied": embed.data_ptr() == head.data_ptr()}


def kv_bytes_per_token(target) -> int:
    c = target.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * target.num_layers * c.num_key_value_heads * head_dim * target.dtype.itemsize


def machine_load() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        path = Path("/proc/loadavg")
        return "load average " + " ".join(path.read_text().split()[:3]) if path.exists() else "n/a"


# ------------------------------------------------------------------------------ rows 1-3
class ForwardCounter:
    """Counts calls of ``target.model`` (HF generate calls the module once per target forward)."""

    def __init__(self, model):
        self.n = 0
        self._h = model.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.n += 1

    def close(self):
        self._h.remove()


def hf_generate(target, prompt_ids, max_new_tokens: int, eos, lookup: tuple[int, int] | None = None) -> dict:
    """One greedy ``generate`` on ``target.model``; ``lookup = (num_tokens, max_ngram)`` turns on
    prompt-lookup decoding. Returns tokens, seconds and the target forwards it ran."""
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=target.device)
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos,
              attention_mask=torch.ones_like(ids))
    if lookup is not None:
        kw.update(prompt_lookup_num_tokens=lookup[0], max_matching_ngram_size=lookup[1])
    counter = ForwardCounter(target.model)
    try:
        t0 = time.perf_counter()
        out = target.model.generate(ids, **kw)
        dt = time.perf_counter() - t0
    finally:
        counter.close()
    return {"tokens": out[0, ids.shape[1]:].tolist(), "time": dt, "forwards": counter.n}


def plain_run(target, prompt_ids, max_new_tokens: int, eos) -> dict:
    from draftlab.inference.decoder import generate_plain

    r = generate_plain(target, prompt_ids, max_new_tokens, eos_token_id=eos)
    return {"tokens": r.tokens, "time": r.total_time, "forwards": r.num_steps + 1}


def run_baselines(target, prompts, max_new_tokens: int, eos, lookup) -> dict[str, list[dict]]:
    """Rows 1-3 on every prompt, back to back, the order rotating per prompt."""
    runs = {
        "plain": lambda ids, n: plain_run(target, ids, n, eos),
        "hf": lambda ids, n: hf_generate(target, ids, n, eos),
        "hf_pld": lambda ids, n: hf_generate(target, ids, n, eos, lookup),
    }
    names = list(runs)
    for name in names:  # warm-up: allocator, thread pool, HF's first-call setup
        runs[name](prompts[0].prompt_ids, min(max_new_tokens, 16))
    out = {name: [] for name in names}
    for i, p in enumerate(prompts):
        for name in names[i % 3:] + names[: i % 3]:
            r = runs[name](p.prompt_ids, max_new_tokens)
            r["category"] = p.category
            out[name].append(r)
        print(f"[baselines {i + 1}/{len(prompts)}] " + " | ".join(
            f"{n} {len(out[n][-1]['tokens']) / out[n][-1]['time']:.1f} tok/s" for n in names), flush=True)
    return out


def summarize_runs(runs: list[dict], plain: list[dict]) -> dict:
    tokens = sum(len(r["tokens"]) for r in runs)
    t = sum(r["time"] for r in runs)
    fwd = sum(r["forwards"] for r in runs)
    matched = sum(r["tokens"] == b["tokens"] for r, b in zip(runs, plain))
    cats = {}
    for r in runs:
        c = cats.setdefault(r["category"], [0, 0])
        c[0] += len(r["tokens"])
        c[1] += r["forwards"]
    return {
        "new_tokens": tokens, "time_s": t, "tokens_per_s": tokens / t, "forwards": fwd,
        "tokens_per_forward": tokens / fwd, "greedy_match": f"{matched}/{len(runs)}",
        "categories_tokens_per_forward": {c: n / f for c, (n, f) in sorted(cats.items())},
    }


# ------------------------------------------------------------------------------ (a)-(c)
def interleaved_ms(fns: dict, reps: int, warmup: int = 2) -> dict[str, dict]:
    """Median and best ms of each callable, run in rotating order every round so that the
    shared machine's drift hits all of them alike (their ratios are paired)."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    times = {n: [] for n in names}
    for r in range(reps):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(1e3 * (time.perf_counter() - t0))
    return {n: {"median": statistics.median(ts), "best": min(ts)} for n, ts in times.items()}


def engine_forwards(target, ctx: list[int], k: int, tree_total: int, reps: int, layers) -> dict:
    """(a)-(c): draftlab's forward for 1, K+1 and tree_total+1 new tokens and HF's for 1 and
    K+1, each on a cache holding ``ctx`` (rolled back after every call), interleaved."""
    dev, model = target.device, target.model
    new = torch.tensor([ctx[-(tree_total + 1):]], device=dev)  # content is irrelevant to the cost
    with torch.no_grad():
        cache = target.new_cache(1, len(ctx) + tree_total + 2)
        target(torch.tensor([ctx], device=dev), cache=cache, logits="last")
        hf_cache = model(torch.tensor([ctx], device=dev), use_cache=True, logits_to_keep=1).past_key_values
    past = cache.length

    def draftlab_step(t: int, tree: bool):
        kw = dict(logits="last") if t == 1 else dict(layers=list(layers), logits="all")  # as generate_plain / _chain_step
        if tree:  # as _tree_step: explicit positions and a bool mask (causal here: the same cost)
            kw["position_ids"] = torch.arange(past, past + t, device=dev)[None]
            kw["attn_mask"] = torch.ones(t, past + t, dtype=torch.bool, device=dev).tril(past)[None]

        def run():
            with torch.no_grad():
                target(new[:, :t], cache=cache, **kw)
            cache.crop(past)
        return run

    def hf_step(t: int):
        def run():  # logits_to_keep as generate passes it (1 plain, K+1 when verifying candidates)
            with torch.no_grad():
                model(new[:, :t], past_key_values=hf_cache, use_cache=True, logits_to_keep=t)
            hf_cache.crop(-t)  # transformers 5: a negative count removes that many positions
        return run

    return interleaved_ms({
        "step_1": draftlab_step(1, False),
        "verify_chain": draftlab_step(k + 1, False),
        "verify_tree": draftlab_step(tree_total + 1, True),
        "hf_1": hf_step(1),
        "hf_chain": hf_step(k + 1),
    }, reps)


class TimedTarget:
    """Stands in for the Target inside ``evaluate`` and records every forward's wall time, so the
    per-step forward cost is measured inside the real runs, interleaved with everything else.
    Plain decoding and both prefills ask for ``logits="last"``; the speculative verify forward
    is the only ``logits="all"`` call (CPU only: no device sync needed around the timer)."""

    def __init__(self, target):
        self._target = target
        self.records: list[tuple[str, int, float]] = []  # (logits mode, new tokens, seconds)

    def __getattr__(self, name):
        return getattr(self._target, name)

    def __call__(self, input_ids, *args, **kwargs):
        t0 = time.perf_counter()
        out = self._target(input_ids, *args, **kwargs)
        self.records.append((kwargs.get("logits", "all"), input_ids.shape[1], time.perf_counter() - t0))
        return out

    def take(self) -> dict:
        """Summary of the records since the last call: plain 1-token steps and verify forwards."""
        plain = [dt for mode, t, dt in self.records if mode == "last" and t == 1]
        verify = [(t, dt) for mode, t, dt in self.records if mode == "all"]
        self.records = []
        return {
            "plain_step_ms": 1e3 * sum(plain) / len(plain) if plain else None,
            "verify_forward_ms": 1e3 * sum(dt for _, dt in verify) / len(verify) if verify else None,
            "verify_forwards": len(verify),
            "verify_tokens_mean": sum(t for t, _ in verify) / len(verify) if verify else None,
        }


# ------------------------------------------------------------------------------ (d)
def random_tree(n: int, depth: int, vocab: int, g: torch.Generator):
    """A valid draft tree of n nodes (root included): each node hangs below a random earlier
    node of depth < ``depth``; all tokens distinct (so siblings are)."""
    parents, depths = [-1], [0]
    for i in range(1, n):
        cand = [j for j in range(i) if depths[j] < depth]
        p = cand[int(torch.randint(len(cand), (1,), generator=g))]
        parents.append(p)
        depths.append(depths[p] + 1)
    tokens = torch.randperm(vocab, generator=g)[:n]
    return tokens[None], torch.tensor([parents])


def kernel_times(vocab: int, k: int, tree: DynamicTree, reps: int) -> dict:
    """(d): each verifier alone (torch backend, CPU) and the decoder-side work feeding it, ms."""
    from draftlab.inference.sampling import process_logits
    from draftlab.kernels import chain_verify_greedy, chain_verify_sampling, tree_verify_greedy, tree_verify_sampling

    g = torch.Generator().manual_seed(0)
    n = tree.total_tokens + 1
    logits_c = torch.randn(k + 1, vocab, generator=g)
    logits_t = torch.randn(1, n, vocab, generator=g)
    drafts = torch.randint(vocab, (k,), generator=g)
    cu = torch.tensor([0, k])
    argmax_c = logits_c.argmax(-1)
    drafts[: min(2, k)] = argmax_c[: min(2, k)]  # accept a couple, like a real step
    probs_c = process_logits(logits_c, 1.0)
    noise_c = torch.empty(k + 1, vocab).exponential_(generator=g)
    unif_c = torch.rand(k, dtype=torch.float64, generator=g)
    ttok, tpar = random_tree(n, tree.depth, vocab, g)
    argmax_t = logits_t.argmax(-1)
    probs_t = process_logits(logits_t, 1.0)
    noise_t = torch.empty(1, n, vocab).exponential_(generator=g)
    unif_t = torch.rand(1, n, dtype=torch.float64, generator=g)
    b = "torch"
    fns = {
        "chain_greedy": lambda: chain_verify_greedy(drafts, cu, argmax_c, backend=b),
        "chain_greedy_prep": lambda: logits_c.argmax(-1),
        "chain_sampling": lambda: chain_verify_sampling(drafts, cu, probs_c, None, unif_c, noise_c, backend=b),
        "chain_sampling_prep": lambda: (process_logits(logits_c, 1.0), torch.empty(k + 1, vocab).exponential_(generator=g)),
        "tree_greedy": lambda: tree_verify_greedy(ttok, tpar, argmax_t, backend=b),
        "tree_greedy_prep": lambda: logits_t.argmax(-1),
        "tree_sampling": lambda: tree_verify_sampling(ttok, tpar, probs_t, unif_t, noise_t, backend=b),
        "tree_sampling_prep": lambda: (process_logits(logits_t, 1.0), torch.empty(1, n, vocab).exponential_(generator=g)),
    }
    # back to back per call (inputs stay cache-hot, as the logits just written by the lm_head are)
    return {name: interleaved_ms({name: fn}, reps)[name]["median"] for name, fn in fns.items()}


# ------------------------------------------------------------------------------ tables
def _f(x, digits=2, suffix="") -> str:
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def main_table(rows: list[dict], skipped_note: str | None) -> str:
    lines = [
        "| # | decoder | tok/s | plain tok/s (paired) | vs draftlab plain | vs HF generate | τ | tok/fwd "
        "| greedy match vs plain | new tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        if r.get("skipped"):
            lines.append(f"| {i} | {r['name']} | skipped: {r['skipped']} | | | | | | | |")
            continue
        lines.append(
            f"| {i} | {r['name']} | {_f(r['tps'], 1)} | {_f(r['plain_tps'], 1)} | {_f(r['vs_plain'], 2, 'x')} | "
            f"{_f(r['vs_hf'], 2, 'x')} | {_f(r.get('tau'))} | {_f(r['tok_per_fwd'])} | {r['match']} | {r['new_tokens']} |"
        )
    if skipped_note:
        lines.append(f"\n{skipped_note}")
    return "\n".join(lines)


def category_table(rows: list[dict]) -> str:
    spec = [r for r in rows if r.get("categories") and not r.get("skipped")]
    cats = sorted({c for r in spec for c in r["categories"]})
    lines = ["| category | " + " | ".join(r["name"] for r in spec) + " |", "|---|" + "---|" * len(spec)]
    for c in cats:
        lines.append(f"| {c} | " + " | ".join(_f(r["categories"].get(c)) for r in spec) + " |")
    lines.append("| all | " + " | ".join(_f(r.get("tau", r["tok_per_fwd"])) for r in spec) + " |")
    return "\n".join(lines)


def engine_table(fw: dict, wb: dict, bw: float, kv_ctx: int, k: int, tree_total: int) -> str:
    """(a)-(c). ``fw``: name -> {"median", "best"} ms from :func:`engine_forwards`."""
    limit = 1e3 * wb["total"] / bw
    m = {n: t["median"] for n, t in fw.items()}
    return "\n".join([
        "| measurement | median (ms) | best (ms) | ratio (medians unless said) |",
        "|---|---|---|---|",
        f"| (a) draftlab decode step, 1 token | {m['step_1']:.2f} | {fw['step_1']['best']:.2f} | "
        f"{m['step_1'] / limit:.2f}x the weight-streaming limit (best: {fw['step_1']['best'] / limit:.2f}x) |",
        f"| (a) weight-streaming limit: {wb['total'] / 1e6:.1f} MB of weights (lm_head {wb['lm_head'] / 1e6:.1f} MB"
        f"{', tied to the embedding' if wb['tied'] else ''}) / {bw / 1e9:.1f} GB/s copy bandwidth (best of reps) | {limit:.2f} | | "
        f"1.00x; + {kv_ctx / 1e6:.1f} MB of KV cache read at this context |",
        f"| (b) draftlab verify forward, K+1 = {k + 1} tokens | {m['verify_chain']:.2f} | {fw['verify_chain']['best']:.2f} | "
        f"**{m['verify_chain'] / m['step_1']:.2f}x** the 1-token step |",
        f"| (b) draftlab tree verify forward, {tree_total + 1} tokens + mask | {m['verify_tree']:.2f} | "
        f"{fw['verify_tree']['best']:.2f} | "
        f"**{m['verify_tree'] / m['step_1']:.2f}x** the 1-token step |",
        f"| (c) HF forward, 1 token | {m['hf_1']:.2f} | {fw['hf_1']['best']:.2f} | draftlab / HF = {m['step_1'] / m['hf_1']:.2f}x |",
        f"| (c) HF forward, K+1 = {k + 1} tokens | {m['hf_chain']:.2f} | {fw['hf_chain']['best']:.2f} | "
        f"{m['hf_chain'] / m['hf_1']:.2f}x HF's 1-token; draftlab / HF = {m['verify_chain'] / m['hf_chain']:.2f}x |",
    ])


def step_table(spec_rows: list[dict], kt: dict, k: int, tree: DynamicTree, vocab: int) -> str:
    """(d) and (e): per speculative row, the per-step split (reports + in-run forward timing)
    and the isolated verify kernels relative to the measured step."""
    lines = [
        "| row | steps | step (ms) | draft / step | verify / step | verify forward (in run; mean tokens) | "
        "verify fwd / plain step (in run) | verify overhead | greedy kernel + argmax | sampling kernel + softmax/noise (T > 0) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    pct = lambda x, step: f"{x:.2f} ({100 * x / step:.1f}%)"  # noqa: E731
    for r in spec_rows:
        rep, fwd = r["report"], r["forwards"]
        steps = rep["num_steps"]
        if not steps:
            continue
        step = 1e3 * (rep["draft_time_s"] + rep["verify_time_s"]) / steps
        draft = 1e3 * rep["draft_time_s"] / steps
        verify = 1e3 * rep["verify_time_s"] / steps
        kind = "tree" if rep["method"] == "tree" else "chain"
        vf, ps = fwd["verify_forward_ms"], fwd["plain_step_ms"]
        lines.append(
            f"| {r['name']} | {steps} | {step:.1f} | {pct(draft, step)} | {pct(verify, step)} | "
            f"{_f(vf, 1)} ({_f(fwd['verify_tokens_mean'], 1)} tok) | {_f(vf / ps if vf and ps else None, 2, 'x')} | "
            f"{pct(verify - vf, step) if vf else '-'} | {pct(kt[kind + '_greedy'] + kt[kind + '_greedy_prep'], step)} | "
            f"{pct(kt[kind + '_sampling'] + kt[kind + '_sampling_prep'], step)} |"
        )
    lines.append(
        f"\nShares are of the step (draft + verify per verify step). \"verify / step\": target forward + verification + cache "
        f"roll-back; \"draft / step\": the proposer's start, propose and advance; \"verify forward (in run)\": the target forward "
        f"alone, timed inside the same runs; \"verify fwd / plain step\": vs the 1-token forwards of evaluate's interleaved plain "
        f"runs; \"verify overhead\" = verify / step minus that forward. Kernels timed alone (torch backend, vocab {vocab}, ms): "
        f"chain K={k}: greedy {kt['chain_greedy']:.3f} + argmax {kt['chain_greedy_prep']:.3f}, sampling {kt['chain_sampling']:.3f} + "
        f"softmax/noise {kt['chain_sampling_prep']:.3f}; tree of {tree.total_tokens + 1} nodes, depth {tree.depth}: greedy "
        f"{kt['tree_greedy']:.3f} + argmax {kt['tree_greedy_prep']:.3f}, sampling {kt['tree_sampling']:.3f} + softmax/noise "
        f"{kt['tree_sampling_prep']:.3f}."
    )
    return "\n".join(lines)


# ------------------------------------------------------------------------------ main
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", default=None, help="EAGLE-3 checkpoint directory (without it the EAGLE rows are skipped)")
    p.add_argument("--num-prompts", type=int, default=24, help="Spec-Bench prompts, round-robin over categories")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=5, help="chain drafts per step (n-gram, EAGLE chain, HF prompt lookup)")
    p.add_argument("--tree-depth", type=int, default=DynamicTree.depth)
    p.add_argument("--tree-topk", type=int, default=DynamicTree.top_k)
    p.add_argument("--tree-total", type=int, default=DynamicTree.total_tokens, help="tree: draft nodes per step")
    p.add_argument("--ngram-max", type=int, default=3, help="n-gram rows: longest n-gram to match")
    p.add_argument("--ngram-min", type=int, default=1, help="draftlab n-gram row: shortest n-gram to match")
    p.add_argument("--min-confidence", type=float, default=0.0, help="extra EAGLE-3 chain row with dynamic draft length (0 = no row)")
    p.add_argument("--lookup-min-match", type=int, default=0, help="extra row: prompt lookup first, EAGLE-3 chain otherwise (0 = no row)")
    p.add_argument("--reps", type=int, default=20, help="timed calls per engine measurement (median)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json", default=None, help="also write every measured number to this JSON file")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 prompts x 16 tokens, 5 reps, BENCHMARKS.md untouched")
    p.add_argument("--no-append", action="store_true", help="print only, do not rewrite this benchmark's section of BENCHMARKS.md")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_new_tokens, args.reps = min(args.num_prompts, 2), min(args.max_new_tokens, 16), min(args.reps, 5)
    if min(args.num_prompts, args.max_new_tokens, args.k, args.reps, args.tree_depth, args.tree_topk, args.tree_total) < 1:
        p.error("--num-prompts, --max-new-tokens, --k, --reps and the tree flags must be >= 1")
    try:  # the same ranges draftlab eval checks
        tree = dict(depth=args.tree_depth, top_k=args.tree_topk, total_tokens=args.tree_total)
        check_spec(DecodingSpec(k=args.k, min_confidence=args.min_confidence, tree=tree, max_new_tokens=args.max_new_tokens), FLAGS)
    except DraftlabError as e:
        p.error(str(e))
    if args.drafter is not None and not Path(args.drafter).is_dir():
        p.error(f"--drafter: no checkpoint directory at {args.drafter}")
    if (args.min_confidence or args.lookup_min_match) and args.drafter is None:
        p.error("--min-confidence and --lookup-min-match add EAGLE-3 rows: they need --drafter")
    return args


def dynamic_runs(proposer, args) -> list[tuple[str, object, Chain]]:
    """Row 7's (name, proposer, shape) triples: dynamic draft length, lookup first, both."""
    from draftlab.inference import hybrid

    runs, c, n = [], args.min_confidence, args.lookup_min_match
    lookup_first = hybrid.lookup_first(proposer, n, args.ngram_max) if n else None
    if c:
        runs.append((f"draftlab EAGLE-3 chain K={args.k}, min confidence {c}", proposer, Chain(args.k, c)))
    if n:
        runs.append((f"draftlab lookup (n-gram >= {n}) else EAGLE-3 chain K={args.k}", lookup_first, Chain(args.k)))
    if c and n:
        runs.append((f"draftlab lookup (n-gram >= {n}) else EAGLE-3 chain K={args.k}, min confidence {c}",
                     lookup_first, Chain(args.k, c)))
    return runs


def spec_row(name: str, report: dict, forwards: dict, hf_over_plain: float) -> dict:
    """A draftlab speculative row from its ``evaluate`` report and in-run forward timings;
    ``hf_over_plain`` = HF generate tok/s / draftlab plain tok/s from the rows 1-3 loop."""
    return {
        "name": name, "tps": report["tokens_per_s"], "plain_tps": report["baseline_tokens_per_s"],
        "vs_plain": report["speedup"], "vs_hf": report["speedup"] / hf_over_plain, "tau": report["tau"],
        "tok_per_fwd": report["new_tokens"] / (report["num_steps"] + report["num_prompts"]),
        "match": report["greedy_match"], "new_tokens": report["new_tokens"],
        "categories": {c: v["tau"] for c, v in report["categories"].items()}, "report": report, "forwards": forwards,
    }


def run_speculative(target, runs, prompts, max_new_tokens: int, eos) -> tuple[dict, dict]:
    """Rows 4-6: ``evaluate`` per (name, proposer, shape), through a :class:`TimedTarget`.
    Returns (reports, in-run forward timings), both by name."""
    from draftlab.inference.decoder import SpeculativeDecoder, generate_plain
    from draftlab.inference.evaluate import evaluate

    timed = TimedTarget(target)
    reports, forwards = {}, {}
    for name, proposer, shape in runs:
        # evaluate's own warm-up, done here so that its forwards stay out of the in-run timings
        n = min(max_new_tokens, 16)
        generate_plain(timed, prompts[0].prompt_ids, n, eos_token_id=eos)
        SpeculativeDecoder(timed, proposer).generate(prompts[0].prompt_ids, n, shape, eos_token_id=eos)
        timed.take()

        def progress(i, total, res, name=name):
            print(f"[{name} {i + 1}/{total}] tau={res.stats().tau:.2f} {res.tokens_per_s:.1f} tok/s", flush=True)

        reports[name] = evaluate(timed, proposer, prompts, shape, max_new_tokens=max_new_tokens,
                                 eos_token_id=eos, warmup=False, data="spec-bench", label=name, progress=progress)
        forwards[name] = timed.take()
    return reports, forwards


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    import transformers

    transformers.logging.set_verbosity_error()  # generate's per-call notices would drown the progress lines
    from draftlab.inference.ngram import NgramProposer
    from draftlab.inference.prompts import load_prompts
    from draftlab.models.target import Target

    uptime_start = machine_load()
    load1, cores, threads = os.getloadavg()[0], os.cpu_count() or 1, torch.get_num_threads()
    if threads > 1 and load1 + threads > cores + 0.5:
        # OpenMP workers spin at barriers and wait for descheduled peers: on an oversubscribed
        # machine a multi-threaded forward can be several times slower than a single-threaded one.
        print(f"warning: load average {load1:.1f} on {cores} cores with {threads} torch threads: "
              f"timings will suffer from oversubscription; consider --threads 1", flush=True)
    target = Target.load("default")
    if target.dtype != torch.float32 or target.device.type != "cpu":
        raise SystemExit(f"the benchmark is fp32 on CPU; the default target loaded as {target.dtype} on {target.device}")
    eos = target.tokenizer.eos_token_id
    prompts = load_prompts("spec-bench", target.tokenizer, args.num_prompts)
    tree = DynamicTree(depth=args.tree_depth, top_k=args.tree_topk, total_tokens=args.tree_total)
    proposer = None
    if args.drafter:
        from draftlab.inference.proposer import load_proposer

        proposer = load_proposer(args.drafter, target)
    M = args.max_new_tokens
    print(f"{len(prompts)} Spec-Bench prompts ({len({p.category for p in prompts})} categories), max_new_tokens {M}, "
          f"K {args.k}, tree {vars(tree)}, {torch.get_num_threads()} threads; {uptime_start}", flush=True)

    measured = LoadWindow()
    base = run_baselines(target, prompts, M, eos, (args.k, args.ngram_max))
    plain = summarize_runs(base["plain"], base["plain"])
    hf = summarize_runs(base["hf"], base["plain"])
    pld = summarize_runs(base["hf_pld"], base["plain"])
    hf_over_plain = hf["tokens_per_s"] / plain["tokens_per_s"]

    runs = [("ngram", NgramProposer(args.ngram_max, args.ngram_min), Chain(args.k))]
    if proposer is not None:
        extra = dynamic_runs(proposer, args)
        runs += [("eagle3 chain", proposer, Chain(args.k)), ("eagle3 tree", proposer, tree)] + extra
    reports, forwards = run_speculative(target, runs, prompts, M, eos)

    def baseline_row(name, s, vs_plain, vs_hf, cats=None):
        return {"name": name, "tps": s["tokens_per_s"], "plain_tps": plain["tokens_per_s"], "vs_plain": vs_plain,
                "vs_hf": vs_hf, "tok_per_fwd": s["tokens_per_forward"], "match": s["greedy_match"],
                "new_tokens": s["new_tokens"], **({"categories": cats} if cats else {})}

    rows = [
        {**baseline_row("draftlab plain greedy", plain, 1.0, 1 / hf_over_plain), "match": "(reference)"},
        baseline_row("HF generate greedy", hf, hf_over_plain, 1.0),
        baseline_row(f"HF prompt lookup (K={args.k}, ngram {args.ngram_max})", pld, pld["tokens_per_s"] / plain["tokens_per_s"],
                     pld["tokens_per_s"] / hf["tokens_per_s"], pld["categories_tokens_per_forward"]),
        spec_row(f"draftlab n-gram chain K={args.k}", reports["ngram"], forwards["ngram"], hf_over_plain),
    ]
    if proposer is not None:
        rows.append(spec_row(f"draftlab EAGLE-3 chain K={args.k}", reports["eagle3 chain"], forwards["eagle3 chain"], hf_over_plain))
        rows.append(spec_row(f"draftlab EAGLE-3 tree d{tree.depth}/k{tree.top_k}/n{tree.total_tokens}", reports["eagle3 tree"],
                             forwards["eagle3 tree"], hf_over_plain))
        rows += [spec_row(name, reports[name], forwards[name], hf_over_plain) for name, _, _ in extra]
        skipped = None
    else:
        rows += [{"name": f"draftlab EAGLE-3 chain K={args.k}", "skipped": "no --drafter"},
                 {"name": "draftlab EAGLE-3 tree", "skipped": "no --drafter"}]
        skipped = "EAGLE-3 rows skipped: no --drafter checkpoint given."

    # engine measurements: context = first prompt + half of its plain continuation
    print("engine measurements ...", flush=True)
    ctx = list(prompts[0].prompt_ids) + base["plain"][0]["tokens"][: M // 2]
    layers = proposer.layers if proposer is not None else ()
    fw = engine_forwards(target, ctx, args.k, tree.total_tokens, args.reps, layers)
    wb = streamed_weight_bytes(target)
    bw = copy_bandwidth(args.reps)
    kt = kernel_times(target.vocab_size, args.k, tree, args.reps)
    window = measured.close()

    spec_rows = [r for r in rows if "report" in r]
    legend = ("τ = 1 + Σ a_j (verify steps, prefill excluded; HF prompt lookup has no τ, see tok/fwd); tok/fwd = new tokens / "
              "target forwards incl. prefill (HF rows: counted). \"vs draftlab plain\": rows 2-3 paired in the rows 1-3 loop, rows 4+ "
              "the evaluate() speedup (its own paired plain runs, column \"plain tok/s (paired)\"); \"vs HF generate\": rows 4+ = "
              "evaluate speedup x (draftlab plain / HF generate) of the loop. Greedy match: prompts whose tokens equal "
              "draftlab plain's.")
    tables = {
        "main": main_table(rows, skipped),
        "categories": category_table(rows),
        "engine": engine_table(fw, wb, bw, kv_bytes_per_token(target) * len(ctx), args.k, tree.total_tokens),
        "steps": step_table(spec_rows, kt, args.k, tree, target.vocab_size),
    }
    note = load_note(window) + f"; `uptime` at start: {uptime_start}; at end: {machine_load()}"
    text = (
        f"{tables['main']}\n\n{legend}\n\n"
        f"Per-category τ (speculative rows; HF prompt lookup: tok/fwd incl. prefill):\n\n{tables['categories']}\n\n"
        f"Engine, context {len(ctx)} tokens (first prompt + {M // 2} generated), {args.reps} calls each, interleaved:\n\n"
        f"{tables['engine']}\n\n"
        f"Per speculative step (from the evaluate reports) and the verify kernels' share:\n\n{tables['steps']}\n\n"
        f"Machine: {note} (shared machine: compare ratios, not absolute rates)."
    )
    print()
    print(text)
    if args.json:
        write_json(Path(args.json), {"args": vars(args), "rows": [{k: v for k, v in r.items() if k != "report"} for r in rows],
                                     "reports": reports, "engine_ms": fw, "weight_bytes": wb,
                                     "copy_bandwidth": bw, "kernels_ms": kt, "machine": note})
    if not (args.quick or args.no_append):
        append_result(argv, args, len(prompts), tree, text)
    return 0


def write_json(path: Path, obj) -> None:
    from draftlab.atomic import write_json as write_atomic

    write_atomic(path, obj)
    print(f"wrote {path}")


def append_result(argv, args, num_prompts: int, tree: DynamicTree, text: str) -> None:
    cmd = "python -m bench.e2e " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    import transformers

    header = (
        f"\n## End-to-end greedy decoding, draftlab vs HF transformers "
        f"({datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')})\n\n"
        f"Command: `{cmd.strip()}`\n\n"
        f"Target default (SmolLM2-135M-Instruct, fp32, CPU), {num_prompts} Spec-Bench prompts (round-robin over categories), "
        f"max_new_tokens {args.max_new_tokens} (stop at eos), greedy, K {args.k}, tree depth {tree.depth} / top-k {tree.top_k} / "
        f"total {tree.total_tokens}, drafter `{args.drafter or 'none'}`. {cpu_name()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}, transformers {transformers.__version__}. Method: bench/e2e.py docstring.\n\n"
    )
    append_benchmarks(header + text + "\n")


if __name__ == "__main__":
    sys.exit(main())
