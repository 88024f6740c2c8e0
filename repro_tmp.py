import sys, torch
sys.path.insert(0, "tests")
from tiny import make_tiny_target_dir
from draftlab.models.target import Target
from draftlab.inference.graphs import GraphedTarget
import tempfile, pathlib
d = make_tiny_target_dir(pathlib.Path(tempfile.mkdtemp()) / "llama")
t = Target.load(str(d))
t.fused_decode = True
g = GraphedTarget(t, mode="replay")
for n in (5, 33, 100):
    p = torch.randint(3, 300, (n,))
    cache = t.new_cache(1, n)
    t.fused_decode = False
    eager = t(p[None], layers=[0, 2], cache=cache, logits="last")
    t.fused_decode = True
    done = g.prefill_prompt(p, (0, 2))
    print(n, (done.logits - eager.logits[0, -1]).abs().max().item(), (done.k - cache.k[:, 0, :, :n]).abs().max().item())
