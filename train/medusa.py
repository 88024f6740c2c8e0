"""Train a Medusa-1 drafter (heads on the frozen target's last hidden state) from a recipe.

    accelerate launch train/medusa.py recipes/smollm2-135m-medusa.yaml [dotted.key=value ...]

(``draftlab train RECIPE`` does the same for any family.) Relaunching the same command resumes
from the last checkpoint in ``output_dir``.
"""

from draftlab.train.launch import entry_point

if __name__ == "__main__":
    entry_point("train/medusa.py", ("medusa",), __doc__.splitlines()[0])
