"""Export a draftlab checkpoint into the layout a serving engine loads (see ``formats.py``)."""

from __future__ import annotations

import json
from pathlib import Path

from draftlab.errors import DraftlabError
from draftlab.export.formats import ExportOptions, engines, export_format


def default_speculative_tokens(meta: dict) -> int:
    """The chain length the checkpoint was evaluated with, else 3 (speculators' converter default)."""
    k = (((meta.get("recipe") or {}).get("eval")) or {}).get("k")
    return int(k) if isinstance(k, int) and k >= 1 else 3


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Before any work: ``out`` is new, an empty directory, or a directory ``overwrite`` may replace
    (never a file: --overwrite replaces directories)."""
    if out.exists() and not out.is_dir():
        raise DraftlabError(f"output {out} is a file, not a directory")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise DraftlabError(f"output {out} exists and is not empty (pass --overwrite to replace it)")


def load_target(target, device: str = "cpu"):
    from draftlab.models.target import Target

    return target if not isinstance(target, str) else Target.load(target, device=device)


def export_checkpoint(checkpoint, engine: str, out, target="default", opts: ExportOptions | None = None, overwrite: bool = False) -> Path:
    """Write ``checkpoint`` (a draftlab checkpoint directory) as ``engine``'s layout to ``out``
    atomically, with a model card. ``target`` is a spec string or a loaded ``Target``; a
    checkpoint trained for another target is refused, and so is a drafter whose export form
    (``export_meta``, ``export_state_dict``) the checkpoint validation refuses."""
    from draftlab import atomic
    from draftlab.checkpoint import check_drafter, load_drafter, read_meta
    from draftlab.export.model_card import render

    checkpoint, out = Path(checkpoint), Path(out)
    if engine not in engines():
        raise DraftlabError(f"--to: unknown engine '{engine}' (choose from {', '.join(engines())})")
    check_out_dir(out, overwrite)
    meta = read_meta(checkpoint)
    fmt = export_format(engine, meta["algorithm"])
    opts = opts or ExportOptions(speculative_tokens=default_speculative_tokens(meta))
    target = load_target(target)
    drafter, meta = load_drafter(checkpoint, target)
    meta = {**meta, "drafter": drafter.export_meta()}  # the weights are written in export form
    check_drafter(meta["algorithm"], meta["drafter"], target, f"{checkpoint} (as exported)", drafter.export_state_dict())
    fmt.check_exportable(drafter, target)
    with atomic.directory(out) as tmp:
        fmt.save(tmp, drafter, target, meta, opts)
        config = json.loads((tmp / "config.json").read_text())
        atomic.write_text(tmp / "README.md", render(meta, fmt, drafter, config, engine, str(out), str(checkpoint), opts))
    return out
