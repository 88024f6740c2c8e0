"""Acceptance reports on disk: JSON, a Markdown table and a PNG of alpha_j by position, written
together through :mod:`draftlab.atomic`: all of a report's files or none (a full disk or an
unwritable path is a one-line error and leaves the previous report, if any, as it was).

A report is the dict :func:`draftlab.inference.evaluate.evaluate` returns. Training writes one
after each checkpoint and passes the earlier ones as ``history``: the plot then shows one
alpha_j curve per checkpoint.
"""

from __future__ import annotations

import io
from pathlib import Path

from draftlab.atomic import json_text, write_bytes, write_files
from draftlab.inference.metrics import TAU_LABELS


def read_json(path) -> dict:
    """A report (a one-line error when it is missing or not a JSON object)."""
    from draftlab.checkpoint import read_json as read

    return read(Path(path))


def _fmt(x, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def markdown_table(report: dict) -> str:
    """One row per category plus ``all``: prompts, tau both ways the engines count it (pooled, with
    one standard error over prompts where there are two or more; per-prompt mean:
    :data:`~draftlab.inference.metrics.TAU_LABELS`), alpha_1..alpha_K, tokens/s, speedup."""
    rows = [("all", report)] + sorted(report.get("categories", {}).items())
    k = max((len(r.get("alpha", [])) for _, r in rows), default=0)
    head = ["category", "prompts", f"{TAU_LABELS['tau']} ± 1 s.e.", TAU_LABELS["tau_prompt_mean"]] + [f"α{j}" for j in range(1, k + 1)]
    head += ["tok/s", "base tok/s", "speedup", "greedy match"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in rows:
        alpha = list(r.get("alpha", [])) + [None] * (k - len(r.get("alpha", [])))
        tau = _fmt(r.get("tau")) + (f" ± {_fmt(r['tau_se'])}" if r.get("tau_se") is not None else "")
        cells = [name, _fmt(r.get("num_prompts")), tau, _fmt(r.get("tau_prompt_mean"))] + [_fmt(a) for a in alpha]
        cells += [_fmt(r.get("tokens_per_s"), 1), _fmt(r.get("baseline_tokens_per_s"), 1), _fmt(r.get("speedup")), _fmt(r.get("greedy_match"))]
        lines.append("| " + " | ".join(cells) + " |")
    if "cuda_graphs" in report:
        lines.append("\n" + graphs_line(report["cuda_graphs"]))
    return "\n".join(lines) + "\n"


def graphs_line(graphs: dict) -> str:
    """What replayed a captured graph and what ran eagerly (and why), per model, in one line."""
    parts = []
    for model, g in graphs.items():
        eager = [f"{n} {k.removeprefix('eager: ')}" for k, n in g.items() if k.startswith("eager: ")]
        eager += [f"{n} prefills {k.removeprefix('eager prefill: ')}" for k, n in g.items() if k.startswith("eager prefill: ")]
        parts.append(f"{model}: {g.get('replayed', 0)} forwards replayed from {g.get('captured', 0)} captured shapes, "
                     f"{g.get('prefills replayed', 0)} prefills from {g.get('prefill widths captured', 0)} captured widths, "
                     f"eager: {', '.join(eager) if eager else 'none'}")
    return f"CUDA graphs: {'; '.join(parts)}."


def _describe(report: dict) -> str:
    method = report.get("method")
    if method == "tree":
        t = report.get("tree") or {}
        shape = f"tree depth={t.get('depth')} top_k={t.get('top_k')} total={t.get('total_tokens')}"
    elif method == "static_tree":
        shape = f"static tree of {len(report.get('static_tree') or [])} nodes"
    else:
        shape = f"{method or 'chain'} k={report.get('k')}"
        if report.get("min_confidence"):
            shape += f" min_confidence={report['min_confidence']}"
    return (
        f"drafter `{report.get('drafter')}`, {shape}, data `{report.get('data')}`, "
        f"temperature {report.get('temperature')}, max_new_tokens {report.get('max_new_tokens')}"
    )


def train_serve_gap(report: dict) -> str | None:
    """A warning when serving acceptance is far below what training measured: some position j
    with a training accuracy of at least 0.3 accepts at less than half of it. That is the sign
    of a train/serve mismatch (masks, positions, layer ids), not of a weak drafter: the peers'
    DFlash users report 0.99 training accuracy and 0.12 served acceptance."""
    train, alpha = report.get("train_acc") or [], report.get("alpha") or []
    low = [j + 1 for j, (t, a) in enumerate(zip(train, alpha)) if t >= 0.3 and (a or 0.0) < 0.5 * t]
    if not low:
        return None
    return (
        f"WARNING: served acceptance is below half the training accuracy at positions {low} "
        "(a train/serve mismatch: masks, positions or target layer ids?)"
    )


def batch_table(batches: dict) -> str:
    """One row per batch size of a report's ``batches`` section (:mod:`draftlab.inference.batch_eval`)."""
    adaptive = batches.get("adaptive")
    head = ["batch", "tok/s", "base tok/s", "speedup", "90 % interval", "tau", "draft s", "verify s", "other s", "prefill s",
            "greedy match", "batched = alone"] + (["draft lengths (k: steps)"] if adaptive else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in batches["entries"]:
        cells = [str(e["batch_size"]), _fmt(e["tokens_per_s"], 1), _fmt(e["baseline_tokens_per_s"], 1),
                 _fmt(e.get("speedup")), "-".join(_fmt(x) for x in e.get("speedup_interval") or ()) or "-", _fmt(e["tau"])] + [_fmt(e[k]) for k in ("draft_s", "verify_s", "other_s", "prefill_s")]
        cells += [_fmt(e.get("greedy_match")), _fmt(e.get("batched_vs_alone"))]
        if adaptive:
            cells.append(" ".join(f"{k}:{n}" for k, n in (e.get("draft_lengths") or {}).items()))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _batches_label(batches: dict) -> str:
    if not batches.get("adaptive"):
        return "fixed shape"
    depth = batches.get("adaptive_max_k")
    return "adaptive draft length" + (f", k <= {depth}" if depth else "")


def markdown(report: dict) -> str:
    title = report.get("label") or "Acceptance report"
    text = f"# {title}\n\n{_describe(report)}\n\n{markdown_table(report)}"
    cache = report.get("draft_kv_cache")
    if cache:
        text += (f"\ndrafter KV cache: {cache['bytes_per_token']:,} bytes per token of context, "
                 f"{100 * cache['share']:.1f} % of the target's {cache['target_bytes_per_token']:,}\n")
    top = report.get("engine_ceiling")
    if top:
        text += (f"\nengine ceiling (the oracle drafter: the target's own continuation, k={top['k']}): "
                 f"tau {_fmt(top['tau'])}, speedup {_fmt(top['speedup'])}\n")
    if report.get("batches"):
        text += f"\nspeedup by batch size ({_batches_label(report['batches'])}):\n\n"
        text += batch_table(report["batches"])
    if report.get("train_acc"):
        text += "\ntraining accuracy by position (last logged, teacher-forced): " + " ".join(_fmt(a) for a in report["train_acc"]) + "\n"
    check = report.get("verifier_check")
    if check:
        d = check["divergence_from_original"]
        text += (
            f"\nDecoding is lossless with respect to {check['lossless_with_respect_to']}. Its greedy output against the "
            f"original target's ({d['num_prompts']} prompts x {d['max_new_tokens']} tokens): {d['prompts_differ']} prompts differ, "
            f"{100 * d['share_tokens_differ']:.0f} % of tokens come after a first divergence; teacher-forced top-1 agreement "
            f"{100 * d['top1_agreement']:.1f} %.\n"
        )
    gap = train_serve_gap(report)
    return text + (f"\n**{gap}**\n" if gap else "")


def png(draw, size=(6, 4)) -> bytes:
    """``draw(ax)`` on a new matplotlib figure, rendered as PNG bytes (with a legend when
    something is labelled); the figure is closed whatever happens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    try:
        draw(ax)
        if ax.lines:
            ax.legend(fontsize=7)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        return buf.getvalue()
    finally:
        plt.close(fig)


def figure(draw, path, size=(6, 4)) -> Path:
    """:func:`png` saved at ``path`` (atomically)."""
    return write_bytes(path, png(draw, size))


def _alpha1_bars(ax, report: dict) -> None:
    """One draft position: alpha_1 per data category as bars (a curve of one point says nothing)."""
    groups = [("all", report)] + sorted((report.get("categories") or {}).items())
    names = [n for n, _ in groups]
    values = [((r.get("alpha") or [None])[0] or 0.0) for _, r in groups]
    bars = ax.bar(names, values, color=["tab:blue"] + ["tab:gray"] * (len(names) - 1))
    ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_ylabel(r"$\alpha_1$")
    ax.set_ylim(0, 1.05)
    ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    ax.set_title(_describe(report), fontsize=7)


def plot_alpha(reports: list[dict], path, labels: list[str] | None = None) -> Path:
    """PNG of alpha_j by position j, one curve per report (e.g. per checkpoint); with a single
    draft position, alpha_1 of the last report per data category as bars."""
    return write_bytes(path, alpha_png(reports, labels))


def alpha_png(reports: list[dict], labels: list[str] | None = None) -> bytes:
    """The bytes of :func:`plot_alpha`'s PNG."""

    def draw(ax):
        if reports and max(len(r.get("alpha") or []) for r in reports) == 1 and reports[-1].get("categories"):
            return _alpha1_bars(ax, reports[-1])
        for i, r in enumerate(reports):
            label = (labels[i] if labels else None) or r.get("label") or f"report {i}"
            pts = [(j + 1, a) for j, a in enumerate(r.get("alpha", [])) if a is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", label=f"{label} (τ={r.get('tau', 0):.2f})")
        train = (reports[-1].get("train_acc") if reports else None) or []
        if train:  # what the last checkpoint's training measured, beside what decoding accepted
            ax.plot(range(1, len(train) + 1), train, ls="--", color="gray", label="training accuracy (last checkpoint)")
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("draft position j")
        ax.set_ylabel(r"$\alpha_j = a_j\,/\,a_{j-1}$")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if reports:
            ax.set_title(_describe(reports[-1]), fontsize=7)

    return png(draw)


def plot_speedup_by_batch(series: dict[str, list[dict]], path, title: str = "") -> Path:
    """PNG of speedup over plain decoding against batch size, one curve per labelled list of
    ``batches`` entries (error bars: their 90 % intervals), with the break-even line."""
    return write_bytes(path, speedup_png(series, title))


def speedup_png(series: dict[str, list[dict]], title: str = "") -> bytes:
    """The bytes of :func:`plot_speedup_by_batch`'s PNG."""

    def draw(ax):
        for label, entries in series.items():
            pts = [e for e in entries if e.get("speedup") is not None]
            if pts:
                xs, ys = [e["batch_size"] for e in pts], [e["speedup"] for e in pts]
                bounds = [e.get("speedup_interval") or (e["speedup"], e["speedup"]) for e in pts]
                err = [[y - lo for y, (lo, _) in zip(ys, bounds)], [hi - y for y, (_, hi) in zip(ys, bounds)]]
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
        ax.axhline(1.0, color="gray", ls="--", lw=1)
        ax.set_xscale("log", base=2)
        sizes = sorted({e["batch_size"] for entries in series.values() for e in entries})
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("batch size")
        ax.set_ylabel("speedup vs plain decoding (same batch)")
        ax.grid(alpha=0.3)
        if title:
            ax.set_title(title, fontsize=7)

    return png(draw)


def write_report(report: dict, path, history: list[dict] | None = None) -> dict[str, Path]:
    """Write ``path`` (JSON) plus ``.md`` and ``.png`` siblings. The plot has one curve per
    report of ``history`` (earlier checkpoints, oldest first) and one for ``report``. A report
    with a ``batches`` section also gets ``.batch.png``, its speedup by batch size. All are
    rendered first, then written as one (:func:`draftlab.atomic.write_files`)."""
    path = Path(path)
    paths = {"json": path, "plot": path.with_suffix(".png")}
    files = {paths["json"]: json_text(report).encode("utf-8"), paths["plot"]: alpha_png(list(history or []) + [report])}
    images = f"![acceptance]({paths['plot'].name})"
    if report.get("batches"):
        label = f"{report.get('drafter')} {'adaptive' if report['batches'].get('adaptive') else report.get('method')}"
        paths["batch_plot"] = path.with_suffix(".batch.png")
        files[paths["batch_plot"]] = speedup_png({label: report["batches"]["entries"]}, _describe(report))
        images += f" ![speedup by batch size]({paths['batch_plot'].name})"
    paths["markdown"] = path.with_suffix(".md")
    files[paths["markdown"]] = (markdown(report) + f"\n{images}\n").encode("utf-8")
    write_files(files)
    return paths
