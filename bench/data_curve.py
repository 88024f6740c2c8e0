"""Data-scaling curve: held-out acceptance of the main job's EAGLE-3 drafter against the number of
training tokens.

    python -m bench.data_curve [--recipe recipes/smollm2-135m-eagle3.yaml] [--tokens 100000,200000,400000,800000,1600000]
        [--out runs/curve] [--only TOKENS] [--num-prompts 32] [--k 3] [--max-new-tokens 64]
        [--prompts-from N] [--table-only] [--no-append] [recipe.key=value ...]

What it measures: for each ``--tokens`` value T, the recipe (with the dotted overrides, e.g.
``loss.ttt_steps=3 train.epochs=2``) trained on the first N conversations of its data source, N
the smallest for which the training split holds at least T tokens (the ``input_ids`` tokens of the
training samples ``draftlab.data.dataset.build_samples`` makes: chat template, ``data.max_length``
truncation, the recipe's held-out conversations left out); then α_1..α_k pooled over prompts and
τ at chain ``--k``, greedy, each with one bootstrap standard error over prompts, on the same
``--num-prompts`` held-out prompts for every point. Below the table: the slope per doubling of
training tokens (least squares of τ and of α1 against log2 tokens, the slope's s.e. from the fit's
residuals; "n/a" under 3 points) and the code each point ran on.

The pieces, each resumable (a rerun skips what is finished; ``--only T`` runs the one point T,
``--table-only`` runs nothing and tabulates the finished points):

* ``OUT/setup.json``: the recipe (its fingerprint with ``data.num_conversations`` and ``capture``
  left out, plus epochs, max_steps and the eval section) and the prompt settings this ``--out``
  holds points of; another recipe or prompt setting is refused (use a new ``--out``). ``--k`` may
  change: each point is then evaluated again at the new k (its training is kept).
* ``OUT/plan.json``: N per T. One pass tokenises the source's conversations in file order (as
  ``data.num_conversations`` loads them) up to the largest T, keeping the running training-token
  sum as the held-out split (the ``data.heldout`` lowest keyed hashes among the first N) moves;
  each N is then confirmed by ``build_samples`` of that N. A T larger than the source gives is a
  one-line error naming ``--tokens``.
* ``OUT/prompts.jsonl``: the evaluation prompts, written once in OpenAI messages form: the first user
  turns of conversations past ``--prompts-from`` (read with draftlab's own source reader, so the
  same cleaning applies; any ``data.source``: ShareGPT, JSONL, hf:), ranked by a keyed hash of the
  conversation (consecutive ShareGPT records are often chunks of one conversation), a prompt equal
  to one of the first ``--prompts-from`` conversations' or to an earlier pick skipped, and one
  that does not fit the target's positions with ``--max-new-tokens`` skipped. The largest point
  must train on no more than ``--prompts-from`` conversations, so no prompt was trained on.
* ``OUT/points/<T>/capture``: ``draftlab capture`` of the point's training split into offline shards
  (checksummed, resumable shard by shard), passed exactly the recipe's data fields (so its
  manifest's ``data`` equals the recipe's data section, which the trainer checks), the layers the
  drafter reads, stored as bfloat16 (2 bytes a value, the most compact storage dtype: float16 is
  as small but overflows past 65504; the trainer casts either back to the target's dtype). A
  recipe whose data section or target the capture command cannot reproduce (data fields it has no
  flag for, set to other than their defaults: ``min_loss_tokens``, ``hf_split``, ``hf_column``,
  ``regenerate_*``; a target dtype other than float32, or ``trust_remote_code``) trains with the
  recipe's own ``capture.mode`` instead, and ``point.json`` says why (``data.regenerate`` itself
  is refused: its training tokens are not known before the target regenerates them). Offline rather than
  the main job's memory mode: at 1.6M tokens its fp32 features would need ~15 GB of RAM, and a
  memory-mode run killed mid-way captures every feature again.
* ``OUT/points/<T>/`` is also the training run's ``output_dir``: ``python -m draftlab.cli train
  RECIPE output_dir=OUT/points/<T> data.num_conversations=N <overrides> capture.mode=offline
  capture.offline_dir=OUT/points/<T>/capture`` (the bench sets these keys: an override of
  ``output_dir``, ``data.num_conversations`` or ``capture.*`` is refused), relaunched (it resumes
  from its last checkpoint, to the same weights) until the run's last checkpoint is at its final
  step (a launch stopped by ``train.time_limit_minutes`` exits 0 at an earlier one). ``train.json`` records each
  launch (code, steps); ``metrics.jsonl`` gives the training minutes (``elapsed_s`` of the last step).
* ``OUT/points/<T>/eval-k<K>.json`` (+ .md, .png): ``python -m draftlab.cli eval --drafter
  OUT/points/<T>/checkpoints/best --data OUT/prompts.jsonl --method chain --k K --num-prompts P
  --max-new-tokens M --report ...`` (``--target`` when the recipe's is not the default), with plain
  decoding beside it for the greedy match.
* ``OUT/points/<T>/point.json``: tokens, conversations, training samples, epochs, TTT steps, training
  minutes, α_j, τ and their s.e., greedy match count, the git commit (``+dirty`` with tracked
  changes) when its training ran and when its eval ran, the date. Its presence (at this ``--k``)
  marks the point finished. A point whose run directory was lost may be kept as a point.json
  rebuilt from a published table's row, with ``from_table`` naming the table: the report names it.

Unless ``--no-append``, the table replaces BENCHMARKS.md's section "Data-scaling curve: EAGLE-3
acceptance against training tokens" (bench/sections.py; the old one moves to bench/HISTORY.md)
when at least one point is finished. ``--table-only`` with no finished point says so in one line
and exits 1. Bad input (``--tokens`` not increasing positive integers, ``--only`` not among them, a
recipe that is not eagle3, ``--k`` < 1, ``--num-prompts`` < 2, too few conversations past
``--prompts-from``, a point larger than the source) is one line and exit 2.

To resume: run the same command again (after a kill, a crash or a ``train.time_limit_minutes``
stop); finished points and stages are skipped, an interrupted capture or training continues where
it stopped, an interrupted eval runs again.

Cost on this 2-core CPU (estimates, not measured: the recipe's defaults, ShareGPT openings of ~480
tokens at ``max_length`` 512, so 1.6M tokens ≈ 3,400 conversations): the capture at ~500 target
tokens/s on 2 threads is ~3.5 min per 100k tokens (~55 min for the 1.6M point); training reads the
shards but recomputes the target's full-vocabulary greedy token every epoch (memory mode caches it),
estimated at ~4-5 min per 100k tokens for 4 epochs plus the recipe's after-checkpoint reports
(~1 min every 158 steps); the eval of 32 prompts × 64 tokens, speculative and plain, ~4 min. So
roughly 2-3 h for the 1.6M point and 4-6 h for the five default points. The shards take ~4.6 kB a
token on disk (4 layers × 576 × 2 bytes): ~7.4 GB for the 1.6M point, ~14 GB for all five; they
are kept (delete ``OUT/points/<T>/capture`` once a point is finished to free the space).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from draftlab.errors import DraftlabError

REPO = Path(__file__).resolve().parent.parent
TITLE = "Data-scaling curve: EAGLE-3 acceptance against training tokens"
DEFAULT_TOKENS = "100000,200000,400000,800000,1600000"
STORAGE_DTYPE = "bfloat16"
DASH = "–"
# data fields `draftlab capture` has a flag for (data/capture_cli.py)
CAPTURE_FIELDS = {"source": "--data", "path": "--data-path", "num_conversations": "--num-conversations",
                  "max_length": "--max-length", "heldout": "--heldout", "seed": "--seed"}


# ------------------------------------------------------------------------------ small helpers
def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DraftlabError(f"{path}: cannot read ({getattr(e, 'msg', None) or e})") from None


def write_json(path: Path, obj) -> None:
    from draftlab import atomic

    atomic.write_json(path, obj)


def code_version() -> str:
    """The checkout's commit (``git rev-parse --short HEAD``), ``+dirty`` when tracked files changed."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                                text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def cli(*args: str) -> list[str]:
    """A ``draftlab`` command as a user runs it (this interpreter's ``python -m draftlab.cli``)."""
    return [sys.executable, "-m", "draftlab.cli", *args]


