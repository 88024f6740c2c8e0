"""Served equals trained: ``draftlab export CKPT --to ENGINE OUT --check`` and
``draftlab check EXPORT --drafter CKPT``.

A drafter that trains well and is accepted far less once served usually differs in something
the engine reads: a config field (max_position_embeddings, RoPE, a norm flag, the aux layers),
a tensor, or the peer's model computing something else. The check, in that order:

1. config: what an engine reads from the export (``Format.served_config``: config.json, plus
   generation_config.json for a draft LM) against what the checkpoint and target give
   (``Format.expected_config``), every key compared but the format's ``free_keys`` (a verifier
   path) -- an edited, added or dropped key (max_position_embeddings, rope_theta, a norm flag,
   the aux layer ids, num speculative tokens) is one line naming it and both values;
2. tensors: the export's weights against the checkpoint's export form, exactly (after the
   export's dtype cast) -- a missing, unknown or edited tensor is named;
3. decoding: the export loaded with the peer's own model class (``Format.peer_proposer``, each
   format's hook) drafts greedy chains in draftlab's decoder on held-out prompts, beside
   draftlab's own proposer of the checkpoint; alpha_j and tau of both are printed side by side.
   A draft token that differs, or peer logits further than :data:`LOGIT_ATOL` from draftlab's
   on the same inputs, is one line naming the prompt, step and draft position.

Every failure is a :class:`~draftlab.errors.DraftlabError` (one line, exit 2 from the CLI).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftlab.errors import DraftlabError
from draftlab.inference.metrics import AcceptanceStats
from draftlab.inference.proposer import Proposer
from draftlab.inference.shapes import Block, Chain, ChainDraft

# Peer and draftlab logits on the same inputs, fp32 on the CPU: the load tests see <= 1e-5
# (different op order and fused projections); 1e-4 leaves room for longer contexts, while a
# wrong RoPE, norm or weight moves logits by 1e-2 or more.
LOGIT_ATOL = 1e-4
GENERIC_FREE = ("torch_dtype", "dtype", "transformers_version")  # checked through the tensors' dtype instead
_ABSENT = "(absent)"


# ============================================================================ 1. config fields
def _show(v) -> str:
    return _ABSENT if v is _ABSENT else json.dumps(v)[:80]


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    return a == b


def first_difference(have, want, free: set[str], path: str = ""):
    """(dotted key, the export's value, the expected value) of the first difference, else None.
    Keys in ``free`` are skipped; a key on one side only differs (shown as ``(absent)``)."""
    if isinstance(want, dict) and isinstance(have, dict):
        for k in [*want, *(k for k in have if k not in want)]:
            key = f"{path}.{k}" if path else str(k)
            if key in free:
                continue
            d = first_difference(have.get(k, _ABSENT), want.get(k, _ABSENT), free, key)
            if d:
                return d
        return None
    if isinstance(want, list) and isinstance(have, list) and len(want) == len(have):
        for i, (h, w) in enumerate(zip(have, want)):
            d = first_difference(h, w, free, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if _same(have, want) else (path, have, want)


def check_config(fmt, config: dict, drafter, target, meta: dict, opts, where: str) -> int:
    """Raise on the first config key the export and the checkpoint+target disagree on; returns
    how many keys were compared. ``config``: the export's :meth:`Format.served_config`."""
    want = json.loads(json.dumps(fmt.expected_config(drafter, target, meta, opts)))  # JSON's own types, as written
    free = {*GENERIC_FREE, *fmt.free_keys}
    d = first_difference(config, want, free)
    if d:
        key, have, exp = d
        raise DraftlabError(f"{where}: config field {key} is {_show(have)} in the export, {_show(exp)} from the checkpoint and "
                            "target (an engine reads it: re-export, or restore the field)")
    return _count_leaves(want)


def _count_leaves(v) -> int:
    if isinstance(v, dict):
        return sum(_count_leaves(x) for x in v.values())
    return 1


# ============================================================================ 2. tensors
def check_tensors(fmt, out: Path, drafter, target, opts, where: str) -> int:
    """Raise on the first tensor the export and the checkpoint's export form disagree on."""
    have = fmt.read_tensors(out)
    want = fmt.export_state(drafter, target)
    if opts.dtype:
        dtype = getattr(torch, opts.dtype)
        want = {k: v.to(dtype) if v.is_floating_point() else v for k, v in want.items()}
    missing, unknown = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing:
        raise DraftlabError(f"{where}: tensor {missing[0]} is missing from the export ({len(missing)} missing)")
    if unknown:
        raise DraftlabError(f"{where}: tensor {unknown[0]} is not the checkpoint's ({len(unknown)} unknown; engines skip or misread such names)")
    for k, w in want.items():
        h = have[k]
        if tuple(h.shape) != tuple(w.shape) or (h.is_floating_point() and h.dtype != w.dtype):
            raise DraftlabError(f"{where}: tensor {k} is {str(h.dtype).removeprefix('torch.')}{list(h.shape)} in the export, "
                                f"{str(w.dtype).removeprefix('torch.')}{list(w.shape)} from the checkpoint")
        if not torch.equal(h.to(w.dtype), w):
            diff = (h.double() - w.double()).abs().max().item()
            raise DraftlabError(f"{where}: tensor {k} differs from the checkpoint's (max |diff| {diff:.3g})")
    return len(want)


# ============================================================================ 3. decoding
class PeerProposer(Proposer):
    """A chain proposer drafting with a peer's model (the format's ``peer_proposer`` hook
    returns a subclass). It keeps the whole history and re-runs the peer over it for every
    draft, so no cache of the peer's own is needed:

    * ``self.ids``: Long[N + 1], the prompt and every kept token; the last is the token the
      drafts follow;
    * ``self.hidden``: the target's hidden states ``{layer: [1, N, H]}`` of the first N
      (the inputs the target has run).

    A subclass implements :meth:`draft`: ``k`` greedy target-vocabulary ids, and per draft
    position the max |peer - draftlab| logit difference on the same inputs (None where it has
    no draftlab reference)."""

    shapes = frozenset({"chain"})
    peer = "peer"  # the peer class, for the report

    def __init__(self, layers, drafter=None):
        super().__init__(draft_vocab=None)
        self.layers = tuple(layers)
        self.name = self.peer
        self.drafter = drafter
        self.notes: list[str] = []  # where the peer was made to read what the engine reads, said in the report
        self.logit_diffs: list[list[float | None]] = []  # per propose, per draft position

    def start(self, prompt_ids, hidden, next_token):
        self.device = prompt_ids.device
        self.ids = torch.cat([prompt_ids.view(-1).cpu(), torch.tensor([int(next_token)])])
        self.hidden = {i: hidden[i].cpu().float() for i in self.layers}

    def advance(self, accepted, hidden):
        self.ids = torch.cat([self.ids, accepted.view(-1).cpu()])
        self.hidden = {i: torch.cat([self.hidden[i], hidden[i].cpu().float()], dim=1) for i in self.layers}

    @torch.no_grad()
    def propose(self, shape):
        tokens, diffs = self.draft(shape.k)
        self.logit_diffs.append(list(diffs))
        return ChainDraft(torch.tensor(tokens, dtype=torch.long, device=self.device), None)

    def draft(self, k: int) -> tuple[list[int], list[float | None]]:
        raise NotImplementedError

    # helpers for subclasses
    def padded(self, n: int) -> dict[int, torch.Tensor]:
        """The hidden states followed by ``n`` zero positions: EAGLE-style peers pair position
        t with token t + 1, so drafts appended to the tokens need positions; causal attention
        keeps them from changing any earlier position."""
        return {i: torch.cat([h, h.new_zeros(1, n, h.shape[-1])], dim=1) for i, h in self.hidden.items()}


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


class _Recorder(Proposer):
    """Relays to ``inner`` and records each chain it drafts."""

    def __init__(self, inner: Proposer):
        super().__init__(draft_vocab=inner.draft_vocab, trained_depth=inner.trained_depth)
        self.inner, self.name, self.layers, self.shapes = inner, inner.name, inner.layers, inner.shapes
        self.drafts: list[list[int]] = []

    def configure(self, sampling):
        self.inner.configure(sampling)

    def start(self, prompt_ids, hidden, next_token):
        self.inner.start(prompt_ids, hidden, next_token)

    def propose(self, shape):
        d = self.inner.propose(shape)
        self.drafts.append(d.tokens.tolist())
        return d

    def advance(self, accepted, hidden):
        self.inner.advance(accepted, hidden)


@dataclass
class Side:
    """One proposer's decoding of the prompts."""

    label: str
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    drafts: list[list[list[int]]] = field(default_factory=list)  # per prompt, per step
    logit_diffs: list[list[list[float | None]]] = field(default_factory=list)  # per prompt, per step, per position


def decode(target, proposer: Proposer, label: str, prompts: list[list[int]], k: int, max_new_tokens: int, eos) -> Side:
    from draftlab.inference.decoder import Decoder

    side = Side(label)
    for ids in prompts:
        rec = _Recorder(proposer)
        shape = Chain(k) if "chain" in proposer.shapes else Block(k)  # block drafters: a block's first k slots
        res = Decoder(target, rec).generate([torch.tensor(ids)], max_new_tokens, shape, eos_token_id=eos).rows[0]
        side.stats.merge(res.stats())
        side.drafts.append(rec.drafts)
        if isinstance(proposer, PeerProposer):
            side.logit_diffs.append(proposer.logit_diffs)
            proposer.logit_diffs = []
    return side


def compare(ours: Side, peer: Side, where: str) -> tuple[int, float | None]:
    """Raise at the first draft position whose token or logits differ; returns (steps compared,
    max logit difference seen)."""
    steps, worst = 0, None
    for p, (a_steps, b_steps) in enumerate(zip(ours.drafts, peer.drafts)):
        diffs = peer.logit_diffs[p] if peer.logit_diffs else []
        for s, (a, b) in enumerate(zip(a_steps, b_steps)):
            steps += 1
            row = diffs[s] if s < len(diffs) else []
            for j in range(max(len(a), len(b))):
                d = row[j] if j < len(row) else None
                if d is not None:
                    worst = d if worst is None else max(worst, d)
                    if not d <= LOGIT_ATOL:
                        raise DraftlabError(f"{where}: prompt {p}, step {s}, draft position {j}: the peer's logits differ from "
                                            f"draftlab's by {d:.3g} (tolerance {LOGIT_ATOL:g}) on the same inputs")
                ta, tb = (a[j] if j < len(a) else None), (b[j] if j < len(b) else None)
                if ta != tb:
                    raise DraftlabError(f"{where}: prompt {p}, step {s}, draft position {j}: draftlab drafts token {ta}, "
                                        f"the peer ({peer.label}) drafts {tb}")
        if len(a_steps) != len(b_steps):
            raise DraftlabError(f"{where}: prompt {p}: draftlab took {len(a_steps)} steps, the peer {len(b_steps)}")
    return steps, worst


# ============================================================================ the driver
@dataclass
class CheckReport:
    config_fields: int
    tensors: int
    ours: Side | None = None
    peer: Side | None = None
    steps: int = 0
    worst_logit_diff: float | None = None
    k: int = 0
    lines: list[str] = field(default_factory=list)


def own_hook(fmt, name: str) -> bool:
    """Whether ``fmt``'s hook ``name`` was written for its own algorithm. A layout derived from
    another family's (P-EAGLE's from EAGLE-3's speculators format) inherits that family's hooks,
    which would load its export with the other family's peer: it adds its own instead. Where a
    format's hook reads a class attribute (``hook_attributes``), that attribute is the hook."""
    name = getattr(fmt, "hook_attributes", {}).get(name, name)
    for cls in type(fmt).__mro__:
        if name in vars(cls):
            return getattr(cls, "algorithm", "*") in (fmt.algorithm, "*")
    return False


def detect_format(config: dict, algorithm: str, where: str):
    """The registered format an export's config.json is, among those of ``algorithm``."""
    from draftlab.export.formats import EXPORTS
    from draftlab.registry import discover

    discover()
    found = {id(f): f for (_, a), f in EXPORTS.items() if a in (algorithm, "*") and own_hook(f, "detect") and f.detect(config)}
    if len(found) != 1:
        names = sorted({f"{type(f).__name__}" for f in found.values()})
        raise DraftlabError(f"{where}: config.json is {'no' if not found else 'more than one'} known layout of "
                            f"{algorithm} drafters{'' if not found else ' (' + ', '.join(names) + ')'}")
    return next(iter(found.values()))


def _rounded(drafter, target, dtype: str | None):
    """The drafter in its export form (``export_meta``, ``export_state_dict``: reparametrisations
    folded in, as the peer loads them) with its floating weights rounded through the export's dtype
    (and back), so draftlab's side computes with exactly the weights the peer loads."""
    if not dtype:
        return drafter
    family, cast = type(drafter), getattr(torch, dtype)
    d = family.from_meta(family.check_meta(drafter.export_meta(), target), target)
    state = {k: v.to(cast).to(v.dtype) if v.is_floating_point() else v for k, v in drafter.export_state_dict().items()}
    missing, unexpected = d.load_state_dict(state, strict=False)
    if unexpected or any(not k.startswith(family.derived_keys) for k in missing):  # a family breaking the export_meta contract
        raise RuntimeError(f"{family.algorithm}: export_state_dict does not fit export_meta ({sorted(unexpected or missing)[:3]})")
    return d.eval()


def check_export(out, checkpoint, target="default", fmt=None, speculative_tokens: int | None = None,
                 data: str = "sharegpt-heldout", num_prompts: int = 4, max_new_tokens: int = 32, print_fn=print) -> CheckReport:
    """Check the export ``out`` against ``checkpoint`` (see the module docstring); ``fmt`` None
    detects the layout from its config.json. Prints the side-by-side table with ``print_fn``."""
    from draftlab.checkpoint import load_drafter, read_meta
    from draftlab.export.exporter import default_speculative_tokens, load_target
    from draftlab.export.formats import ExportOptions, read_config
    from draftlab.inference.prompts import load_prompts
    from draftlab.inference.proposer import PROPOSERS

    from draftlab.limits import MAX_K

    out, checkpoint = Path(out), Path(checkpoint)
    where = str(out)
    if speculative_tokens is not None and not 1 <= speculative_tokens <= MAX_K:  # before anything loads
        raise DraftlabError(f"--num-speculative-tokens must be in 1..{MAX_K}, got {speculative_tokens}")
    for option, value in (("--num-prompts", num_prompts), ("--max-new-tokens", max_new_tokens)):
        if value < 1:
            raise DraftlabError(f"{option} must be >= 1, got {value}")
    if not out.is_dir():
        raise DraftlabError(f"{where}: not a directory")
    config = read_config(out)
    meta = read_meta(checkpoint)
    fmt = fmt or detect_format(config, meta["algorithm"], where)
    target = load_target(target)
    drafter, meta = load_drafter(checkpoint, target)
    meta = {**meta, "drafter": drafter.export_meta()}
    dtype = config.get("torch_dtype", config.get("dtype"))
    k = speculative_tokens or default_speculative_tokens(meta)
    opts = ExportOptions(speculative_tokens=k, dtype=dtype if dtype in ("bfloat16", "float16") else None)

    served = fmt.served_config(out)
    report = CheckReport(check_config(fmt, served, drafter, target, meta, opts, where), check_tensors(fmt, out, drafter, target, opts, where))
    report.k = k
    say = report.lines.append
    say(f"served-equals-trained check: {out} ({fmt.title}) against {checkpoint}")
    say(f"  config: {report.config_fields} fields equal the checkpoint's and target's; tensors: {report.tensors} equal")

    drafter = _rounded(drafter.eval(), target, opts.dtype)
    peer = fmt.peer_proposer(out, config, drafter, target) if own_hook(fmt, "peer_proposer") else None
    if peer is None:
        say("  decoding: not run: this layout has no peer loader (Format.peer_proposer) or its package is not installed")
        for line in report.lines:
            print_fn(line)
        return report
    prompts = [p.prompt_ids for p in load_prompts(data, target.tokenizer, num_prompts, option="--num-prompts")]
    eos = getattr(target.tokenizer, "eos_token_id", None)
    recipe = meta.get("recipe") if isinstance(meta.get("recipe"), dict) else {}
    ours = PROPOSERS.get(drafter.algorithm, "algorithm")(drafter, trained_depth=drafter.trained_depth(recipe.get("loss") or {}))
    if "chain" not in ours.shapes and hasattr(drafter, "block_size"):
        k = report.k = drafter.block_size - 1  # a block drafter drafts its whole block, as vLLM serves it
    report.ours = decode(target, ours, "draftlab", prompts, k, max_new_tokens, eos)
    report.peer = decode(target, peer, peer.peer, prompts, k, max_new_tokens, eos)
    say(f"  decoding: {len(prompts)} prompts of {data}, greedy {'chain' if 'chain' in ours.shapes else 'block'} k={k}, "
        f"{max_new_tokens} new tokens")
    report.lines += table([report.ours, report.peer])
    report.steps, report.worst_logit_diff = compare(report.ours, report.peer, where)
    w = report.worst_logit_diff
    say(f"  drafts equal at all {report.steps} steps; logits: "
        + (f"max |peer - draftlab| {w:.2g} <= {LOGIT_ATOL:g}" if w is not None else "not compared (no draftlab reference for this peer)"))
    report.lines += [f"  note: {n}" for n in peer.notes]
    for line in report.lines:
        print_fn(line)
    return report


def table(sides: list[Side]) -> list[str]:
    K = max(s.stats.k for s in sides)
    width = max(len(s.label) for s in sides) + 2
    head = "  " + "".ljust(width) + "".join(f"alpha_{j + 1:<3d}" for j in range(K)) + "  tau"
    rows = [head]
    for s in sides:
        alpha = s.stats.alpha
        cells = "".join((f"{alpha[j]:<9.3f}" if j < len(alpha) and alpha[j] is not None else f"{'-':<9s}") for j in range(K))
        rows.append("  " + s.label.ljust(width) + cells + f"{s.stats.tau:.3f}")
    return rows


# ============================================================================ CLI
def add_check_arguments(p: argparse.ArgumentParser) -> None:
    """The decoding options of the check (``draftlab check`` and ``draftlab export --check``)."""
    p.add_argument("--data", default="sharegpt-heldout", help="held-out prompt set or .jsonl for the decoding check")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts decoded by both proposers")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per prompt")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("export", help="an exported drafter directory (any registered layout; detected from config.json)")
    p.add_argument("--drafter", required=True, help="the draftlab checkpoint it was exported from")
    p.add_argument("--target", default="default", help="the target the checkpoint was trained for")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="chain length the export was written with (default: the recipe's eval.k, else 3)")
    add_check_arguments(p)


def run(args) -> int:
    check_export(args.export, args.drafter, args.target, speculative_tokens=args.num_speculative_tokens, data=args.data,
                 num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens)
    return 0
