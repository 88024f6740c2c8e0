"""``draftlab eval``: acceptance (a_j, alpha_j, tau) and speedup of a drafter on a prompt set.

For every prompt the plain baseline and speculative decoding run in lockstep (one step of each
in turn, so the machine's slow spells slow both alike), on the same prompt with the same
``max_new_tokens`` and sampling settings. One untimed warm-up generation of each kind runs first
(allocator, kernel compilation). Metrics come from :mod:`draftlab.inference.metrics`.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from draftlab.errors import DraftlabError
from draftlab.inference.decoder import Decoder, single, run_lockstep
from draftlab.inference.metrics import AcceptanceStats, tau_prompt_mean
from draftlab.inference.prompts import DATA_SETS, EvalPrompt
from draftlab.inference.proposer import (
    CHOICES_EXAMPLE,
    MAX_BATCH_SIZE,
    MAX_K,
    MAX_NEW_TOKENS,
    MAX_TREE_NODES,
    METHODS,
    TEMPERATURE_RANGE,
    Chain,
    DynamicTree,
    OptionError,
    Proposer,
    Shape,
    StaticTree,
    check_decoding,
    check_shape,
    load_proposer,
    make_shape,
    shape_fields,
)


class _Totals:
    """Accumulates runs of one group (all prompts, or one category)."""

    def __init__(self):
        self.stats = AcceptanceStats()
        self.prompt_stats: list[AcceptanceStats] = []  # one per prompt, for SpecForge's tau
        self.prompts = 0
        self.tokens = self.base_tokens = 0
        self.time = self.base_time = self.draft_time = self.verify_time = self.prefill_time = 0.0
        self.matched = self.compared = 0

    def add(self, spec, base, compare: bool) -> None:
        self.prompts += 1
        self.prompt_stats.append(spec.stats())
        self.stats.merge(self.prompt_stats[-1])
        self.tokens += len(spec.tokens)
        self.time += spec.total_time
        self.draft_time += spec.draft_time
        self.verify_time += spec.verify_time
        self.prefill_time += spec.prefill_time
        if base is not None:
            self.base_tokens += len(base.tokens)
            self.base_time += base.total_time
            if compare:
                self.compared += 1
                self.matched += int(spec.tokens == base.tokens)

    def to_dict(self, baseline: bool) -> dict:
        tps = self.tokens / self.time if self.time > 0 else 0.0
        base_tps = self.base_tokens / self.base_time if baseline and self.base_time > 0 else None
        return {
            "num_prompts": self.prompts,
            **self.stats.to_dict(),
            "tau_prompt_mean": tau_prompt_mean(self.prompt_stats),
            "new_tokens": self.tokens,
            "tokens_per_s": tps,
            "baseline_tokens_per_s": base_tps,
            "speedup": tps / base_tps if base_tps else None,
            "greedy_match": f"{self.matched}/{self.compared}" if self.compared else None,
            "draft_time_s": self.draft_time,
            "verify_time_s": self.verify_time,
            "prefill_time_s": self.prefill_time,
            "total_time_s": self.time,
            "baseline_new_tokens": self.base_tokens if baseline else None,
            "baseline_time_s": self.base_time if baseline else None,
        }


def evaluate(
    target,
    proposer: Proposer,
    prompts: list[EvalPrompt],
    shape: Shape = Chain(5),
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_id=None,
    baseline: bool = True,
    warmup: bool = True,
    backend: str = "auto",
    data: str | None = None,
    label: str | None = None,
    progress=None,
    cuda_graphs: bool = False,
) -> dict:
    """Decode every prompt (prompt i with seed ``seed + i``) plainly and drafting ``shape`` each
    step, in lockstep (the batch-size-1 case of :mod:`~draftlab.inference.batch_eval`'s harness,
    the order alternating from prompt to prompt), and return the report dict, per prompt and per
    category. ``progress(i, n, spec_result)`` is called after each prompt when given.
    ``cuda_graphs``: both decodings replay captured graphs (:mod:`~draftlab.inference.graphs`)."""
    if not prompts:
        raise DraftlabError("evaluation needs at least one prompt")
    verifier_note = proposer.verifier_report(target, prompts, max_new_tokens, eos_token_id)
    target, graphs = graphed(proposer.verifier(target), proposer, cuda_graphs)
    decoder, plain = Decoder(target, proposer, backend=backend), Decoder(target)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id)
    if warmup:
        n = min(max_new_tokens, 16)
        plain.generate([prompts[0].prompt_ids], n, None, seed=seed, **sampling)
        decoder.generate([prompts[0].prompt_ids], n, shape, seed=seed, **sampling)
    compare = baseline and temperature == 0.0
    total, by_cat = _Totals(), {}
    per_prompt = []
    for i, p in enumerate(prompts):
        runs = [decoder.steps([p.prompt_ids], max_new_tokens, shape, seed=seed + i, **sampling)]
        if baseline:
            runs.insert(i % 2, plain.steps([p.prompt_ids], max_new_tokens, None, seed=seed + i, **sampling))
        done = [single(r) for r in run_lockstep(runs)]
        spec = done[(i + 1) % 2] if baseline else done[0]
        base = done[i % 2] if baseline else None
        for group in (total, by_cat.setdefault(p.category, _Totals())):
            group.add(spec, base, compare)
        per_prompt.append(
            {
                "id": p.id,
                "category": p.category,
                "prompt_tokens": len(p.prompt_ids),
                "new_tokens": len(spec.tokens),
                "tau": spec.stats().tau,
                "tokens_per_s": spec.tokens_per_s,
                "baseline_tokens_per_s": base.tokens_per_s if base else None,
                "matched": (spec.tokens == base.tokens) if compare else None,
            }
        )
        if progress is not None:
            progress(i, len(prompts), spec)
    return {
        "label": label,
        "drafter": proposer.name,
        "verifier": target.identity.get("name"),
        "target": dict(getattr(target, "identity", {})),
        "data": data,
        **shape_fields(shape),
        **draft_cache_fields(proposer, target),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "seed": seed,
        "device": _device_name(target.device),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **total.to_dict(baseline),
        "categories": {c: t.to_dict(baseline) for c, t in sorted(by_cat.items())},
        "prompts": per_prompt,
        **({"verifier_check": verifier_note} if verifier_note else {}),
        **({"cuda_graphs": graphs()} if graphs else {}),
    }


def graphed(target, proposer, on: bool):
    """When ``on``: ``target`` and the proposer's own model (a draft LM's) with their decoding
    forwards replayed as CUDA graphs, and a function giving their counts for a report (since
    the proposer's model was first wrapped: wrapping is done once); else (target, None)."""
    if not on:
        return target, None
    from draftlab.inference.graphs import GraphedTarget

    wrapped = {"target": GraphedTarget(target)}

    def wrap(model):
        wrapped["drafter"] = model if isinstance(model, GraphedTarget) else GraphedTarget(model)
        return wrapped["drafter"]

    proposer.use_graphs(wrap)
    return wrapped["target"], lambda: {k: g.report() for k, g in wrapped.items()}


def draft_cache_fields(proposer: Proposer, target) -> dict:
    """``draft_kv_cache``: the drafter's own KV cache per token of context beside the target's,
    when the proposer says it keeps one (a draft model's is a real cost beside the target's)."""
    draft = getattr(proposer, "cache_bytes_per_token", None)
    if draft is None:
        return {}
    base = target.kv_bytes_per_token
    return {"draft_kv_cache": {"bytes_per_token": draft, "target_bytes_per_token": base, "share": draft / base}}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


# ---------------------------------------------------------------------- CLI
# The flag of each decoding option, as check_decoding's errors name them (OptionError.option).
FLAGS = {
    "k": "--k", "min_confidence": "--min-confidence", "tree.depth": "--tree-depth", "tree.top_k": "--tree-topk",
    "tree.total_tokens": "--tree-total", "static_tree": "--tree-choices:", "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "batch_sizes": "--batch-sizes", "seed": "--seed",
}


@contextmanager
def flag_names():
    """Re-word an :class:`OptionError` raised inside with the option's flag."""
    try:
        yield
    except OptionError as e:
        raise e.renamed(FLAGS) from None


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by ``draftlab eval`` and ``draftlab generate``."""
    lo, hi = TEMPERATURE_RANGE
    p.add_argument("--drafter", required=True,
                   help="drafter checkpoint directory, 'ngram' (prompt lookup) or another training-free drafter's name")
    p.add_argument("--drafter-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of a training-free drafter other than ngram (repeat for more)")
    p.add_argument("--target", default="default", help="HF dir, hub id, .gguf file or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument("--method", choices=list(METHODS), default="chain",
                   help="draft shape: chain, tree (EAGLE-2 dynamic tree), static_tree (needs --tree-choices) or block")
    p.add_argument("--k", type=int, default=5, help=f"chain and block: drafts per step (1..{MAX_K})")
    p.add_argument("--tree-depth", type=int, default=DynamicTree.depth,
                   help=f"tree: expansion steps (1..{MAX_TREE_NODES}; never more than --tree-total)")
    p.add_argument("--tree-topk", type=int, default=DynamicTree.top_k,
                   help=f"tree: children per node (1..{MAX_TREE_NODES}, at most the draft vocabulary)")
    p.add_argument("--tree-total", type=int, default=DynamicTree.total_tokens, help=f"tree: draft nodes per step (1..{MAX_TREE_NODES})")
    p.add_argument("--tree-choices", default=None,
                   help=f"static_tree: a JSON list of at most {MAX_TREE_NODES} paths of candidate ranks, e.g. '[[0], [1], [0, 0]]', "
                   "or a .json file holding one")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help=f"1..{MAX_NEW_TOKENS}, and at most the target's positions less the prompt")
    p.add_argument("--temperature", type=float, default=0.0, help=f"0 = greedy, else {lo:g}..{hi:g}")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"], help="verify kernels")
    p.add_argument("--ngram-max", type=int, default=3, help="ngram drafter: longest n-gram to match")
    p.add_argument("--ngram-min", type=int, default=1, help="ngram drafter: shortest n-gram to match")
    p.add_argument(
        "--min-confidence", type=float, default=0.0,
        help="chain: stop drafting once the product of the drafter's top-1 probabilities falls below this (0 = always k)",
    )
    p.add_argument(
        "--lookup-min-match", type=int, default=0,
        help="chain: draft by prompt lookup when an n-gram of at least this many tokens (<= --ngram-max) recurs, "
        "by the drafter otherwise (0 = off)",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument(
        "--data", default="spec-bench", help=f"prompt set: {', '.join(DATA_SETS)} or a .jsonl file (messages or Spec-Bench form)"
    )
    p.add_argument("--recipe", default=None, help="sharegpt-heldout: take the data split from this recipe YAML")
    p.add_argument("overrides", nargs="*", metavar="dotted.key=value",
                   help="with --recipe: overrides as `draftlab train` takes them (e.g. data.heldout=64), so the split "
                   "is the one a run trained with them used")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="this many prompts, round-robin over categories (more than the set holds is an error)")
    p.add_argument("--report", default=None, help="write the JSON report here (plus .md and .png next to it)")
    p.add_argument("--no-baseline", action="store_true", help="skip plain decoding (no speedup, no greedy match)")
    p.add_argument("--batch-sizes", default=None,
                   help=f"also decode the prompts in batches of these sizes (e.g. 1,2,4,8,16; each 1..{MAX_BATCH_SIZE}): "
                   "speedup by batch size")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay the target's decoding forwards as CUDA graphs over a static KV cache (plain and "
                   "speculative alike; needs a CUDA device); the report counts forwards replayed and run eagerly")
    p.add_argument("--adaptive", action="store_true",
                   help="with --batch-sizes: choose the draft length per step (0..--k) from observed acceptance "
                   "and the verify cost measured at start-up")


def check_decoding_options(args) -> list[int] | None:
    """Every decoding flag in range (a one-line DraftlabError naming the flag and its limits),
    checked before any model loads: n-gram lookup and dynamic drafting here, the rest by
    :func:`~draftlab.inference.proposer.check_decoding` and the draft shapes (every flag, the
    ones the method does not use too). Returns ``--batch-sizes`` parsed (None without it)."""
    if not 1 <= args.ngram_min <= args.ngram_max:
        raise DraftlabError(f"--ngram-min/--ngram-max: need 1 <= min <= max, got {args.ngram_min}, {args.ngram_max}")
    if not 0.0 <= args.min_confidence < 1.0:
        raise DraftlabError(f"--min-confidence must be in [0, 1), got {args.min_confidence}")
    if not 0 <= args.lookup_min_match <= args.ngram_max:
        raise DraftlabError(f"--lookup-min-match must be in 0..--ngram-max ({args.ngram_max}), got {args.lookup_min_match}")
    batch_sizes = None
    if getattr(args, "batch_sizes", None) is not None:
        from draftlab.inference.batch_eval import parse_batch_sizes

        batch_sizes = parse_batch_sizes(args.batch_sizes)
    with flag_names():
        Chain(args.k)
        DynamicTree(args.tree_depth, args.tree_topk, args.tree_total)
        check_decoding(None, args.max_new_tokens, args.temperature, args.top_k, args.top_p, batch_sizes, args.seed)
    return batch_sizes


def tree_choices(value: str) -> StaticTree:
    """``--tree-choices``: a JSON list of paths, or the path of a .json file holding one."""
    try:
        text = value if value.lstrip().startswith("[") else Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DraftlabError(f"--tree-choices: neither a JSON list nor a readable file: {value} ({getattr(e, 'strerror', None) or e})") from None
    try:
        return StaticTree(json.loads(text))
    except json.JSONDecodeError as e:
        raise DraftlabError(f"--tree-choices: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise DraftlabError("--tree-choices: invalid JSON (nested too deeply)") from None
    except DraftlabError as e:
        raise DraftlabError(f"--tree-choices: {e}") from None


def decoding_shape(args) -> Shape:
    """The draft shape the flags ask for (a one-line error naming the flag), before any model loads."""
    if args.tree_choices is not None and args.method != "static_tree":
        raise DraftlabError("--tree-choices applies to --method static_tree")
    if args.min_confidence and args.method != "chain":
        raise DraftlabError("--min-confidence sets a chain's draft length: use --method chain")
    if args.method == "static_tree":
        if args.tree_choices is None:
            raise DraftlabError(f"--method static_tree needs --tree-choices (paths of candidate ranks, e.g. '{CHOICES_EXAMPLE}')")
        return tree_choices(args.tree_choices)
    tree = dict(depth=args.tree_depth, top_k=args.tree_topk, total_tokens=args.tree_total)
    with flag_names():
        return make_shape(args.method, args.k, args.min_confidence, tree)


def check_fits(args, target, prompt_length: int) -> None:
    """``--max-new-tokens`` within the target's positions less ``prompt_length`` (the longest
    prompt's), once the prompts are tokenised and before they decode."""
    positions = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    with flag_names():
        check_decoding(None, args.max_new_tokens, args.temperature, args.top_k, args.top_p, None, args.seed,
                       max_positions=positions if isinstance(positions, int) and positions > 0 else None,
                       prompt_length=prompt_length)


def free_drafter(args, shape: Shape):
    """For ``--drafter NAME`` of a training-free drafter (:data:`FREE_DRAFTERS`): its
    ``--drafter-option`` values and the shape checked, the function that builds its proposer
    next to the target; None for 'ngram' or a checkpoint directory."""
    from draftlab.inference.proposer import FREE_DRAFTERS

    pairs = [o.partition("=") for o in args.drafter_option]
    names = [] if args.drafter == "ngram" else FREE_DRAFTERS.names()
    if args.drafter not in names:
        if args.drafter != "ngram" and not Path(args.drafter).is_dir():
            raise DraftlabError(f"--drafter: no checkpoint directory at {args.drafter} (or pass one of: ngram, {', '.join(names)})")
        if pairs:
            raise DraftlabError(f"--drafter-option applies to a training-free drafter other than 'ngram', not to {args.drafter}")
        return None
    for option, (key, eq, _) in zip(args.drafter_option, pairs):
        if not key or not eq:
            raise DraftlabError(f"--drafter-option: expected KEY=VALUE, got {option!r}")
    cls = FREE_DRAFTERS.get(args.drafter)
    check_shape(shape, cls.shapes, cls.name)
    return cls.from_options({key: value for key, _, value in pairs})


def load_models(args) -> tuple:
    """(target, proposer, shape) from the shared flags; the flags are checked first, and the
    shape against the drafter (its vocabulary, what its family drafts) before it returns."""
    from draftlab.models.target import Target

    check_decoding_options(args)
    shape = decoding_shape(args)
    build = free_drafter(args, shape)
    if (args.drafter == "ngram" or build) and (args.lookup_min_match or args.min_confidence):
        raise DraftlabError(f"--lookup-min-match and --min-confidence apply to a trained drafter, not to '{args.drafter}'")
    if args.lookup_min_match and args.method != "chain":
        raise DraftlabError("--lookup-min-match drafts chains: use --method chain")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target = Target.load(args.target, dtype=args.dtype, device=device)
    with flag_names():
        if args.drafter == "ngram":
            from draftlab.inference.ngram import NgramProposer

            proposer = NgramProposer(args.ngram_max, args.ngram_min)
            check_shape(shape, proposer.shapes, proposer.name)
        elif build:
            proposer = build(target)
        else:
            proposer = load_proposer(args.drafter, target, shape)
        check_decoding(shape, draft_vocab=proposer.draft_vocab or target.vocab_size)
    if args.lookup_min_match:
        from draftlab.inference.hybrid import LookupFirstProposer

        proposer = LookupFirstProposer(proposer, args.lookup_min_match, args.ngram_max)
    return target, proposer, shape


def run(args) -> int:
    from draftlab.inference.prompts import prompt_conversations, tokenize_prompts
    from draftlab.inference.report import batch_table, markdown_table, write_report

    batch_sizes = check_decoding_options(args)
    if args.adaptive and (batch_sizes is None or args.method not in ("chain", "block")):
        raise DraftlabError("--adaptive chooses a chain's or block's draft length per step: it needs --batch-sizes and --method chain or block")
    if batch_sizes and args.no_baseline:
        raise DraftlabError("--batch-sizes measures speedup over plain batched decoding: drop --no-baseline")
    data_spec = None
    if args.overrides and not args.recipe:
        raise DraftlabError(f"overrides ({' '.join(args.overrides)}) apply to a recipe: pass --recipe")
    if args.recipe:
        from draftlab.recipe import load_recipe

        data_spec = load_recipe(args.recipe, args.overrides).data
    decoding_shape(args)
    if args.cuda_graphs and (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).split(":")[0] != "cuda":
        raise DraftlabError("--cuda-graphs needs a CUDA device (--device cuda)")
    convs = prompt_conversations(args.data, args.num_prompts, data_spec=data_spec, option="--num-prompts")
    target, proposer, shape = load_models(args)
    prompts = tokenize_prompts(convs, target.tokenizer)
    check_fits(args, target, max(len(p.prompt_ids) for p in prompts))

    def progress(i, n, res):
        print(f"[{i + 1}/{n}] tau={res.stats().tau:.2f} {res.tokens_per_s:.1f} tok/s", flush=True)

    report = evaluate(
        target,
        proposer,
        prompts,
        shape=shape,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_token_id=target.tokenizer.eos_token_id,
        baseline=not args.no_baseline,
        backend=args.backend,
        data=args.data,
        label=Path(args.drafter).name,
        progress=progress,
        cuda_graphs=args.cuda_graphs,
    )
    if batch_sizes:
        from draftlab.inference.batch_eval import evaluate_batches

        def batch_progress(B, done, n):
            print(f"[batch {B}] {done}/{n} prompts", flush=True)

        report["batches"] = evaluate_batches(
            target, proposer, prompts, shape, batch_sizes, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
            eos_token_id=target.tokenizer.eos_token_id, adaptive=args.adaptive, backend=args.backend,
            progress=batch_progress, cuda_graphs=args.cuda_graphs,
        )
    print(markdown_table(report), end="")
    if batch_sizes:
        print(batch_table(report["batches"]), end="")
    if args.report:
        paths = write_report(report, args.report)
        print(f"report: {', '.join(str(p) for p in paths.values())}")
    return 0