def run_cli(cmd: list[str]) -> int:
    import shlex

    print("+ python " + shlex.join(cmd[1:]), flush=True)
    return subprocess.run(cmd).returncode


# ------------------------------------------------------------------------------ arguments
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, through main_with_errors (exit 2)
        raise DraftlabError(message)


def parse_tokens(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise DraftlabError(f"--tokens: expected comma-separated whole numbers of tokens, got {text!r}") from None
    if not tokens or any(t < 1 for t in tokens) or any(b <= a for a, b in zip(tokens, tokens[1:])):
        raise DraftlabError(f"--tokens: expected increasing positive numbers of tokens, got {text!r}")
    return tokens


def parse_args(argv):
    p = _Parser(prog="python -m bench.data_curve", description="Data-scaling curve: held-out EAGLE-3 acceptance against training tokens")
    p.add_argument("--recipe", default="recipes/smollm2-135m-eagle3.yaml")
    p.add_argument("--tokens", default=DEFAULT_TOKENS, help="training tokens of each point, increasing")
    p.add_argument("--out", default="runs/curve")
    p.add_argument("--only", type=int, default=None, metavar="TOKENS", help="run this one point of --tokens")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts-from", type=int, default=6000,
                   help="evaluation prompts come from conversations past this many (past every point's training data)")
    p.add_argument("--table-only", action="store_true", help="run nothing; tabulate the finished points")
    p.add_argument("--no-append", action="store_true", help="print the table; leave BENCHMARKS.md as it is")
    p.add_argument("overrides", nargs="*", help="recipe overrides (dotted.key=value), for every point")
    args = p.parse_args(argv)
    args.tokens = parse_tokens(args.tokens)
    if args.only is not None and args.only not in args.tokens:
        raise DraftlabError(f"--only {args.only}: not among --tokens ({','.join(map(str, args.tokens))})")
    if args.k < 1:
        raise DraftlabError(f"--k must be >= 1, got {args.k}")
    if args.num_prompts < 2:
        raise DraftlabError(f"--num-prompts must be >= 2 (a standard error needs two prompts), got {args.num_prompts}")
    if args.max_new_tokens < 1:
        raise DraftlabError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.prompts_from < 0:
        raise DraftlabError(f"--prompts-from must be >= 0, got {args.prompts_from}")
    return args


