"""``draftlab capture``: build a data split and write its target hidden states into offline shards."""

from __future__ import annotations

import argparse
import time

from draftlab.data.capture import resolve_layers
from draftlab.data.offline import DEFAULT_BATCH_TOKENS, STORAGE_DTYPES, capture_offline, human_bytes
from draftlab.errors import DraftlabError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="default", help="HF dir, hub id, .gguf file or 'default' (embedded SmolLM2-135M)")
    p.add_argument("--data", default="sharegpt", help="'sharegpt', a .json/.jsonl file or 'hf:<name or dir>'")
    p.add_argument("--data-path", default=None, help="read the source from this file/dir instead")
    p.add_argument("--num-conversations", type=int, default=None, help="use at most this many conversations")
    p.add_argument("--max-length", type=int, default=None, help="truncate samples to this many tokens (data default: 2048)")
    p.add_argument("--heldout", type=int, default=None, help="conversations held out for evaluation (not captured)")
    p.add_argument("--seed", type=int, default=None, help="data split seed")
    p.add_argument("--split", choices=("train", "heldout"), default="train", help="which split to capture")
    p.add_argument("--layers", required=True,
                   help="a drafter family (e.g. eagle3: the layers it reads by default) or comma-separated indices, "
                        "e.g. 2,15,27 (the last layer is always added)")
    p.add_argument("--dtype", default="bfloat16", choices=tuple(STORAGE_DTYPES), help="storage dtype of hidden states")
    p.add_argument("--out", required=True, help="output directory (an existing capture there is resumed)")
    p.add_argument("--batch-tokens", type=int, default=None, help=f"padded tokens per forward (default {DEFAULT_BATCH_TOKENS})")
    p.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard (default: ~256 MiB shards)")
    p.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile the target's forward: compiling a 30-layer target takes many minutes on a "
                   "small CPU (once per process), so it pays off on long captures only (bench/capture.py); a capture "
                   "resumes with the setting it began with")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from draftlab.data.dataset import DataSpec, build_samples
    from draftlab.models.target import Target

    fields = {"source": args.data, "path": args.data_path, "num_conversations": args.num_conversations,
              "max_length": args.max_length, "heldout": args.heldout, "seed": args.seed}
    try:
        spec = DataSpec(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        raise DraftlabError(f"data.{'.'.join(map(str, err['loc'])) or 'spec'}: {err['msg']}") from None
    target = Target.load(args.target)
    layers = resolve_layers(args.layers, target.num_layers)  # fail on bad layers before reading data
    t0 = time.perf_counter()
    sample_set = build_samples(spec, target.tokenizer, target=target if spec.regenerate else None)
    samples = sample_set.train if args.split == "train" else sample_set.heldout
    tokens = sum(s["input_ids"].numel() for s in samples)
    print(f"data: {sample_set.report.get('summary', '')} ({time.perf_counter() - t0:.1f} s)")
    print(f"data: capturing the {args.split} split: {len(samples)} samples, {tokens} tokens "
          f"(mean {tokens / max(1, len(samples)):.0f} tokens/sample)")
    if not samples:
        raise DraftlabError(f"split: the {args.split} split is empty")
    result = capture_offline(
        target, samples, args.out, layers, storage_dtype=args.dtype, shard_tokens=args.shard_tokens,
        batch_tokens=args.batch_tokens, data_spec={**spec.model_dump(mode="json"), "split": args.split},
        progress=not args.no_progress, compile=args.compile, verbose=True,
    )
    m = result.manifest
    total = result.total_bytes
    if result.captured_tokens:
        print(f"capture: {result.captured_tokens} tokens in {result.seconds:.1f} s = {result.tokens_per_s:.0f} tokens/s"
              + (" (including the torch.compile warm-up)" if m["compiled"] else "")
              + (f" (resumed; {result.skipped_shards} shards were already done)" if result.skipped_shards else ""))
    else:
        print(f"capture: nothing to do, all {len(m['shards'])} shards were already complete and verified")
    print(f"capture: {m['num_tokens']} tokens, {len(m['shards'])} shards, {total / m['num_tokens']:.1f} B/token "
          f"on disk ({m['bytes_per_token']} B/token of tensor data), {human_bytes(total)} in {result.out_dir}")
    return 0
