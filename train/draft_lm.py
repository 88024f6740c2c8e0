"""Train an independent draft LM (the target's architecture, fewer layers) by distillation from a recipe.

    accelerate launch train/draft_lm.py recipes/smollm2-135m-draft-lm.yaml [dotted.key=value ...]

(``draftlab train RECIPE`` does the same for any family.) Relaunching the same command resumes
from the last checkpoint in ``output_dir``.
"""

from draftlab.train.launch import entry_point

if __name__ == "__main__":
    entry_point("train/draft_lm.py", ("draft_lm",), __doc__.splitlines()[0])
