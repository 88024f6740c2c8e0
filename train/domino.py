"""Train a Domino drafter (the DFlash-shaped block drafter plus a GRU correction of its logits) from a recipe.

    accelerate launch train/domino.py recipes/smollm2-135m-domino.yaml [dotted.key=value ...]

(``draftlab train RECIPE`` does the same for any family.) Relaunching the same command resumes
from the last checkpoint in ``output_dir``; the base-anchored lambda schedule resumes with the step.
"""

from draftlab.train.launch import entry_point

if __name__ == "__main__":
    entry_point("train/domino.py", ("domino",), __doc__.splitlines()[0])
