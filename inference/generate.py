"""``draftlab generate``: interactive speculative generation with live acceptance statistics.

Prompts come from ``--prompt`` or, without it, one per stdin line. Each is sent as a user turn
through the target's chat template; the reply streams to stdout as the verifier accepts tokens,
then one line of statistics (tau of this reply and of the session so far, tokens/s) goes to
stderr.
"""

from __future__ import annotations

import sys

from draftlab.inference.decoder import SpeculativeDecoder
from draftlab.inference.evaluate import add_model_arguments, load_models
from draftlab.inference.metrics import AcceptanceStats
from draftlab.inference.prompts import chat_prompt_ids


def add_arguments(p) -> None:
    add_model_arguments(p)
    p.add_argument("--prompt", default=None, help="one prompt; without it, prompts are read from stdin, one per line")
    p.add_argument("--system", default=None, help="optional system message")


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


def run(args) -> int:
    target, proposer, shape = load_models(args)
    target = proposer.verifier(target)
    decoder = SpeculativeDecoder(target, proposer, backend=args.backend)
    tok = target.tokenizer
    session = AcceptanceStats()
    tokens = 0
    seconds = 0.0
    interactive = args.prompt is None and sys.stdin.isatty()
    lines = [args.prompt] if args.prompt is not None else sys.stdin
    if interactive:
        print("> ", end="", file=sys.stderr, flush=True)
    for i, line in enumerate(lines):
        text = line.rstrip("\n")
        if text.strip():
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": text}]
            res = decoder.generate(
                chat_prompt_ids(tok, messages),
                args.max_new_tokens,
                shape,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                seed=args.seed + i,
                eos_token_id=tok.eos_token_id,
                on_step=_Stream(tok, sys.stdout),
            )
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
