"""Trainer parity: the main job's EAGLE-3 drafter trained by draftlab, speculators and SpecForge at
equal data, each imported and judged by draftlab's decoder on the same held-out prompts.

    python -m bench.trainer_parity [--out runs/parity] [--systems draftlab,speculators,specforge]
        [--recipe recipes/smollm2-135m-eagle3.yaml] [--num-prompts 32] [--k 3] [--max-new-tokens 64]
        [--threads N] [--no-append] [--quick] [recipe.key=value ...]

Every arm trains the recipe's drafter shape (target, auxiliary layers [2, L//2, L-3], one layer,
the recipe's draft vocabulary: one t2d/d2t for all) on the recipe's training conversations,
tokenised once by draftlab's data stage (same tokens, same loss masks), for the recipe's epochs:
the same training tokens. Each trainer otherwise runs with its own defaults:

* ``draftlab``: the recipe as shipped, ``draftlab train RECIPE`` (its own memory-mode capture;
  relaunched after a ``train.time_limit_minutes`` stop, as a user would; its training wall time is
  the trainer's own clock, after-checkpoint reports excluded).
* ``speculators`` (0.9.0): its ``Trainer`` with its ``TrainConfig`` defaults for eagle3 (Muon +
  AdamW at 1e-3, linear schedule with 1 % warm-up, clip 1.0, 3 TTT steps of equal weight with
  teacher-forced inputs, KL to the verifier over the draft vocabulary, lm_head copied from the
  verifier and frozen, ``norm_before_fc``, ``norm_before_residual``, ``norm_output``, samples
  packed into 8192-token rows, its ``shift_batch`` alignment). Patched: device placement only
  (``get_local_rank`` gives the CPU device; ``torch.accelerator.synchronize``, which its step
  timer calls, is a no-op without an accelerator). Not its defaults, because this CPU needs it:
  fp32 hidden states (``hidden_states_dtype``, default bf16), SDPA attention and the eager loss
  (flex attention and the fused Triton loss have no CPU path), no data-loader workers, and full
  attention where its default makes every draft layer a 2048-token sliding window: no training
  document is longer than the recipe's ``data.max_length`` (512), so the window never binds, and
  the export draftlab decodes carries no window.
* ``specforge`` (0.2.0): its draft model ``LlamaForCausalLMEagle3`` (lm_head randomly initialised
  and trained, embedding copied from the target and frozen) inside its ``OnlineEagle3Model``
  (7 TTT steps) with its strategy's 0.8^i step weights, its ``BF16Optimizer`` (AdamW 1e-4, no
  weight decay, clip 0.5, cosine with 1.5 % warm-up; fp32 masters of fp32 weights here), one
  unpadded sample a step, the target's full-vocabulary logits from the post-norm last hidden
  state through its ``TargetHead.preprocess`` shift. Patched: its Triton ``LogSoftmaxLoss`` is
  replaced by the pure-torch reference in ``specforge/core/loss.py`` (``_compute_loss``, the same
  value and gradient), and TorchDynamo is off (its ``torch.compile`` helpers run eagerly).

Stages, each resumable (a finished stage leaves a marker and is skipped when rerun): the shared
capture of the target's states (``capture.safetensors``: the auxiliary layers, the post-norm and
pre-norm last states), each arm's training (speculators and SpecForge checkpoint every epoch and
resume from the last), its import into a draftlab checkpoint (``draftlab import``), and one
``draftlab eval`` report per arm on ``--num-prompts`` held-out ShareGPT prompts at chain ``--k``.
The table pairs every arm with draftlab's per prompt: α_1..α_k pooled and τ with one standard
error from a bootstrap over prompts (paired: the same resampled prompts for both arms).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from draftlab.errors import DraftlabError
from draftlab.inference.paired import bootstrap, pm

REPO = Path(__file__).resolve().parent.parent
SYSTEMS = ("draftlab", "speculators", "specforge")
PEERS = {"speculators": ("speculators", "0.9.0"), "specforge": ("specforge", "0.2.0")}
IMPORT_FORMAT = {"speculators": "speculators", "specforge": "sglang"}


# ------------------------------------------------------------------------------ shared set-up
class Context:
    """What every arm shares: the recipe, the target, the training samples and the draftlab
    drafter built from them (its draft vocabulary and auxiliary layers are every arm's)."""

    def __init__(self, recipe_path: str, overrides: list[str], out: Path):
        from draftlab.data.dataset import build_samples
        from draftlab.models.target import Target, resolve_target
        from draftlab.recipe import load_recipe

        self.recipe_path, self.overrides, self.out = recipe_path, overrides, out
        self.recipe = load_recipe(recipe_path, overrides)
        if self.recipe.algorithm != "eagle3":
            raise DraftlabError(f"{recipe_path}: algorithm is {self.recipe.algorithm!r}; trainer parity compares EAGLE-3 trainers")
        self.target = Target.load(self.recipe.target.model, "float32", "cpu", self.recipe.target.trust_remote_code)
        self.target_dir = resolve_target(self.recipe.target.model)[0]
        self.samples = build_samples(self.recipe.data, self.target.tokenizer).train
        algo, drafter_cfg, _ = self.recipe.algorithm_configs()
        torch.manual_seed(self.recipe.seed)
        self.drafter = algo.build(drafter_cfg, self.target, self.samples).float()
        if self.recipe.train.epochs != int(self.recipe.train.epochs) or self.recipe.train.max_steps:
            raise DraftlabError(f"train.epochs ({self.recipe.train.epochs}) must be whole and train.max_steps unset: "
                                "every trainer runs the same whole epochs")
        self.epochs = int(self.recipe.train.epochs)
        self.tokens = sum(len(s["input_ids"]) for s in self.samples)

    @property
    def aux(self) -> list[int]:
        return list(self.drafter.aux_layers)

    def capture(self) -> dict[str, torch.Tensor]:
        """The target's states for every training sample, concatenated (``offsets`` [n+1]):
        ``aux`` [N, 3H] (the fused layers in order), ``post`` [N, H] (hidden[L], after the final
        norm: SpecForge's stored state), ``pre`` [N, H] (before it: speculators' stored state)."""
        from safetensors.torch import load_file, save_file

        from draftlab import atomic
        from draftlab.data.capture import capture_batch

        path = self.out / "capture.safetensors"
        if path.is_file():
            return load_file(path)
        L, pre = self.target.num_layers, []
        hook = self.target.final_norm.register_forward_pre_hook(lambda mod, args: pre.append(args[0][0]))
        parts = {"aux": [], "post": []}
        t0 = time.perf_counter()
        try:
            for i, s in enumerate(self.samples):
                h = capture_batch(self.target, s["input_ids"][None], self.aux + [L])
                parts["aux"].append(torch.cat([h[a][0] for a in self.aux], -1))
                parts["post"].append(h[L][0])
                if (i + 1) % 50 == 0:
                    print(f"capture: {i + 1}/{len(self.samples)} samples, {time.perf_counter() - t0:.0f} s", flush=True)
        finally:
            hook.remove()
        lengths = torch.tensor([len(s["input_ids"]) for s in self.samples])
        cap = {"aux": torch.cat(parts["aux"]), "post": torch.cat(parts["post"]), "pre": torch.cat(pre),
               "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])}
        atomic.write_file(path, lambda tmp: save_file(cap, tmp))
        print(f"capture: {len(self.samples)} samples, {int(lengths.sum())} tokens in {time.perf_counter() - t0:.0f} s", flush=True)
        return cap


def sample_states(cap: dict, i: int) -> dict[str, torch.Tensor]:
    a, b = int(cap["offsets"][i]), int(cap["offsets"][i + 1])
    return {k: cap[k][a:b] for k in ("aux", "post", "pre")}


def write_json(path: Path, obj) -> None:
    from draftlab import atomic

    atomic.write_json(path, obj)


# ------------------------------------------------------------------------------ draftlab
def train_draftlab(recipe_path: str, overrides: list[str], out: Path) -> dict:
    """A draftlab recipe (as shipped, or with ``overrides``) through the CLI a user runs, which
    resumes by itself when relaunched; its last checkpoint is the one judged, as for the peers."""
    run = out / "run"
    cmd = [sys.executable, "-m", "draftlab.cli", "train", recipe_path, f"output_dir={run}", *overrides]
    while not _launch(cmd):  # a launch stopped by train.time_limit_minutes: relaunch it, as a user would
        pass
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "acc" in r]
    last = steps[-10:]
    acc = sum(r["acc"][0] for r in last) / len(last) if last else None
    # its own clock (capture included, after-checkpoint reports and relaunches excluded)
    return {"checkpoint": str(sorted((run / "checkpoints").glob("step-*"))[-1]), "wall_s": last[-1]["elapsed_s"] if last else None,
            "train_metric": f"top-1 agreement (TTT step 0, last {len(last)} steps) {acc:.3f}" if last else "-",
            "steps": steps[-1].get("step") if steps else None}


def _launch(cmd: list[str]) -> bool:
    """Run ``draftlab train``, its output passed through; whether it reported its run complete."""
    complete = False
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        for line in p.stdout:
            sys.stdout.write(line)
            complete = complete or line.startswith("training complete")
    if p.returncode != 0:
        raise DraftlabError(f"draftlab train exited {p.returncode} (its error above); rerun to resume it")
    return complete


# ------------------------------------------------------------------------------ speculators
def train_speculators(ctx: Context, out: Path, cap: dict) -> dict:
    import logging

    import speculators.train.trainer as spec_trainer
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.config.schema import TrainConfig
    from speculators.train.data import BaseDataset
    from speculators.train.dataloader import _setup_dataloader

    # device placement, the only patches (see the module docstring)
    spec_trainer.get_local_rank = lambda: torch.device("cpu")
    if torch.accelerator.current_accelerator() is None:
        torch.accelerator.synchronize = lambda *a, **k: None

    defaults = TrainConfig.model_validate({"speculator_type": "eagle3", "verifier_name_or_path": ctx.target_dir})
    d, loss, opt, sch = defaults.draft, defaults.loss, defaults.optimizer, defaults.scheduler

    class Captured(BaseDataset):
        def __init__(self):
            super().__init__(max_len=defaults.data.total_seq_len, hidden_states_dtype=torch.float32)

        def _compute_approx_lengths(self):
            return [len(s["input_ids"]) for s in ctx.samples]

        def __len__(self):
            return len(ctx.samples)

        def _get_raw_data(self, index):
            st = sample_states(cap, index)
            s = ctx.samples[index]
            return {"hidden_states": st["aux"], "input_ids": s["input_ids"], "verifier_last_hidden_states": st["pre"],
                    "loss_mask": s["loss_mask"]}

    layer_cfg = create_transformer_layer_config(
        verifier_name_or_path=ctx.target_dir, num_layers=d.num_layers or 1, draft_arch=d.draft_arch or "llama",
        hidden_act=d.draft_hidden_act, sliding_window=d.sliding_window, full_attention_indices=[0],
        mrope_full_head_hack=d.draft_mrope_full_head_hack)
    torch.manual_seed(defaults.seed if hasattr(defaults, "seed") else 0)
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer_cfg, t2d=ctx.drafter.t2d.clone(), d2t=ctx.drafter.d2t.clone(),
        draft_vocab_size=ctx.drafter.lm_head.out_features, norm_before_residual=d.norm_before_residual,
        norm_before_fc=d.norm_before_fc, fc_norm=d.fc_norm, norm_output=d.norm_output,
        embed_requires_grad=d.embed_requires_grad, target_layer_ids=ctx.aux, ttt_steps=loss.ttt_steps,
        verifier_name_or_path=ctx.target_dir, draft_attn_impl="sdpa")
    loader = _setup_dataloader(Captured(), defaults.data.total_seq_len, ctx.target.hidden_size, num_workers=0,
                               num_target_layers=len(ctx.aux), prefetch_factor=None, preprocess=shift_batch, seed=0)
    train_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(loss_fn=loss.loss_fn or "kl_div", loss_implementation="eager",
                                                          ttt_steps=loss.ttt_steps, ttt_step_loss_decay=loss.ttt_step_loss_decay)
    config = spec_trainer.TrainerConfig(
        lr=opt.lr, num_epochs=ctx.epochs, save_path=str(out / "checkpoints"), resume_from_checkpoint=True,
        train_call_kwargs=train_kwargs, optimizer=opt.optimizer, weight_decay=opt.weight_decay,
        muon_lr=opt.muon_lr or opt.lr, muon_momentum=opt.muon_momentum, muon_weight_decay=opt.muon_weight_decay,
        muon_ns_steps=opt.muon_ns_steps, muon_adjust_lr_fn=opt.muon_adjust_lr_fn, scheduler_type=sch.scheduler_type,
        scheduler_warmup_steps=sch.scheduler_warmup_steps, scheduler_warmup_ratio=sch.scheduler_warmup_ratio,
        scheduler_total_steps=sch.scheduler_total_steps, scheduler_num_cosine_cycles=sch.scheduler_num_cosine_cycles,
        checkpoint_freq=1, hidden_states_dtype=torch.float32, log_freq=1)

    accs: list[float] = []

    class Keep(logging.Handler):  # its per-step metrics, as its metric logger emits them
        def emit(self, record):
            m = record.msg.get("train") if isinstance(record.msg, dict) else None
            if m and "full_acc_0" in m:
                accs.append(m["full_acc_0"])

    metrics_log = logging.getLogger("speculators.metrics")
    metrics_log.setLevel(logging.INFO)  # its CLI's setup_metric_logger does this
    metrics_log.addHandler(Keep())
    t0 = time.perf_counter()
    trainer = spec_trainer.Trainer(model, config, loader)
    trainer.run_training()
    last = accs[-10:]
    return {"checkpoint": str(out / "checkpoints" / str(ctx.epochs - 1)), "wall_s": time.perf_counter() - t0,
            "steps": trainer.global_step, "epochs": ctx.epochs, "packed_rows_per_epoch": len(loader),
            "train_metric": f"full_acc_0 (last {len(last)} steps) {sum(last) / len(last):.3f}" if last else "-"}


