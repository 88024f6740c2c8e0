"""``draftlab generate``: interactive speculative generation with live acceptance statistics.

Prompts come from ``--prompt`` or, without it, one per stdin line. Each is sent as a user turn
through the target's chat template; the reply streams to stdout as the verifier accepts tokens,
then one line of statistics (tau of this reply and of the session so far, tokens/s) goes to
stderr.

Prompts must be UTF-8 text: one that is not is a one-line error naming ``--prompt``,
``--system`` or the stdin line. A terminal's lines are read as they are typed; stdin that is not
a terminal (a file, a pipe) is read whole and checked before any model loads.
"""

from __future__ import annotations

import sys

from draftlab.errors import DraftlabError
from draftlab.inference.decoder import SpeculativeDecoder
from draftlab.inference.evaluate import add_model_arguments, check_decoding_options, check_fits, decoding_shape, load_models
from draftlab.inference.prompts import valid_text
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


def stdin_lines():
    """The lines of stdin as text, each checked: read as bytes and decoded as UTF-8 where stdin
    has a byte stream (the line and byte of an invalid one named), else checked for the lone
    surrogates that undecodable bytes become."""
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


def run(args) -> int:
    # every flag and every prompt checked before any model loads
    check_decoding_options(args)
    decoding_shape(args)
    system = valid_text(args.system, "--system") if args.system else None
    interactive = args.prompt is None and sys.stdin.isatty()
    if args.prompt is not None:
        lines = [valid_text(args.prompt, "--prompt")]
    else:
        lines = stdin_lines() if interactive else list(stdin_lines())
    target, proposer, shape = load_models(args)
    target = proposer.verifier(target)
    decoder = SpeculativeDecoder(target, proposer, backend=args.backend)
    tok = target.tokenizer
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
            check_fits(args, target, len(ids))
            res = decoder.generate(
                ids,
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
