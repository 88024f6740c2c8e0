"""``draftlab export CKPT --to ENGINE OUT [--target default]``; ENGINE is any engine a registered
format serves (``export.formats.engines()``)."""

from __future__ import annotations

import argparse

from draftlab.export.formats import engines


def add_arguments(p: argparse.ArgumentParser) -> None:
    from draftlab.limits import MAX_K

    p.add_argument("checkpoint", help="draftlab checkpoint directory (e.g. runs/x/checkpoints/step-0000500)")
    p.add_argument("--to", required=True, choices=engines(), help="serving engine whose layout to write (hf: draftlab's own layout)")
    p.add_argument("out", help="output directory (written atomically)")
    p.add_argument("--target", default="default", help="the target the checkpoint was trained for (HF dir, hub id, .gguf, 'default')")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help=f"written into serving configs (1..{MAX_K}); default: the recipe's eval.k, else 3")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="cast weights (default: as stored)")
    p.add_argument("--verifier", default=None, help="verifier name_or_path written into the speculators config (default: the target's name)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--check", action="store_true",
                   help="then load the export with the peer's own model class and check it drafts what the checkpoint drafts "
                   "(config fields, tensors, alpha_j and tau side by side; see `draftlab check`)")
    from draftlab.export.check import add_check_arguments

    add_check_arguments(p)


def run(args) -> int:
    from draftlab.errors import DraftlabError
    from draftlab.export.exporter import default_speculative_tokens, export_checkpoint, load_target
    from draftlab.export.formats import ExportOptions
    from draftlab.checkpoint import read_meta

    from draftlab.limits import MAX_K

    k, where = args.num_speculative_tokens, "--num-speculative-tokens"
    if k is None:
        k, where = default_speculative_tokens(read_meta(args.checkpoint)), f"{args.checkpoint}: recipe.eval.k"
    if not 1 <= k <= MAX_K:  # the chain lengths draftlab decodes with, checked before anything loads
        raise DraftlabError(f"{where} must be in 1..{MAX_K}, got {k}")
    opts = ExportOptions(speculative_tokens=k, dtype=args.dtype, verifier=args.verifier)
    target = load_target(args.target) if args.check else args.target  # loaded once: the check decodes with it too
    out = export_checkpoint(args.checkpoint, args.to, args.out, target, opts, overwrite=args.overwrite)
    print(f"exported {args.checkpoint} for {args.to} -> {out} (see {out}/README.md)")
    if args.check:
        from draftlab.export.check import check_export
        from draftlab.export.formats import export_format

        fmt = export_format(args.to, read_meta(args.checkpoint)["algorithm"])
        check_export(out, args.checkpoint, target, fmt, speculative_tokens=k, data=args.data, num_prompts=args.num_prompts,
                     max_new_tokens=args.max_new_tokens)
    return 0
