"""Train a PRISM drafter (EAGLE-3 with one module per draft step, chosen by a step map) from a recipe.

    accelerate launch train/prism.py recipes/smollm2-135m-prism.yaml [dotted.key=value ...]

(``draftlab train RECIPE`` does the same for any family.) Relaunching the same command resumes
from the last checkpoint in ``output_dir``.
"""

from draftlab.train.launch import entry_point

if __name__ == "__main__":
    entry_point("train/prism.py", ("prism",), __doc__.splitlines()[0])
