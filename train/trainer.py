"""The one training loop, shared by every drafter family.

Accelerate handles devices and processes (single process, DDP, FSDP, DeepSpeed ZeRO). The loop:
batches of packed-by-length samples -> target features (``data.features``: online, cached in RAM,
or offline shards) -> ``drafter(batch, hidden, loss_cfg)`` -> backward with accumulation, clipping,
AdamW, warmup + cosine -> metrics (JSONL always; TensorBoard / wandb when asked) ->
checkpoints every N steps (atomic, keep-last-K + best) -> acceptance evaluation hook.

Determinism: the data order is a pure function of (seed, epoch), the data position is a pure
function of the optimizer step, and RNG states are checkpointed per rank, so a killed run
relaunched with the same command ends with the same weights as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import math
import shutil
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
        self.drafter = drafter
        self.step = 0
        self.elapsed = 0.0  # training seconds over all resumed runs
        self.best_tau = None

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
                         "fingerprint": self.recipe.fingerprint(), "best_tau": self.best_tau, "precision": self.precision["train"]},
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
        """Staging directories of a run killed while writing a checkpoint (never read)."""
        d = self.run_dir / "checkpoints"
        if self.accelerator.is_main_process and d.is_dir():
            for p in list(d.glob(".staging-*")) + list(d.glob(".tmp-*")):
                shutil.rmtree(p, ignore_errors=True)

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
        stream = self.micro_batches(self.step)
        last_metrics: dict = {}
        started = time.perf_counter() - self.elapsed
        out_of_time = False
        startup_s = _process_age()  # process start to this process's first step: logged with that step
        self.model.train()
        try:  # the bar ends its line whatever happens: an error then starts a line of its own
            while self.step < self.total_steps and not out_of_time:
                t0 = time.perf_counter()
                tokens = 0
                agg: dict = {}
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
                    _accumulate(agg, {"loss": loss.item(), **metrics}, t.grad_accum)
                grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), t.clip_grad_norm)
                self.opt.step()
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
                if self.step % t.log_every == 0 or self.step == self.total_steps or startup_s is not None:
                    with failures.caught():
                        logger.log(last_metrics)
                    failures.raise_if_any()
                startup_s = None
                acc = agg.get("acc", [])
                bar.set_postfix(loss=f"{agg['loss']:.3f}", acc=" ".join(f"{a:.2f}" for a in acc[:4]), tok_s=f"{tok_s:.0f}")
                bar.update(1)
                # out of time on the last step is no stop: the run is complete
                out_of_time = self.step < self.total_steps and bool(t.time_limit_minutes) and self.elapsed >= t.time_limit_minutes * 60
                if self.step % t.checkpoint_every == 0 or self.step == self.total_steps or out_of_time:
                    self.checkpoint_and_eval(last_metrics, logger)
        finally:
            bar.close()
        if self.world > 1 and self.opt_state.replicated:  # FSDP / ZeRO-3 keep only a shard of each weight per rank
            last_metrics["weights_in_sync"] = self.check_weights_in_sync()
        with failures.caught():
            if "weights_in_sync" in last_metrics:
                logger.log({"step": self.step, "weights_in_sync": last_metrics["weights_in_sync"]})
            logger.close()
        failures.raise_if_any()
        if main and out_of_time:
            print(f"stopped at step {self.step}/{self.total_steps} after {self.elapsed / 60:.1f} min (train.time_limit_minutes); "
                  "relaunch the same command to continue", flush=True)
        elif main:
            print(f"training complete: step {self.step}/{self.total_steps} after {self.elapsed / 60:.1f} min", flush=True)
        return last_metrics

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
