"""Train a Hydra++ drafter (sequentially dependent heads over a prefix-attention layer) from a recipe.

    accelerate launch train/hydra.py recipes/smollm2-135m-hydra.yaml [dotted.key=value ...]

(``draftlab train RECIPE`` does the same for any family.) Relaunching the same command resumes
from the last checkpoint in ``output_dir``.
"""

from draftlab.train.launch import entry_point

if __name__ == "__main__":
    entry_point("train/hydra.py", ("hydra",), __doc__.splitlines()[0])
