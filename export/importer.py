"""``draftlab import SRC --format NAME --target default OUT``: a public drafter -> a draftlab
checkpoint (evaluate it, fine-tune it, re-export it). ``NAME`` is any registered import format
(``export.formats.IMPORT_FORMATS``).

Each format's inverse mapping renames the tensors; the result must match the rebuilt drafter's
state dict *exactly*: a missing or unknown tensor is an error naming it, never skipped. The
drafter meta the format reads, and the vocabulary maps among the tensors, pass the checkpoint
validation (``draftlab.checkpoint.check_drafter``) before anything is built or written: an import
never writes a checkpoint that loading would refuse.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from draftlab.errors import DraftlabError

_SHOW = 12  # names listed per error line


def _names(names: list[str]) -> str:
    more = f" ... (+{len(names) - _SHOW} more)" if len(names) > _SHOW else ""
    return ", ".join(names[:_SHOW]) + more


def import_checkpoint(src, format_name: str, out, target="default", overwrite: bool = False) -> Path:
    """Convert the ``format_name`` checkpoint directory ``src`` for ``target`` (a spec or a
    loaded ``Target``) into a draftlab checkpoint at ``out`` (written atomically)."""
    from draftlab import atomic
    from draftlab.checkpoint import check_drafter, checkpoint_meta, save_weights
    from draftlab.export.exporter import check_out_dir, load_target
    from draftlab.export.formats import check_embedding, import_format, read_config

    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise DraftlabError(f"import source is not a directory: {src}")
    check_out_dir(out, overwrite)
    fmt = import_format(format_name)
    config = read_config(src)
    raw = fmt.read_tensors(src)
    target = load_target(target)
    fmt.check_source(src, config, target)

    tensors: dict = {}
    for name, t in raw.items():
        key = fmt.from_format(name)
        if key in tensors:
            raise DraftlabError(f"{src}: two tensors map to {key} under the {format_name} layout")
        tensors[key] = t
    where = f"{src} ({format_name})"
    check_embedding(tensors, target, where)
    dmeta = fmt.import_meta(config, tensors, target)
    family, dmeta = check_drafter(fmt.algorithm, dmeta, target, where, tensors)
    drafter = family.from_meta(dmeta, target)
    expected = drafter.export_state_dict()
    missing = sorted(fmt.to_format(k) for k in set(expected) - set(tensors))
    unknown = sorted(fmt.to_format(k) for k in set(tensors) - set(expected))
    if missing or unknown:
        parts = ([f"missing {_names(missing)}"] if missing else []) + ([f"unknown {_names(unknown)}"] if unknown else [])
        raise DraftlabError(f"{where}: tensors do not match a {fmt.algorithm} drafter of this config: " + "; ".join(parts))
    wrong = [f"{fmt.to_format(k)} {tuple(tensors[k].shape)} != {tuple(v.shape)}" for k, v in expected.items() if tensors[k].shape != v.shape]
    if wrong:
        raise DraftlabError(f"{where}: tensor shapes do not match the config: {_names(wrong)}")
    drafter.load_state_dict(tensors, strict=True)

    meta = checkpoint_meta(drafter, target.identity, recipe=None, step=0)
    meta["imported_from"] = {"format": format_name, "path": str(src)}
    with atomic.directory(out) as tmp:
        save_weights(tmp, drafter.export_state_dict(), meta, where=out)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="directory of a public drafter (config.json + safetensors / pytorch_model.bin)")
    from draftlab.export.formats import IMPORT_FORMATS

    p.add_argument("--format", required=True, choices=IMPORT_FORMATS.names(), help="layout of SRC")
    p.add_argument("--target", default="default", help="the target the drafter belongs to (HF dir, hub id, .gguf, 'default')")
    p.add_argument("out", help="output draftlab checkpoint directory")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")


def run(args) -> int:
    out = import_checkpoint(args.src, args.format, args.out, args.target, overwrite=args.overwrite)
    print(f"imported {args.src} ({args.format}) -> {out}; evaluate with: draftlab eval --drafter {out} --target {args.target}")
    return 0
