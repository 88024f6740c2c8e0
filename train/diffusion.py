"""Train a block diffusion drafter (DFlash-shaped, with a streak or per-position block loss) from a recipe.

    accelerate launch train/diffusion.py recipes/smollm2-135m-diffusion.yaml [dotted.key=value ...]

(``draftlab train RECIPE`` does the same for any family.) Relaunching the same command resumes
from the last checkpoint in ``output_dir``.
"""

from draftlab.train.launch import entry_point

if __name__ == "__main__":
    entry_point("train/diffusion.py", ("diffusion",), __doc__.splitlines()[0])
