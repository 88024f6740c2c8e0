"""The one training loop, shared by every drafter family.

Accelerate handles devices and processes (single process, DDP, FSDP, DeepSpeed ZeRO). The loop:
batches of packed-by-length samples -> target features (``data.features``: online, cached in RAM,
or offline shards) -> ``drafter(batch, hidden, loss_cfg)`` -> backward with accumulation, clipping,
AdamW, warmup + cosine -> metrics (JSONL always; TensorBoard / wandb when asked) ->
checkpoints every N steps (atomic, keep-last-K + best) -> acceptance evaluation hook.

Faults: before each optimizer step every rank agrees, in one small all-reduce, whether any rank's
loss or gradient norm is non-finite (the run stops there, or skips up to ``train.skip_nonfinite``
such steps) and whether any rank was signalled to stop (``train/preemption.py``: checkpoint, exit).

Determinism: the data order is a pure function of (seed, epoch), the data position is a pure
function of the optimizer step, and RNG states are checkpointed per rank, so a killed run
relaunched with the same command ends with the same weights as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import math
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftlab import atomic
from draftlab import checkpoint as ckpt
from draftlab.atomic import publish, write_json
from draftlab.data.dataset import batches_by_tokens, collate, pad_id
from draftlab.errors import DraftlabError
from draftlab.train import backends, hooks, optimizer_state, rng
from draftlab.train.metrics_log import MetricLogger
from draftlab.train.preemption import EXIT_PREEMPTED, Preemption
from draftlab.train.rank_failures import RankFailures


def lr_lambda(warmup: int, total: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


class Trainer:
    def __init__(self, recipe, accelerator, target, drafter, loss_cfg, train_samples, feature_source, evaluate=None):
        """``feature_source`` (a :class:`draftlab.data.features.FeatureSource`) gives each
        micro-batch's target hidden states and derived targets; ``evaluate(checkpoint_dir) ->
        dict | None`` runs after each checkpoint on the main process (acceptance report)."""
        self.recipe, self.accelerator, self.target = recipe, accelerator, target
        self.loss_cfg = loss_cfg
        self.samples = train_samples
        self.feature_source = feature_source
        self.evaluate = evaluate
        self.run_dir = Path(recipe.output_dir)
        self.world = accelerator.num_processes
        self.rank = accelerator.process_index
        self.pad_id = pad_id(target.tokenizer)

        t = recipe.train
        self.batches_per_epoch = len(self._epoch_batches(0)) // self.world
        steps_per_epoch = self.batches_per_epoch // t.grad_accum
        if steps_per_epoch < 1:
            raise DraftlabError(
                f"data: {len(train_samples)} samples make {self.batches_per_epoch} micro-batches per process, "
                f"fewer than train.grad_accum={t.grad_accum}: use more data or smaller train.batch_tokens"
            )
        self.total_steps = t.max_steps or max(1, int(t.epochs * steps_per_epoch))
        params = [p for p in drafter.parameters() if p.requires_grad]
        # fused AdamW: one kernel per step instead of a dozen elementwise passes per tensor
        opt = torch.optim.AdamW(params, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, fused=True)
        # Stepped once per optimizer step by the loop below. Not handed to accelerate.prepare: its wrapper
        # steps a scheduler once per *process* each step (it assumes per-process batches shrink with the
        # world size), which would run the warmup + cosine schedule world-size times too fast under DDP.
        self.sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(t.warmup_steps, self.total_steps, t.min_lr_ratio))
        self.model, self.opt = backends.prepare(accelerator, t, drafter, opt)
        self.precision = backends.precision(accelerator, t)
        self.opt_state = optimizer_state.for_run(accelerator, self.model, self.opt, self.sched)
        self.rewrites = drafter.rewrites_batches(loss_cfg)
        if self.rewrites and not self.opt_state.replicated:
            # each rank would generate a different number of steps, each gathering sharded weights: a hang
            raise DraftlabError(f"{self.rewrites}: the drafter generates with its whole weights, which FSDP and ZeRO-3 shard: use DDP or ZeRO-1/2")
        if t.skip_nonfinite and self.opt_state.layout.startswith("zero"):
            raise DraftlabError("train.skip_nonfinite: DeepSpeed steps its optimizer inside backward, before a step can be "
                                "skipped: use DDP or FSDP, or train.skip_nonfinite=0")
        self.drafter = drafter
        self.step = 0
        self.elapsed = 0.0  # training seconds over all resumed runs
        self.best_tau = None
        self.skipped = 0  # non-finite steps skipped over all resumed runs (train.skip_nonfinite)
        self.preemption = Preemption()
        self.preempted_by: str | None = None  # the signal that stopped this run, once it has

    # ------------------------------------------------------------------ data
    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        return batches_by_tokens(self.samples, self.recipe.train.batch_tokens, self.recipe.seed, epoch)

    def micro_batches(self, start_step: int):
        """Yield (epoch, indices) for this rank, from the micro-batch after ``start_step`` steps."""
        per_step = self.recipe.train.grad_accum
        pos = start_step * per_step  # this rank's micro-batch position, a pure function of the step
        epoch, idx = divmod(pos, self.batches_per_epoch)
        while True:
            batches = self._epoch_batches(epoch)
            mine = batches[self.rank :: self.world][: self.batches_per_epoch]
            for b in mine[idx:]:
                yield epoch, b
            epoch, idx = epoch + 1, 0

    def micro_batch_seed(self, m: int) -> int:
        """A seed of the recipe's seed, the step, micro-batch ``m`` of it and the rank alone."""
        t = self.recipe.train
        return ((self.recipe.seed * 1_000_003 + self.step) * t.grad_accum + m) * self.world + self.rank

    # ------------------------------------------------------------------ checkpoints
    def save(self, metrics: dict) -> Path:
        """All ranks call this; rank files first, then the main process publishes atomically. A write
        that fails (full disk, unwritable directory), on any rank, removes the staging directory and is
        a one-line DraftlabError on every rank (none is left waiting for the others): the checkpoints
        already published stay as they were."""
        final = ckpt.step_dir(self.run_dir, self.step)
        staging = self.run_dir / "checkpoints" / f".staging-{self.step:07d}"
        trainer_dir = staging / "trainer"
        main = self.accelerator.is_main_process
        failures = RankFailures(self.accelerator)
        try:
            with failures.caught():
                if main:
                    shutil.rmtree(staging, ignore_errors=True)
                    atomic.make_dir(trainer_dir)
            failures.raise_if_any()
            with failures.caught():
                write_json(trainer_dir / f"rng-rank{self.rank}.json", rng.get_state())
            # Every rank joins the gathers (FSDP / ZeRO-3 shard the weights), whatever failed before;
            # the main process writes.
            weights = self.accelerator.get_state_dict(self.model)
            with failures.caught():
                if main:  # the step check keeps them finite; this guards what it cannot see (DeepSpeed steps in backward)
                    _refuse_nonfinite(weights, self.step)
                self.opt_state.save(trainer_dir)
            failures.raise_if_any()
            with failures.caught():
                if main:
                    drafter = self.accelerator.unwrap_model(self.model)
                    meta = ckpt.checkpoint_meta(drafter, self.target.identity, self.recipe.model_dump(mode="json"), self.step, metrics,
                                                precision=self.precision)
                    ckpt.save_weights(staging, weights, meta)
                    write_json(
                        trainer_dir / ckpt.STATE,
                        {"step": self.step, "elapsed_s": self.elapsed, "world_size": self.world, "optimizer_layout": self.opt_state.layout,
                         "fingerprint": self.recipe.fingerprint(), "best_tau": self.best_tau, "precision": self.precision["train"],
                         "skipped_nonfinite": self.skipped},
                    )
                    publish(staging, final)
            failures.raise_if_any()
        except BaseException as e:
            if main:
                shutil.rmtree(staging, ignore_errors=True)
            if isinstance(e, OSError):  # a write outside draftlab.atomic (which says one line itself)
                raise DraftlabError(f"{final}: cannot write the checkpoint ({atomic.reason(e)})") from None
            if isinstance(e, DraftlabError):
                raise atomic.naming(e, staging, final) from None
            raise
        return final

    def clean_leftovers(self) -> None:
        """Staging directories of a run killed while writing a checkpoint (never read), and the
        previous ``best`` of one killed between the two renames that replace it (put back)."""
        d = self.run_dir / "checkpoints"
        if self.accelerator.is_main_process and d.is_dir():
            for p in list(d.glob(".staging-*")) + list(d.glob(".tmp-*")):
                shutil.rmtree(p, ignore_errors=True)
            for old in d.glob(".old-*"):
                atomic.restore_replaced(old)

    def resume(self) -> None:
        """Continue from the last checkpoint in ``output_dir``. Everything read back is checked
        first: a damaged or foreign file is a one-line DraftlabError naming it."""
        found = ckpt.list_checkpoints(self.run_dir)
        if not found:
            return
        last = found[-1]
        state_file = last / "trainer" / ckpt.STATE
        if not state_file.is_file():
            raise DraftlabError(f"{last}: checkpoint has no trainer state (cannot resume); use a new output_dir")
        state = ckpt.read_state(state_file)
        dir_step = _dir_step(last)
        if dir_step is not None and state["step"] != dir_step:
            raise DraftlabError(f"{state_file}: step {state['step']} does not match its checkpoint directory {last.name}")
        if state["fingerprint"] != self.recipe.fingerprint():
            raise DraftlabError(
                f"output_dir {self.run_dir} holds a run of a different recipe ({state_file}: fingerprint "
                f"{state['fingerprint']!r}); use a new output_dir or the same recipe"
            )
        # bf16 and fp32 steps round differently: resuming in the other would not end where the run would have
        if state.get("precision", self.precision["train"]) != self.precision["train"]:
            raise DraftlabError(
                f"{state_file}: trained with precision {state['precision']}, this run resolves train.precision="
                f"{self.recipe.train.precision} to {self.precision['train']}; set train.precision={state['precision']} or use a new output_dir"
            )
        drafter, _ = ckpt.load_drafter(last, self.target, dtype=torch.float32)
        self.opt_state.load(last / "trainer", drafter.state_dict(), state)
        if state["world_size"] == self.world:  # the same ranks draw on from where they were
            rng_file = last / "trainer" / f"rng-rank{self.rank}.json"
            rng.set_state(ckpt.read_json(rng_file), rng_file)
        self.step, self.elapsed, self.best_tau = state["step"], float(state["elapsed_s"]), state.get("best_tau")
        self.skipped = state.get("skipped_nonfinite", 0)
        if self.accelerator.is_main_process:
            print(f"resumed from {last} (step {self.step})", flush=True)

    def prune(self) -> None:
        """Keep the last ``keep_last`` checkpoints plus the best by acceptance (tau)."""
        if not self.accelerator.is_main_process:
            return
        found = ckpt.list_checkpoints(self.run_dir)
        for p in found[: -self.recipe.train.keep_last]:
            shutil.rmtree(p, ignore_errors=True)

    def mark_best(self, path: Path, tau: float | None) -> None:
        if tau is None or (self.best_tau is not None and tau <= self.best_tau):
            return
        with atomic.directory(self.run_dir / "checkpoints" / "best") as tmp:
            for f in sorted(path.rglob("*")):
                if f.is_file():
                    atomic.copy_file(f, tmp / f.relative_to(path))
        self.best_tau = tau

    # ------------------------------------------------------------------ loop
    def run(self) -> dict:
        t = self.recipe.train
        atomic.writable_dir(self.run_dir, "output_dir")
        # each rank reads its own RNG file; the main process alone creates the loggers' files
        failures = RankFailures(self.accelerator)
        with failures.caught():
            self.resume()
        failures.raise_if_any()
        self.clean_leftovers()
        main = self.accelerator.is_main_process
        if main:
            owned = backends.owned_weight_fraction(self.model)
            print(f"distributed: {backends.describe(self.accelerator)}, world size {self.world}, "
                  f"rank 0 owns {owned:.0%} of the drafter weights", flush=True)
            print(f"precision: {self.precision['train']}{' (fp32 master weights)' if self.precision['train'] == 'bf16' else ''}, "
                  f"TF32 matmuls {'on' if self.precision['tf32'] else 'off'}", flush=True)
        logger = None
        with failures.caught():
            logger = MetricLogger(self.run_dir, self.recipe, main)
        failures.raise_if_any()
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not main, desc=f"train {self.recipe.algorithm}", dynamic_ncols=True)
        startup_s = _process_age()  # process start to this process's first step: logged with that step
        self.model.train()
        try:  # the bar ends its line whatever happens: an error then starts a line of its own
            with self.preemption.installed(t.preempt_signals):
                last_metrics, out_of_time = self._steps(bar, logger, startup_s)
        finally:
            bar.close()
        if self.world > 1 and self.opt_state.replicated:  # FSDP / ZeRO-3 keep only a shard of each weight per rank
            last_metrics["weights_in_sync"] = self.check_weights_in_sync()
        with failures.caught():
            if "weights_in_sync" in last_metrics:
                logger.log({"step": self.step, "weights_in_sync": last_metrics["weights_in_sync"]})
            logger.close()
        failures.raise_if_any()
        if self.preempted_by:
            last_metrics["preempted_by"] = self.preempted_by
        if main and self.preempted_by:
            print(f"preempted by {self.preempted_by} at step {self.step}/{self.total_steps}: checkpoint "
                  f"{ckpt.step_dir(self.run_dir, self.step)} written; relaunch the same command to resume (exit status "
                  f"{EXIT_PREEMPTED})", file=sys.stderr, flush=True)
        elif main and out_of_time:
            print(f"stopped at step {self.step}/{self.total_steps} after {self.elapsed / 60:.1f} min (train.time_limit_minutes "
                  "of this launch); relaunch the same command to continue", flush=True)
        elif main:
            print(f"training complete: step {self.step}/{self.total_steps} after {self.elapsed / 60:.1f} min", flush=True)
        return last_metrics

    def _steps(self, bar, logger: MetricLogger, startup_s: float | None) -> tuple[dict, bool]:
        """Optimizer steps until the last, a preemption or the time limit: (the last step's
        metrics, whether out of time)."""
        t = self.recipe.train
        failures = RankFailures(self.accelerator)
        stream = self.micro_batches(self.step)
        last_metrics: dict = {}
        started = time.perf_counter() - self.elapsed
        launch_start = self.elapsed  # the limit is per launch: a relaunch after a stop trains as long again
        out_of_time = False
        while self.step < self.total_steps and not out_of_time:
            t0 = time.perf_counter()
            self.drafter.set_progress(self.step, self.total_steps)  # a loss with a schedule over training reads it
            tokens = 0
            agg: dict = {}
            bad_loss = None  # this rank's first non-finite micro-batch loss: (value, its samples)
            for m in range(t.grad_accum):
                epoch, indices = next(stream)
                batch = collate([self.samples[i] for i in indices], self.pad_id)
                batch = {k: v.to(self.target.device) for k, v in batch.items()}
                if self.rewrites:
                    batch = self.drafter.rewrite_batch(batch, self.loss_cfg, self.micro_batch_seed(m))
                hidden, batch = self.feature_source.features(indices, batch)
                # syncs (DDP) / steps (DeepSpeed) on the last micro-batch; backward scales the loss by 1/grad_accum
                with self.accelerator.accumulate(self.model):
                    loss, metrics = self.model(batch, hidden, self.loss_cfg)
                    self.accelerator.backward(loss)
                tokens += int(batch["attention_mask"].sum())
                value = loss.item()
                if bad_loss is None and not math.isfinite(value):
                    bad_loss = (value, indices)
                _accumulate(agg, {"loss": value, **metrics}, t.grad_accum)
            grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), t.clip_grad_norm)
            nonfinite, signalled = self.check_step(bad_loss, grad_norm)
            if nonfinite is None:
                self.opt.step()
            else:
                self.skip_or_stop(nonfinite, bar)
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1
            dt = time.perf_counter() - t0
            self.elapsed = time.perf_counter() - started
            if self.world > 1:  # log the loss of the global batch, not rank 0's share
                agg["loss"] = self.accelerator.reduce(torch.tensor(agg["loss"], device=self.accelerator.device), "mean").item()
                tokens = int(self.accelerator.reduce(torch.tensor(tokens, device=self.accelerator.device), "sum").item())
            tok_s = tokens / dt
            last_metrics = {
                "step": self.step,
                "epoch": epoch,
                **agg,
                "lr": self.sched.get_last_lr()[0],
                "grad_norm": float(grad_norm),
                "tokens": tokens,
                "tokens_per_s": tok_s,
                "step_s": dt,
                "elapsed_s": self.elapsed,
                **({"startup_s": startup_s} if startup_s is not None else {}),
            }
            if nonfinite is not None:  # a skipped step's record says why, without the non-finite numbers
                last_metrics = {k: v for k, v in last_metrics.items() if not (isinstance(v, float) and not math.isfinite(v))}
                last_metrics["skipped_nonfinite"] = nonfinite
            for hook in hooks.after_step:
                hook(self)
            if self.step % t.log_every == 0 or self.step == self.total_steps or startup_s is not None or nonfinite is not None:
                with failures.caught():
                    logger.log(last_metrics)
                failures.raise_if_any()
            startup_s = None
            acc = agg.get("acc", [])
            bar.set_postfix(loss=f"{agg['loss']:.3f}", acc=" ".join(f"{a:.2f}" for a in acc[:4]), tok_s=f"{tok_s:.0f}")
            bar.update(1)
            if signalled:  # every rank knows: any rank's signal counted in the step check
                # a checkpoint and nothing more (no evaluation): the scheduler's grace period is short
                self.save(last_metrics)
                self.prune()
                if self.step < self.total_steps:
                    self.preempted_by = self.preemption.signal
                break
            # out of time on the last step is no stop: the run is complete
            out_of_time = (self.step < self.total_steps and bool(t.time_limit_minutes)
                           and self.elapsed - launch_start >= t.time_limit_minutes * 60)
            if self.step % t.checkpoint_every == 0 or self.step == self.total_steps or out_of_time:
                self.checkpoint_and_eval(last_metrics, logger)
        return last_metrics, out_of_time

    def check_step(self, bad_loss: tuple[float, list[int]] | None, grad_norm) -> tuple[str | None, bool]:
        """Every rank, before each optimizer step: (what is non-finite in this step on any rank, or
        None; whether any rank was signalled to stop). One all-reduce of two numbers; the details
        are gathered only for a bad step."""
        bad_norm = grad_norm is not None and not math.isfinite(float(grad_norm))
        flags = torch.tensor([float(bad_loss is not None or bad_norm), float(self.preemption.signal is not None)],
                             device=self.accelerator.device)
        if self.world > 1:
            flags = self.accelerator.reduce(flags, "sum")
        signalled = bool(flags[1] > 0)
        if signalled and self.world > 1:  # once per run: which signal, to which process
            from accelerate.utils import gather_object

            got = [(r, name) for r, name in enumerate(gather_object([self.preemption.signal])) if name]
            if got and self.preemption.signal is None:
                self.preemption.signal = f"{got[0][1]} (to process {got[0][0]})"
        if not flags[0] > 0:
            return None, signalled
        mine = None
        if bad_loss is not None:
            value, samples = bad_loss
            few = ", ".join(map(str, samples[:8])) + (", ..." if len(samples) > 8 else "")
            mine = f"loss ({value}) on process {self.rank}, micro-batch of training samples [{few}]"
        if self.world > 1:
            from accelerate.utils import gather_object

            everyone = gather_object([mine])
        else:
            everyone = [mine]
        # the gradient norm is of the whole (all-reduced) gradient: the same on every rank
        parts = [x for x in everyone if x] + ([f"gradient norm ({float(grad_norm)})"] if bad_norm else [])
        return "; ".join(parts), signalled

    def skip_or_stop(self, nonfinite: str, bar) -> None:
        """A step whose loss or gradient norm is not finite: skipped (its optimizer step left out)
        while ``train.skip_nonfinite`` allows, else a one-line DraftlabError on every rank. Either
        way its gradients never reach the weights, so no checkpoint or report holds them."""
        t = self.recipe.train
        step = self.step + 1
        if self.skipped < t.skip_nonfinite:
            self.skipped += 1
            if self.accelerator.is_main_process:
                bar.write(f"step {step}: non-finite {nonfinite}: step skipped ({self.skipped} of train.skip_nonfinite={t.skip_nonfinite})")
            return
        found = ckpt.list_checkpoints(self.run_dir)
        skipped = f" after {self.skipped} skipped (train.skip_nonfinite)" if t.skip_nonfinite else ""
        raise DraftlabError(
            f"step {step}: non-finite {nonfinite}{skipped}; the run stops here and no checkpoint holds this step "
            f"(last checkpoint: {found[-1].name if found else 'none'}): lower train.lr, or relaunch with "
            f"train.skip_nonfinite=N to skip up to N such steps"
        )

    def check_weights_in_sync(self) -> bool:
        """DDP / ZeRO-1,2 invariant: every rank ends with bit-identical weights (compared by digest)."""
        h = hashlib.sha256()
        for _, p in sorted(self.accelerator.unwrap_model(self.model).state_dict().items()):
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
        digest = torch.tensor(list(h.digest()[:8]), dtype=torch.long, device=self.accelerator.device)
        everyone = self.accelerator.gather(digest[None]).view(self.world, -1)
        return bool((everyone == everyone[0]).all())

    def checkpoint_and_eval(self, metrics: dict, logger: MetricLogger) -> None:
        t0 = time.perf_counter()
        path = self.save(metrics)
        checkpoint_s = time.perf_counter() - t0
        for hook in hooks.after_checkpoint:
            hook(self, path)
        if self.evaluate is not None and self.recipe.eval.enabled:
            failures = RankFailures(self.accelerator)
            with failures.caught():
                if self.accelerator.is_main_process:
                    self.model.eval()
                    t0 = time.perf_counter()
                    # a report must not move the training RNG: a resumed run restores the state saved before it
                    with torch.random.fork_rng(devices=None if torch.cuda.is_available() else []):
                        report = self.evaluate(path)
                    eval_s = time.perf_counter() - t0
                    self.model.train()
                    if report:
                        logger.log({"step": self.step, "eval_tau": report["tau"], "eval_alpha": report["alpha"], "eval_speedup": report.get("speedup"),
                                    "checkpoint_s": checkpoint_s, "eval_s": eval_s})
                        # the checkpoint's JSON carries the measured acceptance (model cards read it), best's copy too
                        meta = ckpt.read_meta(path)
                        meta["metrics"]["eval"] = {k: report[k] for k in ("tau", "a", "alpha", "speedup", "num_prompts") if k in report}
                        write_json(path / ckpt.META, meta)
                        self.mark_best(path, report["tau"])
            failures.raise_if_any()  # also the barrier: the other ranks wait for the evaluation
        self.prune()


def _refuse_nonfinite(weights: dict, step: int) -> None:
    for name, w in weights.items():
        if w.is_floating_point() and not bool(torch.isfinite(w).all()):
            raise DraftlabError(f"step {step}: drafter weight '{name}' holds NaN or infinite values: not checkpointed")


def _process_age() -> float:
    """Seconds since this process started (imports, target load, data preparation and set-up included)."""
    import psutil  # an Accelerate dependency

    return time.time() - psutil.Process().create_time()


def _dir_step(path: Path) -> int | None:
    try:
        return int(path.name.split("-")[-1])
    except ValueError:
        return None


def _accumulate(agg: dict, metrics: dict, n: int) -> None:
    for k, v in metrics.items():
        if isinstance(v, list):
            prev = agg.get(k, [0.0] * len(v))
            agg[k] = [a + b / n for a, b in zip(prev, v)]
        else:
            agg[k] = agg.get(k, 0.0) + v / n
