"""The acceptance harness: prompts + target + proposer + decoding spec -> a report of acceptance
(a_j, alpha_j, tau) and speedup. ``draftlab eval`` (:mod:`draftlab.cli_decode`), the trainer's
after-checkpoint report and the layer-skip search all report through :func:`acceptance_report`.

For every prompt the plain baseline and speculative decoding run in lockstep (one step of each
in turn, so the machine's slow spells slow both alike), on the same prompt with the same
``max_new_tokens`` and sampling settings. One untimed warm-up generation of each kind runs first
(allocator, kernel compilation). Metrics come from :mod:`draftlab.inference.metrics`.

A greedy chain or block report also gives the engine's ceiling at the same k
(``engine_ceiling``): the oracle drafter (:mod:`~draftlab.inference.oracle`) drafting each
prompt's plain continuation right after its pair, so every draft is accepted; its speedup over
the same baseline is the most this engine gives at that k, whatever the drafter.
"""

from __future__ import annotations

import platform
import time

import torch

from draftlab.errors import DraftlabError
from draftlab.inference.batch_eval import evaluate_batches
from draftlab.inference.decoder import Decoder, single, run_lockstep
from draftlab.inference.decoding_spec import DecodingSpec
from draftlab.inference.metrics import AcceptanceStats, tau_prompt_mean, tau_standard_error
from draftlab.inference.prompts import EvalPrompt
from draftlab.inference.proposer import ChangesVerifier, OwnModel, PreparesPrompts, Proposer, verifying_target
from draftlab.inference.shapes import Block, Chain, Shape, shape_fields


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
            "tau_se": tau_standard_error(self.prompt_stats),
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
    from draftlab.inference.graphs import graphed

    if not prompts:
        raise DraftlabError("evaluation needs at least one prompt")
    verifier_note = None
    if isinstance(proposer, ChangesVerifier):
        verifier_note = proposer.verifier_report(target, prompts, max_new_tokens, eos_token_id)
    target, graphs = graphed(verifying_target(proposer, target), proposer, cuda_graphs)
    if isinstance(proposer, PreparesPrompts):
        proposer.prepare(target, [p.prompt_ids for p in prompts], max_new_tokens, eos_token_id)
    decoder, plain = Decoder(target, proposer, backend=backend), Decoder(target)
    oracle = _ceiling_oracle(target, proposer, shape, temperature, baseline)
    ceiling = _Totals()
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id)
    if warmup:
        n = min(max_new_tokens, 16)
        plain.generate([prompts[0].prompt_ids], n, None, seed=seed, **sampling)
        decoder.generate([prompts[0].prompt_ids], n, shape, seed=seed, **sampling)
    if graphs:  # every prompt's prefill graph captured before any timing
        target.capture_prefills([len(p.prompt_ids) for p in prompts], {tuple(d.layers) for d in (decoder, plain)})
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
        stats = spec.stats()
        per_prompt.append(
            {
                "id": p.id,
                "category": p.category,
                "prompt_tokens": len(p.prompt_ids),
                "new_tokens": len(spec.tokens),
                "tau": stats.tau,
                # the counts a paired comparison pools per prompt (α_j = Σ reached_j / Σ reached_{j-1})
                "num_steps": stats.num_steps,
                "reached": list(stats.reached),
                "tokens_per_s": spec.tokens_per_s,
                "baseline_tokens_per_s": base.tokens_per_s if base else None,
                "matched": (spec.tokens == base.tokens) if compare else None,
            }
        )
        if oracle is not None:
            oracle.remember(p.prompt_ids, base.tokens)
            drafted = Decoder(target, oracle, backend=backend)
            ceiling.add(single(drafted.generate([p.prompt_ids], max_new_tokens, Chain(shape.k), seed=seed + i, **sampling)),
                        base, compare)
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
        "device": device_name(target.device),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **total.to_dict(baseline),
        "categories": {c: t.to_dict(baseline) for c, t in sorted(by_cat.items())},
        "prompts": per_prompt,
        **({"verifier_check": verifier_note} if verifier_note else {}),
        **({"cuda_graphs": graphs()} if graphs else {}),
        **({"engine_ceiling": _ceiling_fields(ceiling, shape.k)} if oracle is not None else {}),
    }


def _ceiling_oracle(target, proposer, shape, temperature: float, baseline: bool):
    """The oracle that measures the engine's ceiling beside ``proposer``: greedy chains and blocks
    with a baseline, and not beside the oracle itself; else None."""
    from draftlab.inference.oracle import OracleProposer

    if temperature != 0.0 or not baseline or not isinstance(shape, (Chain, Block)) or isinstance(proposer, OracleProposer):
        return None
    return OracleProposer(target)


def _ceiling_fields(t: _Totals, k: int) -> dict:
    d = t.to_dict(True)
    return {"drafter": "oracle", "k": k, "tau": d["tau"], "speedup": d["speedup"], "tokens_per_s": d["tokens_per_s"],
            "greedy_match": d["greedy_match"]}


def acceptance_report(target, proposer: Proposer, prompts: list[EvalPrompt], spec: DecodingSpec, *, seed: int = 0,
                      eos_token_id=None, backend: str = "auto", data: str | None = None, label: str | None = None,
                      progress=None, batch_progress=None) -> dict:
    """The report of ``spec`` (checked: :func:`~draftlab.inference.decoding_spec.check_spec`) on
    ``prompts``: :func:`evaluate`, and with ``spec.batch_sizes`` its ``batches`` section
    (:func:`~draftlab.inference.batch_eval.evaluate_batches`, ``batch_progress(B, done, n)``
    after each group). The one report path of ``draftlab eval``, the trainer and the layer search."""
    sampling = dict(max_new_tokens=spec.max_new_tokens, temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p,
                    seed=seed, eos_token_id=eos_token_id, backend=backend, cuda_graphs=spec.cuda_graphs)
    shape = spec.shape()
    report = evaluate(target, proposer, prompts, shape, baseline=spec.baseline, data=data, label=label, progress=progress,
                      **sampling)
    if spec.batch_sizes:
        report["batches"] = evaluate_batches(target, proposer, prompts, shape, spec.batch_sizes, adaptive=spec.adaptive,
                                             progress=batch_progress, **sampling)
    return report


def draft_cache_fields(proposer: Proposer, target) -> dict:
    """``draft_kv_cache``: the drafter's own KV cache per token of context beside the target's,
    when the proposer has one (:class:`OwnModel`: a draft model's is a real cost beside the target's)."""
    if not isinstance(proposer, OwnModel):
        return {}
    draft = proposer.cache_bytes_per_token
    base = target.kv_bytes_per_token
    return {"draft_kv_cache": {"bytes_per_token": draft, "target_bytes_per_token": base, "share": draft / base}}


def device_name(device: torch.device) -> str:
    """The device as a report names it: the GPU's name, or the CPU's and its threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
