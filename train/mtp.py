"""Train an MTP module drafter (FastMTP: one module applied recursively K times) from a recipe.

    accelerate launch train/mtp.py recipes/smollm2-135m-mtp.yaml [dotted.key=value ...]

(``draftlab train RECIPE`` does the same for any family.) Relaunching the same command resumes
from the last checkpoint in ``output_dir``.
"""

from draftlab.train.launch import entry_point

if __name__ == "__main__":
    entry_point("train/mtp.py", ("mtp",), __doc__.splitlines()[0])
