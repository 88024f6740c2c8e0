"""Train a Medusa-2 drafter (Medusa heads + LoRA adapters on the target, trained jointly) from a recipe.

    accelerate launch train/medusa2.py recipes/smollm2-135m-medusa2.yaml [dotted.key=value ...]

(``draftlab train RECIPE`` does the same for any family.) Relaunching the same command resumes
from the last checkpoint in ``output_dir``.
"""

from draftlab.train.launch import entry_point

if __name__ == "__main__":
    entry_point("train/medusa2.py", ("medusa2",), __doc__.splitlines()[0])