# ------------------------------------------------------------------------------ SpecForge
def train_specforge(ctx: Context, out: Path, cap: dict) -> dict:
    import specforge.algorithms.eagle3.model as sf_model
    import torch._dynamo
    from safetensors.torch import load_file, save_file
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.config.schema import TrainingConfig
    from specforge.core.loss import _compute_loss
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.optimizer import BF16Optimizer
    from transformers import LlamaConfig

    from draftlab import atomic
    from draftlab.export.formats import ExportOptions, import_format

    torch._dynamo.config.disable = True  # its compiled helpers run eagerly on this CPU

    class TorchLogSoftmaxLoss:  # the pure-torch reference of its Triton kernel (core/loss.py)
        apply = staticmethod(lambda logits, target_p, position_mask: _compute_loss(logits, target_p, position_mask))

    sf_model.LogSoftmaxLoss = TorchLogSoftmaxLoss
    defaults = TrainingConfig()
    fmt = import_format("sglang")
    config = LlamaConfig(**fmt.export_config(ctx.drafter, ctx.target, {}, ExportOptions(speculative_tokens=3)))
    torch.manual_seed(0)
    draft = LlamaForCausalLMEagle3(config, attention_backend="sdpa").float()
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(ctx.target.embed_tokens.weight)
        draft.t2d.copy_(ctx.drafter.t2d)
        draft.d2t.copy_(ctx.drafter.d2t)
    draft.freeze_embedding()
    model = OnlineEagle3Model(draft, length=defaults.ttt_length, attention_backend="sdpa")
    lm_head = ctx.target.lm_head.weight.detach().float()
    n = len(ctx.samples)
    total = ctx.epochs * n
    opt = BF16Optimizer(draft, lr=defaults.learning_rate, max_grad_norm=defaults.max_grad_norm, total_steps=total,
                        warmup_ratio=defaults.warmup_ratio, lr_scheduler=defaults.lr_scheduler)
    ckpts = out / "checkpoints"
    done = sorted(int(p.name.split("-")[1]) for p in ckpts.glob("epoch-*") if (p / "done").is_file()) if ckpts.is_dir() else []
    start = done[-1] + 1 if done else 0
    if start:
        state = ckpts / f"epoch-{start - 1}"
        draft.load_state_dict({**draft.state_dict(), **load_file(state / "model.safetensors")})
        opt.load_state_dict(torch.load(state / "optimizer.pt", weights_only=True))
    accs: list[float] = []
    t0 = time.perf_counter()
    for epoch in range(start, ctx.epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch)).tolist()
        for step, i in enumerate(order):
            s, st = ctx.samples[i], sample_states(cap, i)
            ids, mask = s["input_ids"][None], s["loss_mask"][None].long()
            # its offline path: TargetHead.preprocess shifts ids and the stored state left by one
            input_ids, target_h, loss_mask = _preprocess(ids, st["post"][None], mask)
            target = target_h @ lm_head.T  # its TargetHead's fc: the target's lm_head
            plosses, _, acces, *_ = model(input_ids=input_ids, attention_mask=torch.ones_like(ids), target=target,
                                          loss_mask=loss_mask, hidden_states=st["aux"][None])
            loss = sum(0.8**j * p for j, p in enumerate(plosses))  # its Eagle3TrainStrategy's step weights
            loss.backward()
            opt.step()
            accs.append(float(acces[0]))
            if (step + 1) % 50 == 0:
                print(f"specforge: epoch {epoch + 1}/{ctx.epochs} step {step + 1}/{n} loss {loss.item():.3f} "
                      f"acc0 {sum(accs[-50:]) / 50:.3f} {time.perf_counter() - t0:.0f} s", flush=True)
        state = ckpts / f"epoch-{epoch}"
        with atomic.directory(state) as tmp:
            save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, str(tmp / "model.safetensors"))
            torch.save(opt.state_dict(), tmp / "optimizer.pt")
            (tmp / "done").write_text("")
    served = out / "served"
    if not served.is_dir():
        with atomic.directory(served) as tmp:  # the SGLang layout, saved as SpecForge saves it (no frozen embedding)
            draft.save_pretrained(tmp, state_dict={k: v for k, v in draft.state_dict().items() if "embed" not in k})
    last = accs[-10:]
    return {"checkpoint": str(served), "wall_s": time.perf_counter() - t0, "steps": total, "epochs": ctx.epochs,
            "train_metric": f"acces[0] (last {len(last)} steps) {sum(last) / len(last):.3f}" if last else "-"}


