"""Train a DSpark drafter (the DFlash-shaped block drafter plus Markov and confidence heads) from a recipe.

    accelerate launch train/dspark.py recipes/smollm2-135m-dspark.yaml [dotted.key=value ...]

(``draftlab train RECIPE`` does the same for any family.) Relaunching the same command resumes
from the last checkpoint in ``output_dir``.
"""

from draftlab.train.launch import entry_point

if __name__ == "__main__":
    entry_point("train/dspark.py", ("dspark",), __doc__.splitlines()[0])
