"""Search the layers a layer-skip self-speculative draft skips (SWIFT's search, Draft & Verify's
draft exit) from a recipe, then measure it against fixed skip sets.

    accelerate launch train/layerskip.py recipes/smollm2-135m-layerskip.yaml [dotted.key=value ...]

(``draftlab train RECIPE`` does the same.) A relaunch searches again from the start.
"""

from draftlab.train.launch import entry_point

if __name__ == "__main__":
    entry_point("train/layerskip.py", ("layerskip",), __doc__.splitlines()[0])