def _preprocess(input_ids, target, loss_mask):
    """SpecForge's ``TargetHead.preprocess`` (it reads nothing of the head itself)."""
    from specforge.modeling.target.target_head import TargetHead

    return TargetHead.preprocess(None, input_ids, target, loss_mask)


# ------------------------------------------------------------------------------ stages
def stage(out: Path, name: str, fn):
    """Run ``fn`` once: its result is kept in ``out/name.json`` and returned on later runs."""
    path = out / f"{name}.json"
    if path.is_file():
        return json.loads(path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    result = fn()
    write_json(path, result)
    return result


def import_arm(ctx: Context, system: str, trained: dict, out: Path) -> str:
    if system == "draftlab":
        return trained["checkpoint"]
    from draftlab.export.importer import import_checkpoint

    dest = out / "imported"
    if not dest.is_dir():
        import_checkpoint(trained["checkpoint"], IMPORT_FORMAT[system], dest, target=ctx.target)
    return str(dest)


def eval_arm(recipe_path: str, target: str, checkpoint: str, out: Path, args) -> dict:
    """``draftlab eval`` of ``checkpoint`` on the recipe's held-out ShareGPT prompts at chain
    ``args.k`` (plain decoding beside it), once: the report is kept in ``out``."""
    report = out / f"eval-k{args.k}-n{args.num_prompts}.json"
    if not report.is_file():
        cmd = [sys.executable, "-m", "draftlab.cli", "eval", "--drafter", checkpoint, "--data", "sharegpt-heldout",
               "--recipe", recipe_path, "--target", target, "--method", "chain",
               "--k", str(args.k), "--num-prompts", str(args.num_prompts),
               "--max-new-tokens", str(args.max_new_tokens), "--report", str(report)]
        subprocess.run(cmd, check=True, cwd=REPO)
    return json.loads(report.read_text())


# ------------------------------------------------------------------------------ table
def table(stats: dict, trained: dict, k: int, base: str = "draftlab") -> str:
    head = ["arm", *[f"α{j}" for j in range(1, k + 1)], "τ", f"τ − {base}'s (paired)", "greedy match",
            "its own training metric", "training wall"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s, st in stats.items():
        cells = [s] + [pm(st["alpha"][j], st["se"][j]) for j in range(k)]
        cells.append(f"{st['tau']:.3f} ± {st['se'][k]:.3f}")
        cells.append("–" if s == base else f"{st['diff'][k]:+.3f} ± {st['diff_se'][k]:.3f} ({st['better']} better, {st['worse']} worse)")
        cells.append(f"{st['matched']}/{st['prompts']}")
        cells.append(trained[s]["train_metric"])
        cells.append(f"{trained[s]['wall_s'] / 60:.1f} min" if trained[s].get("wall_s") else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ main
def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.trainer_parity", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/parity")
    p.add_argument("--recipe", default="recipes/smollm2-135m-eagle3.yaml")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--stage", choices=("all", "train"), default="all", help="train: stop after the training stages")
    p.add_argument("--no-append", action="store_true", help="print the table; leave BENCHMARKS.md as it is")
    p.add_argument("overrides", nargs="*", help="recipe overrides (dotted.key=value), for every arm")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad or not args.systems:
        p.error(f"--systems: unknown {bad} (choose from {', '.join(SYSTEMS)})")
    if "draftlab" not in args.systems and args.stage != "train":
        p.error("--systems: draftlab is the arm every other is paired with (or --stage train)")
    if args.num_prompts < 2 or args.k < 1 or args.max_new_tokens < 1:
        p.error("--num-prompts must be >= 2, --k and --max-new-tokens >= 1")
    return args


def check_peers(systems) -> None:
    from importlib.metadata import PackageNotFoundError, version

    for s in systems:
        if s in PEERS:
            pkg, want = PEERS[s]
            try:
                have = version(pkg)
            except PackageNotFoundError:
                raise DraftlabError(f"--systems {s}: the {pkg} package is not installed "
                                    f"(pip install --no-deps {pkg}=={want}, as scripts/install.sh test does)") from None
            if have != want:
                raise DraftlabError(f"--systems {s}: {pkg} {have} is installed; this bench drives {pkg} {want}'s code")


def run(argv, args) -> int:
    check_peers(args.systems)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = datetime.now(timezone.utc)
    out = Path(args.out)
    ctx = Context(args.recipe, args.overrides, out)
    check_out_dir(ctx)
    print(f"{len(ctx.samples)} training samples, {ctx.tokens} tokens, {ctx.epochs} epochs; aux layers {ctx.aux}, "
          f"draft vocab {ctx.drafter.lm_head.out_features}", flush=True)
    cap = None
    trained, reports = {}, {}
    for s in args.systems:
        arm = out / s
        if s == "draftlab":
            trained[s] = stage(arm, "trained", lambda: train_draftlab(ctx.recipe_path, ctx.overrides, arm))
        else:
            if cap is None and not (arm / "trained.json").is_file():
                cap = ctx.capture()
            fn = train_speculators if s == "speculators" else train_specforge
            trained[s] = stage(arm, "trained", lambda: fn(ctx, arm, cap))
        print(f"{s}: trained, {trained[s]['train_metric']}, {trained[s]['wall_s'] / 60:.1f} min", flush=True)
    if args.stage == "train":
        return 0
    for s in args.systems:
        reports[s] = eval_arm(ctx.recipe_path, ctx.recipe.target.model, import_arm(ctx, s, trained[s], out / s), out / s, args)
    stats = bootstrap(reports, args.k, base="draftlab")
    text = table(stats, trained, args.k)
    print(text)
    write_json(out / f"parity-k{args.k}-n{args.num_prompts}.json", {"stats": stats, "trained": trained})
    if not args.no_append:
        from bench.sections import append_run

        append_run("Trainer parity: EAGLE-3 at equal data", started, "bench.trainer_parity", argv,
                   f"{len(ctx.samples)} training conversations ({ctx.tokens} tokens) × {ctx.epochs} epochs; "
                   f"{args.num_prompts} held-out ShareGPT prompts × {args.max_new_tokens} tokens, chain k={args.k}, greedy; "
                   f"± one bootstrap s.e. over prompts.\n\n{text}\n")
    return 0


def check_out_dir(ctx: Context) -> None:
    """``--out`` holds the stages of one recipe, epochs and target: a rerun resumes them, anything
    else is refused (a capture or checkpoint of another target must not be reused)."""
    setup = {"recipe": ctx.recipe.fingerprint(), "epochs": ctx.epochs, "target": ctx.target.identity}
    path = ctx.out / "setup.json"
    if path.is_file():
        old = json.loads(path.read_text())
        if old != json.loads(json.dumps(setup)):
            what = ", ".join(k for k in setup if old.get(k) != json.loads(json.dumps(setup[k])))
            raise DraftlabError(f"--out {ctx.out}: made for another recipe, epochs or target ({what} differs); use a new --out")
        return
    ctx.out.mkdir(parents=True, exist_ok=True)
    write_json(path, setup)


def main(argv=None) -> int:
    from bench.runs import main_with_errors

    return main_with_errors("bench.trainer_parity", parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
