"""Train an EAGLE-1 or EAGLE-3 drafter from a recipe.

    accelerate launch train/eagle.py recipes/smollm2-135m-eagle3.yaml [dotted.key=value ...]

(``draftlab train RECIPE`` does the same for any family.) Relaunching the same command resumes
from the last checkpoint in ``output_dir``.
"""

from draftlab.train.launch import entry_point

if __name__ == "__main__":
    entry_point("train/eagle.py", ("eagle1", "eagle3"), __doc__.splitlines()[0])
