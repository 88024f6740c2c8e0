"""Train a P-EAGLE drafter (parallel EAGLE-3: K drafts per forward, COD-sampled groups) from a recipe.

    accelerate launch train/peagle.py recipes/smollm2-135m-peagle.yaml [dotted.key=value ...]

(``draftlab train RECIPE`` does the same for any family.) Relaunching the same command resumes
from the last checkpoint in ``output_dir``.
"""

from draftlab.train.launch import entry_point

if __name__ == "__main__":
    entry_point("train/peagle.py", ("peagle",), __doc__.splitlines()[0])