# ------------------------------------------------------------------------------ the recipe
class Curve:
    """The recipe, ``--out`` and its files."""

    def __init__(self, args):
        from draftlab.recipe import load_recipe

        self.args = args
        self.out = Path(args.out).absolute()
        for item in args.overrides:
            key = item.partition("=")[0]
            if key in ("output_dir", "data.num_conversations") or key.startswith("capture."):
                raise DraftlabError(f"override {item}: the bench sets {key} for each point")
        self.recipe = load_recipe(args.recipe, args.overrides)
        if self.recipe.algorithm != "eagle3":
            raise DraftlabError(f"{args.recipe}: algorithm is {self.recipe.algorithm!r}; this curve is of the EAGLE-3 drafter (eagle3)")
        if self.recipe.data.regenerate:
            raise DraftlabError(f"{args.recipe}: data.regenerate trains on the target's own answers, whose tokens are not known "
                                "before they are generated: this curve counts training tokens in advance")
        _, self.drafter_cfg, self.loss_cfg = self.recipe.algorithm_configs()
        self._tokenizer = None

    # ---- files
    @property
    def points_dir(self) -> Path:
        return self.out / "points"

    def point_dir(self, tokens: int) -> Path:
        return self.points_dir / str(tokens)

    @property
    def prompts_path(self) -> Path:
        return self.out / "prompts.jsonl"

    def setup(self) -> dict:
        from draftlab.recipe import CaptureSpec

        r = self.recipe
        base = r.model_copy(update={"data": r.data.model_copy(update={"num_conversations": None}), "capture": CaptureSpec()})
        return {"recipe": base.fingerprint(), "epochs": r.train.epochs, "max_steps": r.train.max_steps,
                "eval": r.eval.model_dump(mode="json"), "prompts_from": self.args.prompts_from,
                "num_prompts": self.args.num_prompts, "max_new_tokens": self.args.max_new_tokens}

    def check_setup(self, create: bool) -> bool:
        """``--out`` holds points of this recipe and these prompts (else a one-line error); with
        ``create``, a new ``--out`` is marked as theirs. Returns whether it is marked."""
        path = self.out / "setup.json"
        setup = json.loads(json.dumps(self.setup()))
        if path.is_file():
            old = read_json(path)
            if old != setup:
                what = ", ".join(k for k in setup if old.get(k) != setup[k])
                raise DraftlabError(f"--out {self.args.out}: holds points of another recipe or prompt setting ({what} differs); "
                                    "use a new --out")
            return True
        if create:
            self.out.mkdir(parents=True, exist_ok=True)
            write_json(path, setup)
            return True
        return False

    # ---- the target's tokenizer (no weights)
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoConfig, AutoTokenizer

            from draftlab.models.target import resolve_target

            t = self.recipe.target
            path, _ = resolve_target(t.model)
            self._tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=t.trust_remote_code)
            config = AutoConfig.from_pretrained(path, trust_remote_code=t.trust_remote_code)
            self.max_positions = getattr(config, "max_position_embeddings", None)
        return self._tokenizer

    def data_spec(self, conversations: int | None):
        return self.recipe.data.model_copy(update={"num_conversations": conversations})

    def conversations(self):
        """The source's clean conversations in file order (what ``data.num_conversations`` takes first)."""
        from draftlab.data.sources import iter_conversations

        d = self.recipe.data
        return iter_conversations(d.source, d.path, None, d.hf_split, d.hf_column)


