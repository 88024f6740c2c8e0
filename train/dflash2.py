"""Train a DFlash2 drafter (the DFlash-shaped block drafter plus local convolutions and a candidate selector) from a recipe.

    accelerate launch train/dflash2.py recipes/smollm2-135m-dflash2.yaml [dotted.key=value ...]

(``draftlab train RECIPE`` does the same for any family.) Relaunching the same command resumes
from the last checkpoint in ``output_dir``.
"""

from draftlab.train.launch import entry_point

if __name__ == "__main__":
    entry_point("train/dflash2.py", ("dflash2",), __doc__.splitlines()[0])
