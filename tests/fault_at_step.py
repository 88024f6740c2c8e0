"""Test-only launcher: ``python tests/fault_at_step.py FAULT STEP RANK SCRIPT [ARGS...]`` runs the
training script SCRIPT with ARGS as ``python SCRIPT ARGS...`` would, with a fault on process RANK
(``all``: on every process) once optimizer step STEP is done (a trainer hook):

- a signal name (``SIGTERM``, ``SIGUSR1``, ``SIGKILL``): sent to that process (the time printed first);
- ``nan``: the next step's target features on that process are NaN, so its loss is;
- anything else: no fault (the same command line for a relaunch).

Under ``accelerate launch`` / torchrun it takes the script's place in every process."""

import os
import runpy
import signal
import sys
import time

from draftlab.data.features import FeatureSource
from draftlab.train import hooks


def main() -> None:
    fault, step, rank, script = sys.argv[1], int(sys.argv[2]), sys.argv[3], os.path.abspath(sys.argv[4])
    if rank not in ("all", os.environ.get("RANK", "0")):
        fault = None
    done = {"step": 0}

    def after_step(trainer):
        done["step"] = trainer.step
        if trainer.step == step and fault and fault.startswith("SIG"):
            print(f"fault_at_step: {fault} at {time.time():.3f}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.Signals[fault])

    real = FeatureSource.features

    def features(self, indices, batch):
        hidden, batch = real(self, indices, batch)
        if fault == "nan" and done["step"] == step:
            hidden = {layer: h * float("nan") for layer, h in hidden.items()}
        return hidden, batch

    hooks.after_step.append(after_step)
    FeatureSource.features = features
    sys.argv = sys.argv[4:]
    sys.path[0] = os.path.dirname(script)  # as when python runs SCRIPT itself
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