# ------------------------------------------------------------------------------ N per point
def plan(curve: Curve) -> dict[int, dict]:
    """tokens -> {conversations, training_samples, training_tokens, batches_per_epoch} for every
    ``--tokens`` value, from ``OUT/plan.json`` or computed (and added to it)."""
    path = curve.out / "plan.json"
    known = {int(k): v for k, v in read_json(path).items()} if path.is_file() else {}
    missing = [t for t in curve.args.tokens if t not in known]
    if missing:
        known.update(compute_plan(curve, missing))
        write_json(path, {str(k): known[k] for k in sorted(known)})
    return {t: known[t] for t in curve.args.tokens}


def compute_plan(curve: Curve, wanted: list[int]) -> dict[int, dict]:
    from draftlab.data.chat import ChatTemplateError, tokenize_conversation
    from draftlab.data.dataset import batches_by_tokens, build_samples
    from draftlab.data.sources import conversation_digest

    spec = curve.recipe.data
    tok = curve.tokenizer
    held: list[tuple[str, int]] = []  # the split's held-out keys among the first N: the `heldout` lowest
    lengths: list[int] = []  # training tokens of each conversation (0: build_samples drops it)
    total = 0
    found: dict[int, tuple[int, int]] = {}  # tokens -> (N, training tokens counted)
    goals = sorted(wanted)
    t0 = time.perf_counter()

    def training_tokens() -> int:
        return total - sum(lengths[j] for _, j in held)

    for i, conv in enumerate(curve.conversations()):
        try:
            ids, mask = tokenize_conversation(tok, conv, spec.max_length)
            n = len(ids) if sum(mask) >= spec.min_loss_tokens else 0  # build_samples' filters
        except ChatTemplateError:
            n = 0
        lengths.append(n)
        total += n
        if spec.heldout > 0:
            bisect.insort(held, (conversation_digest(conv, f"split:{spec.seed}"), i))  # split_heldout's order
            if len(held) > spec.heldout:
                held.pop()  # the highest key goes back into the training split
        N = i + 1
        while goals and N > spec.heldout and training_tokens() >= goals[0]:
            found[goals.pop(0)] = (N, training_tokens())
        if not goals:
            break
        if N % 1000 == 0:
            print(f"plan: {N} conversations tokenised, {training_tokens()} training tokens, {time.perf_counter() - t0:.0f} s",
                  flush=True)
    if goals:
        raise DraftlabError(f"--tokens {goals[0]}: data.source {spec.source} gives only {training_tokens()} training tokens from "
                            f"all of its {len(lengths)} conversations (data.max_length {spec.max_length}, data.heldout {spec.heldout})")
    out = {}
    for tokens, (N, counted) in sorted(found.items()):
        samples = build_samples(curve.data_spec(N), tok).train
        got = sum(len(s["input_ids"]) for s in samples)
        if got != counted:
            raise DraftlabError(f"--tokens {tokens}: build_samples gives {got} training tokens from {N} conversations, this "
                                f"bench counted {counted}: the two disagree (a bug in bench/data_curve.py's count)")
        out[tokens] = {"conversations": N, "training_samples": len(samples), "training_tokens": got,
                       "batches_per_epoch": len(batches_by_tokens(samples, curve.recipe.train.batch_tokens, curve.recipe.seed, 0))}
        print(f"plan: {tokens} tokens: {N} conversations, {len(samples)} training samples, {got} tokens", flush=True)
    return out


