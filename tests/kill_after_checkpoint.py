"""Test-only launcher: ``python tests/kill_after_checkpoint.py STEP SCRIPT [ARGS...]`` runs the training
script SCRIPT with ARGS as ``python SCRIPT ARGS...`` would, with a trainer hook that SIGKILLs this
process right after the step-STEP checkpoint is published: the hardest way a run can die. Under
``accelerate launch`` / torchrun it takes the script's place, so every rank dies the same way."""

import os
import runpy
import signal
import sys

from draftlab.train import hooks


def main() -> None:
    step, script = int(sys.argv[1]), os.path.abspath(sys.argv[2])

    def kill(trainer, checkpoint_dir):
        if trainer.step == step:
            os.kill(os.getpid(), signal.SIGKILL)

    hooks.after_checkpoint.append(kill)
    sys.argv = sys.argv[2:]
    sys.path[0] = os.path.dirname(script)  # as when python runs SCRIPT itself
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
