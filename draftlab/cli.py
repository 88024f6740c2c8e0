"""The ``draftlab`` console command. Each subcommand lives with its stage and exposes
``add_arguments(parser)`` and ``run(args)``: its module does, or, where a module holds several
(``module:name``), the object of that name; this file only wires them up."""

from __future__ import annotations

import argparse
import importlib
import sys

from draftlab.errors import DraftlabError

# name -> (module or module:object, help)
SUBCOMMANDS = {
    "capture": ("draftlab.data.capture_cli", "capture target hidden states into offline shards"),
    "train": ("draftlab.train.launch", "train a drafter of any family from a recipe YAML"),
    "eval": ("draftlab.cli_decode:eval_command", "speculative decoding acceptance report (alpha_j, tau, speedup)"),
    "generate": ("draftlab.cli_decode:generate_command", "interactive speculative generation with live acceptance"),
    "export": ("draftlab.export.cli", "export a checkpoint for vLLM, SGLang or HF"),
    "import": ("draftlab.export.importer", "import a public drafter in any registered format"),
    "check": ("draftlab.export.check", "check an export against its checkpoint: config, tensors, the peer's drafts"),
    "rollouts": ("draftlab.cli_rollouts", "speculation on RL rollouts: make a drifting policy sequence, run the workload"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="draftlab", description="Train, evaluate and export speculative-decoding drafters.")
    sub = parser.add_subparsers(dest="command", required=True)
    if argv and argv[0] in SUBCOMMANDS:  # import only the module that runs
        names = [argv[0]]
    else:
        names = list(SUBCOMMANDS)
    commands = {}
    for name in names:
        where, help_ = SUBCOMMANDS[name]
        module_name, _, attr = where.partition(":")
        module = importlib.import_module(module_name)
        commands[name] = getattr(module, attr) if attr else module
        commands[name].add_arguments(sub.add_parser(name, help=help_))
    args = parser.parse_args(argv)
    try:
        return int(commands[args.command].run(args) or 0)
    except DraftlabError as e:
        # one line whatever the message holds (a value quoted from a file or a flag may hold a newline)
        message = " ".join(str(e).splitlines())
        print(f"draftlab {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"draftlab {args.command}: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The console script: ``main()``'s return code becomes the exit status (through
    :func:`draftlab.process_exit.exit_process`, which multi-process training runs need)."""
    from draftlab.process_exit import exit_process

    exit_process(main())


if __name__ == "__main__":
    entry()