def total_steps(curve: Curve, entry: dict) -> int:
    """The run's last step, as the trainer counts it for one process (train/trainer.py)."""
    t = curve.recipe.train
    return t.max_steps or max(1, int(t.epochs * (entry["batches_per_epoch"] // t.grad_accum)))


# ------------------------------------------------------------------------------ prompts
def first_user_turn(conv: list[dict]) -> list[dict]:
    for i, m in enumerate(conv):
        if m["role"] == "user":
            return [dict(m2) for m2 in conv[: i + 1]]
    raise DraftlabError("a conversation without a user turn")  # sources.py never yields one


def write_prompts(curve: Curve) -> None:
    """``OUT/prompts.jsonl``, once (see the module docstring)."""
    from draftlab import atomic
    from draftlab.data.sources import conversation_digest
    from draftlab.inference.prompts import chat_prompt_ids

    path = curve.prompts_path
    if path.is_file():
        return
    a = curve.args
    seen, ranked, n = set(), [], 0
    for i, conv in enumerate(curve.conversations()):
        n += 1
        prompt = first_user_turn(conv)
        key = json.dumps(prompt, sort_keys=True)
        if i < a.prompts_from:
            seen.add(key)
        else:
            ranked.append((conversation_digest(conv, "data-curve-prompts"), i, key, prompt))
    ranked.sort()
    tok = curve.tokenizer
    picked = []
    for _, i, key, prompt in ranked:
        if len(picked) == a.num_prompts:
            break
        if key in seen:
            continue
        seen.add(key)
        if curve.max_positions and len(chat_prompt_ids(tok, prompt)) + a.max_new_tokens > curve.max_positions:
            continue
        picked.append({"id": str(i), "category": "sharegpt", "messages": prompt})
    if len(picked) < a.num_prompts:
        raise DraftlabError(f"--prompts-from {a.prompts_from}: data.source {curve.recipe.data.source} has {len(ranked)} conversations "
                            f"past it ({n} in all), {len(picked)} with distinct prompts that fit: fewer than --num-prompts "
                            f"{a.num_prompts}")
    atomic.write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in picked))
    print(f"prompts: {len(picked)} first user turns of conversations past {a.prompts_from} in {path}", flush=True)


# ------------------------------------------------------------------------------ one point
def offline_capture(curve: Curve, conversations: int) -> tuple[list[str] | None, str]:
    """(the ``draftlab capture`` data flags that reproduce the recipe's data section with
    ``data.num_conversations`` = ``conversations``, ''), or (None, why it cannot)."""
    from draftlab.data.dataset import DataSpec

    spec = curve.data_spec(conversations)
    t = curve.recipe.target
    if t.dtype != "float32" or t.trust_remote_code:
        return None, (f"draftlab capture loads the target in float32 without trust_remote_code; the recipe's target has "
                      f"dtype {t.dtype}, trust_remote_code {t.trust_remote_code}")
    fields = {k: getattr(spec, k) for k in CAPTURE_FIELDS if getattr(spec, k) is not None}
    if DataSpec(**fields).model_dump(mode="json") != spec.model_dump(mode="json"):
        other = [k for k, v in spec.model_dump(mode="json").items() if k not in CAPTURE_FIELDS and v != DataSpec.model_fields[k].default]
        return None, f"draftlab capture has no flag for data.{', data.'.join(other)}"
    flags = []
    for k, flag in CAPTURE_FIELDS.items():
        if k in fields:
            flags += [flag, str(fields[k])]
    return flags, ""


def capture_layers(curve: Curve) -> str:
    aux = curve.drafter_cfg.aux_layers
    return ",".join(map(str, aux)) if aux else "eagle3"  # the family's default layers; the last is always added


def run_capture(curve: Curve, pdir: Path, flags: list[str]) -> dict:
    """``draftlab capture`` into ``pdir/capture`` until its manifest is complete."""
    cap = pdir / "capture"
    state_path = pdir / "capture.json"
    state = read_json(state_path) if state_path.is_file() else {"launches": []}
    manifest = cap / "manifest.json"
    if manifest.is_file() and read_json(manifest).get("complete"):
        return state
    cmd = cli("capture", "--target", curve.recipe.target.model, *flags, "--split", "train", "--layers", capture_layers(curve),
              "--dtype", STORAGE_DTYPE, "--out", str(cap))
    launch = {"code": code_version(), "date": now()}
    state["launches"].append(launch)
    pdir.mkdir(parents=True, exist_ok=True)
    write_json(state_path, state)
    t0 = time.perf_counter()
    rc = run_cli(cmd)
    launch.update(rc=rc, wall_s=time.perf_counter() - t0)
    write_json(state_path, state)
    if rc != 0:
        raise DraftlabError(f"{cap}: draftlab capture exited {rc} (its error above); rerun to resume the capture")
    return state


def last_step(run: Path) -> int:
    from draftlab.checkpoint import list_checkpoints, read_meta

    found = list_checkpoints(run)
    return int(read_meta(found[-1])["step"]) if found else 0


def run_training(curve: Curve, tokens: int, entry: dict, pdir: Path, capture_overrides: list[str]) -> dict:
    """``draftlab train`` into ``pdir``, relaunched until its last checkpoint is the final step."""
    from draftlab.train.preemption import EXIT_PREEMPTED

    state_path = pdir / "train.json"
    state = read_json(state_path) if state_path.is_file() else {"launches": [], "complete": False}
    if state.get("complete"):
        return state
    final = total_steps(curve, entry)
    cmd = cli("train", str(Path(curve.args.recipe).absolute()), f"output_dir={pdir}",
              f"data.num_conversations={entry['conversations']}", *curve.args.overrides, *capture_overrides)
    while True:
        before = last_step(pdir)
        if before >= final:
            break
        launch = {"code": code_version(), "date": now(), "from_step": before}
        state["launches"].append(launch)
        pdir.mkdir(parents=True, exist_ok=True)
        write_json(state_path, state)
        t0 = time.perf_counter()
        rc = run_cli(cmd)
        after = last_step(pdir)
        launch.update(rc=rc, to_step=after, wall_s=time.perf_counter() - t0)
        write_json(state_path, state)
        if rc == EXIT_PREEMPTED:
            raise DraftlabError(f"point {tokens}: training was preempted at step {after}/{final}; rerun to resume it")
        if rc != 0:
            raise DraftlabError(f"point {tokens}: draftlab train exited {rc} at step {after}/{final} (its error above); "
                                "rerun to resume it")
        if after <= before:  # the trainer found nothing left to do: its last step is ours
            print(f"point {tokens}: the run ends at step {after} (expected {final})", flush=True)
            break
    state.update(complete=True, steps=last_step(pdir))
    write_json(state_path, state)
    return state


def run_eval(curve: Curve, pdir: Path) -> tuple[dict, dict]:
    """The point's acceptance report at ``--k`` on ``OUT/prompts.jsonl`` and the code it ran on."""
    from bench.runs import checkpoint_of

    a = curve.args
    report = pdir / f"eval-k{a.k}.json"
    marker = pdir / f"eval-k{a.k}.code.json"
    ckpt = checkpoint_of(pdir)
    if not report.is_file():
        cmd = cli("eval", "--drafter", str(ckpt), "--data", str(curve.prompts_path), "--method", "chain", "--k", str(a.k),
                  "--num-prompts", str(a.num_prompts), "--max-new-tokens", str(a.max_new_tokens), "--report", str(report))
        if curve.recipe.target.model != "default":
            cmd += ["--target", curve.recipe.target.model]
        write_json(marker, {"code": code_version(), "date": now(), "checkpoint": str(ckpt)})
        rc = run_cli(cmd)
        if rc != 0 or not report.is_file():
            raise DraftlabError(f"{pdir}: draftlab eval exited {rc} (its error above); rerun to evaluate again")
    code = read_json(marker) if marker.is_file() else {"code": code_version(), "date": now(), "checkpoint": str(ckpt)}
    return read_json(report), code


def finite(xs: list[float]) -> list[float | None]:
    """NaN (α_j after a position no draft reached) as null: JSON has no NaN."""
    return [None if x is None or math.isnan(x) else x for x in xs]


def training_minutes(pdir: Path) -> float | None:
    """The run's training minutes: ``elapsed_s`` of its last logged step (resumed runs go on counting)."""
    from bench.families import elapsed_by_step

    elapsed = elapsed_by_step(pdir)
    return elapsed[max(elapsed)] / 60 if elapsed else None


def run_point(curve: Curve, tokens: int, entry: dict) -> dict:
    from bench.machine import cpu_name
    from draftlab.inference.paired import bootstrap

    a = curve.args
    pdir = curve.point_dir(tokens)
    done = pdir / "point.json"
    if done.is_file() and read_json(done).get("k") == a.k:
        print(f"point {tokens}: finished ({done}); skipped", flush=True)
        return read_json(done)
    print(f"point {tokens}: {entry['conversations']} conversations, {entry['training_tokens']} training tokens", flush=True)
    trained = (pdir / "train.json").is_file() and read_json(pdir / "train.json").get("complete")
    flags, why = offline_capture(curve, entry["conversations"])
    capture = {"mode": "offline", "storage_dtype": STORAGE_DTYPE} if flags else {"mode": curve.recipe.capture.mode, "why": why}
    overrides = []
    if flags:
        if not trained:
            capture.update(run_capture(curve, pdir, flags))
        elif (pdir / "capture.json").is_file():
            capture.update(read_json(pdir / "capture.json"))
        overrides = ["capture.mode=offline", f"capture.offline_dir={pdir / 'capture'}"]
        if curve.recipe.capture.group_tokens is not None:
            overrides.append("capture.group_tokens=null")  # memory mode's alone
    else:
        print(f"point {tokens}: no offline capture ({why}); training with capture.mode={curve.recipe.capture.mode}", flush=True)
    train = run_training(curve, tokens, entry, pdir, overrides)
    report, evaluated = run_eval(curve, pdir)
    st = bootstrap({"point": report}, a.k, base="point")["point"]
    train_codes = list(dict.fromkeys(x["code"] for x in train["launches"])) or ["unknown"]
    point = {
        "tokens": tokens, "training_tokens": entry["training_tokens"], "conversations": entry["conversations"],
        "training_samples": entry["training_samples"], "epochs": curve.recipe.train.epochs,
        "ttt_steps": curve.loss_cfg.ttt_steps, "steps": train.get("steps"), "training_minutes": training_minutes(pdir),
        "capture": {k: v for k, v in capture.items() if k != "launches"} | {
            "minutes": sum(x.get("wall_s", 0) for x in capture.get("launches", [])) / 60},
        "k": a.k, "num_prompts": a.num_prompts, "max_new_tokens": a.max_new_tokens,
        "alpha": finite(st["alpha"]), "tau": st["tau"], "se": finite(st["se"]), "matched": st["matched"], "prompts": st["prompts"],
        "checkpoint": evaluated.get("checkpoint"), "train_code": train_codes, "eval_code": evaluated["code"],
        "trained": train["launches"][-1]["date"] if train["launches"] else None, "evaluated": evaluated["date"],
        "date": now(), "machine": f"{cpu_name()}, {os.cpu_count()} cores",
    }
    write_json(done, point)
    print(f"point {tokens}: τ {point['tau']:.3f} ± {point['se'][a.k]:.3f}, α1 {point['alpha'][0]:.3f}; {done}", flush=True)
    return point


# ------------------------------------------------------------------------------ table
def finished_points(curve: Curve) -> list[dict]:
    """Every point under ``OUT/points`` finished at ``--k``, by tokens."""
    out = []
    if curve.points_dir.is_dir():
        for d in curve.points_dir.iterdir():
            f = d / "point.json"
            if f.is_file():
                p = read_json(f)
                if p.get("k") == curve.args.k:
                    out.append(p)
    return sorted(out, key=lambda p: p["tokens"])


def fit_slope(xs: list[float], ys: list[float]) -> tuple[float, float | None]:
    """Least-squares slope of ys on xs and its standard error from the residuals (None under 3 points)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return math.nan, None
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    if n < 3:
        return b, None
    a = my - b * mx
    s2 = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys)) / (n - 2)
    return b, math.sqrt(s2 / sxx)


def slope_line(points: list[dict]) -> str:
    if len(points) < 3:
        return (f"Slope per doubling of training tokens (least squares against log2 tokens): n/a "
                f"({len(points)} point{'s' if len(points) != 1 else ''}; it needs 3)")
    xs = [math.log2(p["training_tokens"]) for p in points]
    parts = []
    for name, ys in (("τ", [p["tau"] for p in points]), ("α1", [p["alpha"][0] for p in points])):
        b, se = fit_slope(xs, ys)
        parts.append(f"{name} {b:+.4f} ± {se:.4f}")
    return (f"Slope per doubling of training tokens (least squares against log2 tokens over {len(points)} points, "
            f"± the slope's s.e. from the fit residuals): {', '.join(parts)}")


def code_cell(p: dict) -> str:
    train = ",".join(p["train_code"])
    return train if [p["eval_code"]] == p["train_code"] else f"{train} / {p['eval_code']}"


def table(points: list[dict], k: int) -> str:
    head = ["training tokens", "conversations", "epochs", "training min", *[f"α{j}" for j in range(1, k + 1)], "τ",
            "greedy match", "code (train / eval)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        cells = [f"{p['training_tokens']:,}", str(p["conversations"]), f"{p['epochs']:g}",
                 DASH if p["training_minutes"] is None else f"{p['training_minutes']:.1f}"]
        cells += [DASH if p["alpha"][j] is None else f"{p['alpha'][j]:.3f} ± {p['se'][j]:.3f}" for j in range(k)]
        cells += [f"{p['tau']:.3f} ± {p['se'][k]:.3f}", f"{p['matched']}/{p['prompts']}", code_cell(p)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report_text(curve: Curve, points: list[dict]) -> str:
    a, r = curve.args, curve.recipe
    ttt = sorted({p["ttt_steps"] for p in points})
    capture = sorted({p["capture"]["mode"] for p in points})
    trains = sorted({c for p in points for c in p["train_code"]})
    evals = sorted({p["eval_code"] for p in points})
    machines = sorted({p.get("machine", "?") for p in points})
    overrides = f" with {' '.join(a.overrides)}" if a.overrides else ""
    head = (f"`{a.recipe}`{overrides} (data.source {r.data.source}, max_length {r.data.max_length}, heldout {r.data.heldout}; "
            f"TTT steps {', '.join(map(str, ttt))}; capture {', '.join(capture)}), trained on the first N conversations, N the "
            f"fewest whose training split holds the point's tokens; each point's drafter is its run's checkpoints/best (picked "
            f"by the recipe's after-checkpoint reports; the last checkpoint without them). Every point decodes the same {a.num_prompts} prompts "
            f"(first user turns of conversations past {a.prompts_from}) × {a.max_new_tokens} new tokens, chain k={a.k}, "
            f"greedy; α_j pooled over prompts, ± one bootstrap s.e. over prompts; greedy match: prompts whose output equals "
            f"plain decoding's.")
    carried = [p for p in points if p.get("from_table")]
    kept = ""
    if carried:  # points whose run directories were lost: point.json rebuilt from an earlier table's row
        at = ", ".join(format(p["training_tokens"], ",") for p in carried)
        sources = "; ".join(sorted({p["from_table"] for p in carried}))
        kept = f" Points at {at} tokens: carried from {sources} (point.json rebuilt from its row; the run directories were not kept)."
    tail = (f"{slope_line(points)}.\n\nCode: training {', '.join(trains)}; eval {', '.join(evals)}. "
            f"Machine: {'; '.join(machines)}.{kept}")
    return f"{head}\n\n{table(points, a.k)}\n\n{tail}"


# ------------------------------------------------------------------------------ main
def run(argv, args) -> int:
    started = datetime.now(timezone.utc)
    curve = Curve(args)
    if args.table_only:
        curve.check_setup(create=False)
        points = finished_points(curve)
        if not points:
            print(f"bench.data_curve: no point is finished at k={args.k} in {curve.points_dir}; nothing to tabulate",
                  file=sys.stderr)
            return 1
    else:
        curve.check_setup(create=True)
        entries = plan(curve)
        largest = entries[args.tokens[-1]]["conversations"]
        if largest > args.prompts_from:
            raise DraftlabError(f"--prompts-from {args.prompts_from}: the largest point (--tokens {args.tokens[-1]}) trains on the "
                                f"first {largest} conversations; pass --prompts-from {largest} or more")
        write_prompts(curve)
        for tokens in [args.only] if args.only is not None else args.tokens:
            run_point(curve, tokens, entries[tokens])
        points = finished_points(curve)
    text = report_text(curve, points)
    print(text)
    if not args.no_append:
        from bench.sections import append_run

        append_run(TITLE, started, "bench.data_curve", argv, text + "\n")
    return 0


def main(argv=None) -> int:
    from bench.runs import main_with_errors

    return main_with_errors("bench.data_curve", parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
