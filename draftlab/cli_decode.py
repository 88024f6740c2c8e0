"""``draftlab eval`` and ``draftlab generate``: their flags, the checks of them, model loading and
the commands themselves.

Both build a :class:`~draftlab.inference.decoding_spec.DecodingSpec` from their flags (the type
a recipe's ``eval:`` section is) and check it with the same
:func:`~draftlab.inference.decoding_spec.check_spec`, naming the flags (:data:`FLAGS`), before
any model loads; what depends on the models is checked once they are loaded, before any
decoding.

``draftlab eval``: acceptance (a_j, alpha_j, tau) and speedup of a drafter on a prompt set
(:func:`~draftlab.inference.evaluate.acceptance_report`).

``draftlab generate``: interactive speculative generation with live acceptance statistics.
Prompts come from ``--prompt`` or, without it, one per stdin line. Each is sent as a user turn
through the target's chat template; the reply streams to stdout as the verifier accepts tokens,
then one line of statistics (tau of this reply and of the session so far, tokens/s) goes to
stderr. Prompts must be UTF-8 text: one that is not is a one-line error naming ``--prompt``,
``--system`` or the stdin line. A terminal's lines are read as they are typed; stdin that is not
a terminal (a file, a pipe) is read whole and checked before any model loads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from draftlab.errors import DraftlabError
from draftlab.inference.decoding_spec import DecodingSpec, check_spec, named
from draftlab.inference.shapes import (
    CHOICES_EXAMPLE, METHODS, DynamicTree, OptionError, Shape, check_decoding, check_shape,
)
from draftlab.limits import MAX_BATCH_SIZE, MAX_K, MAX_NEW_TOKENS, MAX_TREE_NODES, TEMPERATURE_RANGE

# each option of the decoding spec by its flag, as check_spec's errors name them
FLAGS = {
    "method": "--method", "k": "--k", "min_confidence": "--min-confidence", "tree.depth": "--tree-depth",
    "tree.top_k": "--tree-topk", "tree.total_tokens": "--tree-total", "static_tree": "--tree-choices",
    "max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
    "batch_sizes": "--batch-sizes", "adaptive": "--adaptive", "cuda_graphs": "--cuda-graphs", "seed": "--seed",
    "no_baseline": "--no-baseline",
}


class Command(NamedTuple):
    """A subcommand of :mod:`draftlab.cli`."""

    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ---------------------------------------------------------------------- flags
def add_decoding_arguments(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"], help="verify kernels")
    p.add_argument("--ngram-max", type=int, default=3, help="ngram drafter: longest n-gram to match")
    p.add_argument("--ngram-min", type=int, default=1, help="ngram drafter: shortest n-gram to match")
    p.add_argument(
        "--min-confidence", type=float, default=0.0,
        help="chain: stop drafting once the product of the drafter's top-1 probabilities falls below this (0 = always k); "
        "block: cut the block where the product of the predicted acceptances does (drafters with a confidence head: dspark)",
    )
    p.add_argument(
        "--lookup-min-match", type=int, default=0,
        help="chain: draft by prompt lookup when an n-gram of at least this many tokens (<= --ngram-max) recurs, "
        "by the drafter otherwise (0 = off)",
    )


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    from draftlab.inference.prompts import DATA_SETS

    add_decoding_arguments(p)
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


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    add_decoding_arguments(p)
    p.add_argument("--prompt", default=None, help="one prompt; without it, prompts are read from stdin, one per line")
    p.add_argument("--system", default=None, help="optional system message")


# ---------------------------------------------------------------------- checks, before any model loads
def device_of(args) -> str:
    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def tree_choices(value: str) -> list:
    """``--tree-choices``: a JSON list of paths, or the path of a .json file holding one (the
    paths themselves are check_spec's to check)."""
    try:
        text = value if value.lstrip().startswith("[") else Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DraftlabError(f"--tree-choices: neither a JSON list nor a readable file: {value} ({getattr(e, 'strerror', None) or e})") from None
    try:
        choices = json.loads(text)
    except json.JSONDecodeError as e:
        raise DraftlabError(f"--tree-choices: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise DraftlabError("--tree-choices: invalid JSON (nested too deeply)") from None
    if not isinstance(choices, list):
        raise DraftlabError(f"--tree-choices: expected a JSON list of paths of candidate ranks, e.g. '{CHOICES_EXAMPLE}'")
    return choices


def decoding_spec(args) -> DecodingSpec:
    """The decoding spec the flags ask for, checked (a one-line DraftlabError naming the flag):
    every flag, the ones the method does not use too, and the drafter's own flags (n-gram lookup)."""
    from draftlab.inference.batch_eval import parse_batch_sizes

    if not 1 <= args.ngram_min <= args.ngram_max:
        raise DraftlabError(f"--ngram-min/--ngram-max: need 1 <= min <= max, got {args.ngram_min}, {args.ngram_max}")
    if not 0 <= args.lookup_min_match <= args.ngram_max:
        raise DraftlabError(f"--lookup-min-match must be in 0..--ngram-max ({args.ngram_max}), got {args.lookup_min_match}")
    batch_sizes = getattr(args, "batch_sizes", None)
    spec = DecodingSpec(
        method=args.method, k=args.k, min_confidence=args.min_confidence,
        tree=dict(depth=args.tree_depth, top_k=args.tree_topk, total_tokens=args.tree_total),
        static_tree=None if args.tree_choices is None else tree_choices(args.tree_choices),
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        baseline=not getattr(args, "no_baseline", False),
        batch_sizes=None if batch_sizes is None else parse_batch_sizes(batch_sizes),
        adaptive=getattr(args, "adaptive", False), cuda_graphs=getattr(args, "cuda_graphs", False),
    )
    check_spec(spec, FLAGS, seed=args.seed, device=device_of(args))
    if args.lookup_min_match and args.method != "chain":
        raise DraftlabError("--lookup-min-match drafts chains: use --method chain")
    return spec


def check_fits(spec: DecodingSpec, target, prompt_length: int) -> None:
    """``--max-new-tokens`` within the target's positions less ``prompt_length`` (the longest
    prompt's), once the prompts are tokenised and before they decode."""
    positions = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    try:
        check_decoding(None, spec.max_new_tokens, prompt_length=prompt_length,
                       max_positions=positions if isinstance(positions, int) and positions > 0 else None)
    except OptionError as e:
        raise named(e, FLAGS) from None


# ---------------------------------------------------------------------- models
def free_drafter(args, shape: Shape):
    """For ``--drafter NAME`` of a training-free drafter (``FREE_DRAFTERS``): its
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


def load_models(args, spec: DecodingSpec) -> tuple:
    """(target, proposer) for a checked ``spec``; the drafter's flags are checked before the target
    loads, and the shape against the drafter (its vocabulary, what its family drafts) after."""
    from draftlab.inference.proposer import load_proposer
    from draftlab.models.target import Target

    shape = spec.shape()
    build = free_drafter(args, shape)
    if (args.drafter == "ngram" or build) and (args.lookup_min_match or args.min_confidence):
        raise DraftlabError(f"--lookup-min-match and --min-confidence apply to a trained drafter, not to '{args.drafter}'")
    target = Target.load(args.target, dtype=args.dtype, device=device_of(args))
    try:
        if args.drafter == "ngram":
            from draftlab.inference.ngram import NgramProposer

            proposer = NgramProposer(args.ngram_max, args.ngram_min)
            check_shape(shape, proposer.shapes, proposer.name)
        elif build:
            proposer = build(target)
        else:
            proposer = load_proposer(args.drafter, target, shape)
        check_decoding(shape, draft_vocab=proposer.draft_vocab or target.vocab_size)
    except OptionError as e:
        raise named(e, FLAGS) from None
    if args.lookup_min_match:
        from draftlab.inference.hybrid import lookup_first

        proposer = lookup_first(proposer, args.lookup_min_match, args.ngram_max)
    return target, proposer


# ---------------------------------------------------------------------- draftlab eval
def run_eval(args) -> int:
    from draftlab.inference.evaluate import acceptance_report
    from draftlab.inference.prompts import prompt_conversations, tokenize_prompts
    from draftlab.inference.report import batch_table, markdown_table, write_report

    spec = decoding_spec(args)
    data_spec = None
    if args.overrides and not args.recipe:
        raise DraftlabError(f"overrides ({' '.join(args.overrides)}) apply to a recipe: pass --recipe")
    if args.recipe:
        from draftlab.recipe import load_recipe

        if args.data != "sharegpt-heldout":  # the recipe would be read and then not used
            raise DraftlabError(f"--recipe picks the held-out split of the recipe's data: pass --data sharegpt-heldout "
                                f"(got --data {args.data})")
        data_spec = load_recipe(args.recipe, args.overrides).data
    convs = prompt_conversations(args.data, args.num_prompts, data_spec=data_spec, option="--num-prompts")
    target, proposer = load_models(args, spec)
    prompts = tokenize_prompts(convs, target.tokenizer)
    check_fits(spec, target, max(len(p.prompt_ids) for p in prompts))

    def progress(i, n, res):
        print(f"[{i + 1}/{n}] tau={res.stats().tau:.2f} {res.tokens_per_s:.1f} tok/s", flush=True)

    def batch_progress(B, done, n):
        print(f"[batch {B}] {done}/{n} prompts", flush=True)

    report = acceptance_report(target, proposer, prompts, spec, seed=args.seed, eos_token_id=target.tokenizer.eos_token_id,
                               backend=args.backend, data=args.data, label=Path(args.drafter).name, progress=progress,
                               batch_progress=batch_progress)
    print(markdown_table(report), end="")
    if spec.batch_sizes:
        print(batch_table(report["batches"]), end="")
    if args.report:
        paths = write_report(report, args.report)
        print(f"report: {', '.join(str(p) for p in paths.values())}")
    return 0


# ---------------------------------------------------------------------- draftlab generate
class _Stream:
    """Prints the decoded reply incrementally (holding back an incomplete UTF-8 character)."""

    def __init__(self, tokenizer, out):
        self.tokenizer, self.out = tokenizer, out
        self.tokens: list[int] = []
        self.printed = 0

    def __call__(self, new: list[int]) -> None:
        self.tokens.extend(new)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.printed :])
        self.out.flush()
        self.printed = len(text)


def stdin_lines():
    """The lines of stdin as text, each checked: read as bytes and decoded as UTF-8 where stdin
    has a byte stream (the line and byte of an invalid one named), else checked for the lone
    surrogates that undecodable bytes become."""
    from draftlab.inference.prompts import valid_text

    raw = getattr(sys.stdin, "buffer", None)
    for n, line in enumerate(raw if raw is not None else sys.stdin, 1):
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DraftlabError(f"stdin line {n}: not valid UTF-8 text (byte 0x{line[e.start]:02x} at byte {e.start + 1} of the line)") from None
            if line.endswith("\r\n"):  # as text mode reads it
                line = line[:-2] + "\n"
        yield valid_text(line, f"stdin line {n}")


def run_generate(args) -> int:
    from draftlab.inference.decoder import SpeculativeDecoder
    from draftlab.inference.metrics import AcceptanceStats
    from draftlab.inference.prompts import chat_prompt_ids, valid_text
    from draftlab.inference.proposer import verifying_target

    # every flag and every prompt checked before any model loads
    spec = decoding_spec(args)
    system = valid_text(args.system, "--system") if args.system else None
    interactive = args.prompt is None and sys.stdin.isatty()
    if args.prompt is not None:
        lines = [valid_text(args.prompt, "--prompt")]
    else:
        lines = stdin_lines() if interactive else list(stdin_lines())
    target, proposer = load_models(args, spec)
    target = verifying_target(proposer, target)
    decoder = SpeculativeDecoder(target, proposer, backend=args.backend)
    shape, tok = spec.shape(), target.tokenizer
    session = AcceptanceStats()
    tokens = 0
    seconds = 0.0
    if interactive:
        print("> ", end="", file=sys.stderr, flush=True)
    for i, line in enumerate(lines):
        text = line.rstrip("\n")
        if text.strip():
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            ids = chat_prompt_ids(tok, messages)
            check_fits(spec, target, len(ids))
            res = decoder.generate(ids, spec.max_new_tokens, shape, temperature=spec.temperature, top_k=spec.top_k,
                                   top_p=spec.top_p, seed=args.seed + i, eos_token_id=tok.eos_token_id,
                                   on_step=_Stream(tok, sys.stdout))
            print(flush=True)
            stats = res.stats()
            session.merge(stats)
            tokens += len(res.tokens)
            seconds += res.total_time
            print(
                f"[{len(res.tokens)} tokens ({res.stop_reason}), tau {stats.tau:.2f}, session tau {session.tau:.2f}, "
                f"{res.tokens_per_s:.1f} tok/s, session {tokens / seconds if seconds else 0.0:.1f} tok/s]",
                file=sys.stderr,
                flush=True,
            )
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
    return 0


eval_command = Command(add_eval_arguments, run_eval)
generate_command = Command(add_generate_arguments, run_generate)
