"""The ``README.md`` model card every export writes.

It states what is known from the checkpoint and nothing else: target identity, data and recipe
summary, and the acceptance measured by draftlab's evaluation (``metrics.eval`` in the
checkpoint JSON, metric definitions in ``inference/metrics.py``). A checkpoint without a
measurement says "not measured" — numbers are never filled in.
"""

from __future__ import annotations


def _num(x, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _scalars(d: dict | None, keys=None) -> str:
    """``k=v`` for the scalar fields of a recipe section."""
    if not d:
        return "—"
    items = [(k, v) for k, v in d.items() if (keys is None or k in keys) and isinstance(v, (str, int, float, bool)) and v is not None]
    return ", ".join(f"`{k}={v}`" for k, v in items) or "—"


def acceptance_section(meta: dict) -> list[str]:
    ev = (meta.get("metrics") or {}).get("eval")
    if not ev or ev.get("tau") is None:
        return ["## Measured acceptance", "", "Not measured: the checkpoint carries no draftlab evaluation (`metrics.eval`).", ""]
    setup = (meta.get("recipe") or {}).get("eval") or {}
    lines = [
        "## Measured acceptance",
        "",
        f"Measured by draftlab's evaluation at step {meta.get('step')} on {ev.get('num_prompts', '?')} prompts"
        + (f" ({_scalars(setup, ('data', 'method', 'k', 'temperature', 'max_new_tokens'))})." if setup else "."),
        "tau = mean tokens per target forward including the bonus token; a_j = P(accepted length >= j); "
        "alpha_j = a_j / a_(j-1).",
        "",
        f"- tau: **{_num(ev['tau'])}**",
    ]
    a, alpha = ev.get("a") or [], ev.get("alpha") or []
    if a:
        lines.append("- a_j: " + ", ".join(_num(x) for x in a))
    if alpha:
        lines.append("- alpha_j: " + ", ".join(_num(x) for x in alpha))
    if ev.get("speedup") is not None:
        lines.append(f"- speedup vs plain decoding (same run, draftlab's decoder): {_num(ev['speedup'], 2)}x")
    return lines + [""]


def render(meta: dict, fmt, drafter, config: dict, engine: str, out: str, source: str, opts) -> str:
    t = meta.get("target") or {}
    d = meta.get("drafter") or {}
    recipe = meta.get("recipe") or {}
    train = recipe.get("train") or {}
    target_name = t.get("name", "?")
    n_params = sum(p.numel() for p in drafter.parameters())
    lines = [
        "---",
        "library_name: draftlab",
        "tags: [speculative-decoding, " + meta["algorithm"] + "]",
        f"base_model: {target_name}",
        "---",
        "",
        f"# {meta['algorithm'].upper()} drafter for {target_name}",
        "",
        f"Exported by draftlab from `{source}` for **{engine}** as the {fmt.title}.",
        "",
        "## Target",
        "",
        f"- name: `{target_name}` (source: {t.get('source', '?')})",
        f"- family `{t.get('model_type')}`, {t.get('num_hidden_layers')} layers, hidden {t.get('hidden_size')}, vocab {t.get('vocab_size')}",
        "- the drafter is a standalone causal LM of the target's vocabulary: it drafts from tokens alone"
        if fmt.standalone else "- the drafter only works next to this target (it reads its hidden states and shares its embedding)",
        "",
        "## Drafter",
        "",
        f"- algorithm `{meta['algorithm']}`, {n_params / 1e6:.2f}M parameters; architecture: {_scalars(d)}",
    ]
    for key in ("aux_layers", "target_layers"):  # EAGLE-3's and the diffusion drafter's name for them
        if key in d and not fmt.standalone:
            lines.append(f"- fused target hidden states (draftlab `{key}`, HF `hidden_states` indices): {d[key]}")
    if "draft_vocab_size" in d:
        lines.append(f"- draft vocabulary: {d['draft_vocab_size']} of {d.get('vocab_size')} target tokens")
    lines += [
        "",
        "## Data and recipe",
        "",
        f"- data: {_scalars(recipe.get('data'))}" if recipe else "- data: not recorded in the checkpoint",
    ]
    if recipe:
        lines += [
            f"- drafter: {_scalars(recipe.get('drafter'))}",
            f"- loss: {_scalars(recipe.get('loss'))}",
            f"- training: {_scalars(train, ('lr', 'max_steps', 'epochs', 'batch_tokens', 'grad_accum', 'warmup_steps', 'clip_grad_norm'))}, "
            f"seed {recipe.get('seed')}, checkpoint step {meta.get('step')}",
        ]
    lines += ["", *acceptance_section(meta), "## Serving", "", fmt.serving(out, target_name, opts, config), ""]
    notes = fmt.notes(drafter, config)
    if notes:
        lines += ["## Layout notes", "", *[f"- {n}" for n in notes], ""]
    return "\n".join(lines)
