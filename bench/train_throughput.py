"""EAGLE-3 drafter training throughput: draftlab vs speculators' Eagle3DraftModel, as a share of the fp32 matmul peak.

    python -m bench.train_throughput [--steps 5] [--batch 1] [--threads N] [--quick] [--profile]

Configuration (the embedded target, SmolLM2-135M: hidden 576, 30 layers, vocab 49152): one
drafter layer, 1024-token sequences, 7 TTT steps, draft vocabulary 8192, fp32, AdamW.

Inputs: real ShareGPT samples (``build_samples``, max_length = seq_len), concatenated in order
and cut into full rows of seq_len tokens (packing: every timed token is real, none is padding).
The target's hidden states for all rows are captured once beforehand (target tokens/s reported
separately, not part of the drafter numbers). Both drafters start from the same weights
(draftlab's, loaded into speculators' model through the speculators export mapping) and read
the same rows and hidden states:

* draftlab: ``Eagle3Drafter`` via ``drafter(batch, hidden, Eagle3Loss(ttt_steps=7))`` on
  [batch, seq_len]. Its step includes the target's full-vocab lm_head over hidden[L] (no grad;
  ``derived_targets`` + the target's draft-vocab probabilities), as in the trainer's online and offline modes
  (``capture.mode: memory`` computes the full-vocab part once per sample).
* speculators 0.9: ``Eagle3DraftModel(..., ttt_steps=7)`` with SDPA attention (its default flex
  attention has no CPU path), its eager KL loss (the fused one is Triton/GPU-only) and the
  pre-norm last hidden state for its verifier head; rows are packed into its [1, batch*seq_len]
  layout with one document id per row, so both sides do the same attention work. Its own
  defaults freeze lm_head (``--speculators-lm-head trained`` trains it like draftlab does).

One timed step = zero_grad + forward + backward + AdamW step, on a batch not used before (warm-up
steps first). Steps of the two systems alternate (order swapped every round) so machine noise
hits both; each round also measures the fp32 matmul peak (bench/machine.py) for its share.
Reported: medians over rounds.

FLOPs per trained token (useful work only, identical for both systems; T = seq_len, S = TTT
steps, H hidden, A = 3 aux layers, h/h_kv heads of size D, I = MLP width, Vd = draft vocab):

    forward = 2*A*H*H                                       fc, once per token
            + sum_{i<S} [ 2*2H*(h*D + 2*h_kv*D)              q/k/v from the 2H fused input
                        + 2*h*D*H                            o_proj
                        + 2*3*H*I                            MLP (gate, up, down)
                        + 2*H*Vd                             lm_head over the draft vocab
                        + 4*h*D*((T+1)/2 + i) ]              QK^T and PV: causal average + i
                                                             diagonal TTT keys
    trained = 3 * forward                                   forward + backward (dX and dW)

(norms, RoPE, softmax, the loss, the optimizer and the no-grad target lm_head are not counted,
nor the masked half of the dense T x T attention both systems compute at TTT steps >= 1.)
share of peak = FLOPs/token x median tokens/s / median fp32 matmul peak of the rounds.
The command, the configuration and the table rewrite this benchmark's section of BENCHMARKS.md
(not with --quick or --no-append; the section it replaces moves to bench/HISTORY.md).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.capture import decoder_flops
from bench.machine import LoadWindow, cpu_name, load_note, measure_fp32_peak
from bench.sections import append_benchmarks

REPO = Path(__file__).resolve().parent.parent
DRAFT_VOCAB = 8192
TTT_STEPS = 7
DECAY = 0.8  # both systems weight TTT step i by DECAY**i
LR = 1e-4


# ------------------------------------------------------------------------------ FLOPs
def trained_flops_per_token(shape, num_aux: int, draft_vocab: int, seq_len: int, steps: int, num_layers: int = 1) -> float:
    """Forward + backward matmul FLOPs per trained token (formula in the module docstring)."""
    H, I, D = shape.hidden_size, shape.intermediate_size, shape.head_dim
    h, hk = shape.num_attention_heads, shape.num_key_value_heads
    fwd = 2.0 * num_aux * H * H
    for i in range(steps):
        for layer in range(num_layers):
            in_dim = 2 * H if layer == 0 else H  # the first layer reads [embedding; feature]
            fwd += 2.0 * in_dim * (h * D + 2 * hk * D) + 2.0 * h * D * H + 2.0 * 3 * H * I
            fwd += 4.0 * h * D * ((seq_len + 1) / 2 + i)
        fwd += 2.0 * H * draft_vocab
    return 3.0 * fwd


# ------------------------------------------------------------------------------ data
def packed_rows(tokenizer, rows: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` rows of ``seq_len`` real ShareGPT tokens: (input_ids, loss_mask) [rows, seq_len]."""
    from draftlab.data.dataset import DataSpec, build_samples

    need = rows * seq_len
    n = max(16, 2 * rows * seq_len // 300)  # ~300 tokens per SmolLM2-tokenised conversation
    while True:
        spec = DataSpec(source="sharegpt", num_conversations=n, max_length=seq_len, heldout=0)
        samples = build_samples(spec, tokenizer).train
        ids = torch.cat([s["input_ids"] for s in samples])
        if ids.numel() >= need or len(samples) < n:  # enough, or the source ran out
            break
        n *= 2
    if ids.numel() < need:
        raise SystemExit(f"ShareGPT has only {ids.numel()} tokens, {need} needed: lower --steps or --batch")
    mask = torch.cat([s["loss_mask"] for s in samples])
    return ids[:need].view(rows, seq_len), mask[:need].view(rows, seq_len)


def capture_rows(target, ids: torch.Tensor, layers: list[int], batch: int):
    """Target hidden states of every row, ``batch`` rows per forward: (hidden {layer: [R, T, H]},
    the pre-final-norm last hidden state [R, T, H] speculators' verifier head reads, seconds)."""
    from draftlab.data.capture import capture_batch

    pre_norm = []
    hook = target.final_norm.register_forward_pre_hook(lambda mod, args: pre_norm.append(args[0]))
    parts = []
    try:
        t0 = time.perf_counter()
        for chunk in ids.split(batch):
            parts.append(capture_batch(target, chunk, layers))
        seconds = time.perf_counter() - t0
    finally:
        hook.remove()
    hidden = {layer: torch.cat([p[layer] for p in parts]) for layer in layers}
    return hidden, torch.cat(pre_norm), seconds


# ------------------------------------------------------------------------------ systems
class DraftlabRun:
    name = "draftlab"

    def __init__(self, drafter, ids, mask, hidden, batch: int, steps: int):
        from draftlab.models.eagle import Eagle3Loss

        self.model = drafter.train()
        self.loss_cfg = Eagle3Loss(ttt_steps=steps, decay=DECAY)
        self.opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=LR)
        self.ids, self.mask, self.hidden, self.batch = ids, mask, hidden, batch

    def inputs(self, k: int):
        rows = slice(k * self.batch, (k + 1) * self.batch)
        ids = self.ids[rows]
        batch = {"input_ids": ids, "loss_mask": self.mask[rows], "attention_mask": torch.ones_like(ids)}
        return batch, {layer: h[rows] for layer, h in self.hidden.items()}

    def step(self, k: int) -> float:
        batch, hidden = self.inputs(k)
        self.opt.zero_grad(set_to_none=True)
        loss, _ = self.model(batch, hidden, self.loss_cfg)
        loss.backward()
        self.opt.step()
        return loss.item()


class SpeculatorsRun:
    name = "speculators"

    def __init__(self, drafter, target, ids, mask, hidden, pre_norm, batch: int, steps: int, attn: str, train_lm_head: bool):
        from speculators.losses import resolve_loss_config
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

        from draftlab.export.formats import ExportOptions, import_format
        from draftlab.losses.eagle import shift_left

        fmt = import_format("speculators")
        cfg = Eagle3SpeculatorConfig.model_validate(fmt.export_config(drafter, target, {}, ExportOptions(speculative_tokens=steps)))
        cfg.transformer_layer_config._attn_implementation = attn
        m = Eagle3DraftModel(cfg)
        state = fmt.export_state(drafter, target)  # the same starting weights as draftlab's
        state["embed_tokens.weight"] = target.embed_tokens.weight.detach()
        state["verifier_lm_head.weight"] = target.lm_head.weight.detach()[drafter.t2d]
        state["verifier_norm.weight"] = target.final_norm.weight.detach()
        m.load_state_dict(state, strict=True)
        m.lm_head.weight.requires_grad_(train_lm_head)
        self.model = m.train()
        self.steps = steps
        self.loss_config = resolve_loss_config("kl_div", "eager")
        self.opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR)
        R, T = ids.shape
        self.batch, self.T = batch, T
        # speculators packs a batch into one [1, batch*T] row; draftlab pairs position t with x_{t+1}
        self.ids = shift_left(ids, 1)
        self.mask = mask
        self.aux = torch.cat([hidden[i] for i in drafter.aux_layers], dim=-1)
        self.pre_norm = pre_norm
        self.doc = torch.arange(R)[:, None].expand(R, T)  # one document per row, as draftlab sees it
        self.positions = torch.arange(T).expand(R, T)

    def step(self, k: int) -> float:
        rows = slice(k * self.batch, (k + 1) * self.batch)
        flat = lambda x: x[rows].reshape(1, -1, *x.shape[2:])  # noqa: E731
        self.opt.zero_grad(set_to_none=True)
        _, loss, _ = self.model(
            hidden_states=flat(self.aux),
            input_ids=flat(self.ids),
            document_ids=flat(self.doc),
            loss_mask=flat(self.mask),
            position_ids=flat(self.positions),
            verifier_last_hidden_states=flat(self.pre_norm),
            ttt_steps=self.steps,
            ttt_step_loss_decay=DECAY,
            loss_config=self.loss_config,
        )
        loss.backward()
        self.opt.step()
        return loss.item()


def timed(run, k: int) -> float:
    t0 = time.perf_counter()
    loss = run.step(k)
    dt = time.perf_counter() - t0
    if not torch.isfinite(torch.tensor(loss)):
        raise SystemExit(f"{run.name}: non-finite loss {loss} at batch {k}")
    return dt


# ------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="timed steps per system (default 5; --quick: 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per system first")
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--peak-seconds", type=float, default=2.0, help="fp32 peak measurement per round")
    p.add_argument("--speculators-attn", default="sdpa", choices=("sdpa", "eager"))
    p.add_argument("--speculators-lm-head", default="frozen", choices=("frozen", "trained"),
                   help="speculators freezes its lm_head by default; 'trained' matches draftlab's work")
    p.add_argument("--profile", action="store_true", help="after timing, profile one draftlab step (top ops by self CPU)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 timed steps, 1 s peak, BENCHMARKS.md untouched")
    p.add_argument("--no-append", action="store_true", help="print only, do not rewrite this benchmark's section of BENCHMARKS.md")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.peak_seconds = min(args.steps, 2), 1.0
    if args.steps < 1 or args.batch < 1 or args.warmup < 0 or args.seq_len < 16:
        p.error("--steps/--batch must be >= 1, --warmup >= 0, --seq-len >= 16")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from draftlab.models.eagle import Eagle3Config, Eagle3Drafter
    from draftlab.models.target import Target

    target = Target.load("default")
    if target.dtype != torch.float32:
        raise SystemExit(f"the benchmark is fp32; the default target loaded as {target.dtype}")
    rounds = args.warmup + args.steps
    ids, mask = packed_rows(target.tokenizer, rounds * args.batch, args.seq_len)
    samples = [{"input_ids": r, "loss_mask": m} for r, m in zip(ids, mask)]
    drafter = Eagle3Drafter.build(Eagle3Config(num_layers=1, draft_vocab_size=DRAFT_VOCAB), target, samples)

    # target capture, once (its own row in the table, not part of the drafter numbers)
    capture_batch_rows = max(1, 1024 // args.seq_len)  # the capture default: 1024 tokens a forward
    capture_rows(target, ids[:1], drafter.capture_layers, 1)  # warm-up
    hidden, pre_norm, cap_s = capture_rows(target, ids, drafter.capture_layers, capture_batch_rows)
    cap_peak = measure_fp32_peak(args.peak_seconds)
    cap_tps = ids.numel() / cap_s
    cap_flops = sum(decoder_flops(target, args.seq_len)) / args.seq_len

    runs = [
        DraftlabRun(drafter, ids, mask, hidden, args.batch, TTT_STEPS),
        SpeculatorsRun(drafter, target, ids, mask, hidden, pre_norm, args.batch, TTT_STEPS,
                       args.speculators_attn, args.speculators_lm_head == "trained"),
    ]
    flops = trained_flops_per_token(drafter.shape, len(drafter.aux_layers), drafter.lm_head.out_features, args.seq_len, TTT_STEPS)
    tokens = args.batch * args.seq_len
    print(f"{ids.shape[0]} packed ShareGPT rows of {args.seq_len} tokens, batch {args.batch}, {TTT_STEPS} TTT steps, "
          f"draft vocab {drafter.lm_head.out_features}, {torch.get_num_threads()} threads; "
          f"{flops / 1e6:.1f} M trained FLOPs/token; target capture {cap_tps:.0f} tok/s "
          f"({100 * cap_tps * cap_flops / cap_peak:.1f}% of {cap_peak / 1e9:.1f} GFLOP/s)", flush=True)

    for k in range(args.warmup):
        for run in runs:
            print(f"warm-up {run.name}: {timed(run, k):.2f} s", flush=True)

    measured = LoadWindow()
    rows = []
    for r in range(args.steps):
        k = args.warmup + r
        row = {"round": r + 1, "peak": measure_fp32_peak(args.peak_seconds)}
        for run in runs if r % 2 == 0 else runs[::-1]:
            row[run.name] = tokens / timed(run, k)
        rows.append(row)
        print(f"round {r + 1}: peak {row['peak'] / 1e9:.1f} GFLOP/s | draftlab {row['draftlab']:.0f} tok/s "
              f"({share(row['draftlab'], flops, row['peak']):.1f}%) | speculators {row['speculators']:.0f} tok/s "
              f"({share(row['speculators'], flops, row['peak']):.1f}%) | ratio {row['draftlab'] / row['speculators']:.2f}x",
              flush=True)
    window = measured.close()

    table = make_table(rows, flops, cap_tps, cap_flops, cap_peak)
    note = load_note(window)
    print()
    print(table)
    print(note)
    if args.profile:
        print()
        print(profile_step(runs[0], args.warmup))
    if not (args.quick or args.no_append):
        append_result(argv, args, flops, drafter, table, note)
    return 0


def share(tps: float, flops: float, peak: float) -> float:
    return 100.0 * tps * flops / peak


def make_table(rows, flops, cap_tps, cap_flops, cap_peak) -> str:
    """Medians over rounds; % of peak = FLOPs/token x median tokens/s / median peak (so the column
    orders like tokens/s); the ratio is the median of the per-round (paired) ratios."""
    med = lambda f: statistics.median(f(r) for r in rows)  # noqa: E731
    peak = med(lambda r: r["peak"])
    lines = [
        "| system | tokens/s (median) | min - max | % of fp32 peak | draftlab / speculators |",
        "|---|---|---|---|---|",
    ]
    for name in ("draftlab", "speculators"):
        lo, hi = min(r[name] for r in rows), max(r[name] for r in rows)
        ratio = f"**{med(lambda r: r['draftlab'] / r['speculators']):.2f}x**" if name == "draftlab" else "1.00x"
        lines.append(f"| {name} EAGLE-3 training | {med(lambda r: r[name]):.0f} | {lo:.0f} - {hi:.0f} | "
                     f"{share(med(lambda r: r[name]), flops, peak):.1f}% | {ratio} |")
    lines.append(f"| target capture (forward, not in the rows above) | {cap_tps:.0f} | - | "
                 f"{share(cap_tps, cap_flops, cap_peak):.1f}% (decoder FLOPs, bench/capture.py) | - |")
    lines.append(f"\nfp32 matmul peak, median of {len(rows)} rounds: {peak / 1e9:.1f} GFLOP/s; "
                 f"{flops / 1e6:.1f} M trained FLOPs/token; ratio = median of the per-round ratios.")
    return "\n".join(lines)


def profile_step(run, k: int, rows: int = 15) -> str:
    """One more step of ``run`` under torch.profiler: the top ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run.step(k)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events)
    lines = [f"{run.name} training step under torch.profiler: {total / 1e6:.2f} s self CPU, "
             f"{sum(e.count for e in events)} profiled op calls (nested included); top {rows} by self CPU time:",
             f"  {'op':<48} {'self ms':>9} {'share':>7} {'calls':>6}"]
    for e in events[:rows]:
        lines.append(f"  {e.key[:48]:<48} {e.self_cpu_time_total / 1e3:9.0f} {100 * e.self_cpu_time_total / total:6.1f}% {e.count:6d}")
    return "\n".join(lines)


def append_result(argv, args, flops, drafter, table, note) -> None:
    cmd = "python -m bench.train_throughput " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    cpu = cpu_name()
    from importlib.metadata import version

    text = (
        f"\n## EAGLE-3 drafter training throughput, draftlab vs speculators "
        f"({datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')})\n\n"
        f"Command: `{cmd.strip()}`\n\n"
        f"Target default (SmolLM2-135M), 1 drafter layer, aux layers {drafter.aux_layers}, {args.seq_len}-token packed "
        f"ShareGPT rows, batch {args.batch}, {TTT_STEPS} TTT steps, draft vocab {drafter.lm_head.out_features}, fp32, "
        f"AdamW; target hidden states captured beforehand. speculators {version('speculators')} "
        f"Eagle3DraftModel with {args.speculators_attn} attention, eager KL loss, lm_head {args.speculators_lm_head}; "
        f"same starting weights and inputs. Median of {args.steps} timed steps per system after {args.warmup} warm-up, "
        f"alternating; % of peak = {flops / 1e6:.1f} M FLOPs/token (formula in bench/train_throughput.py) x tokens/s / "
        f"median fp32 matmul peak (measured every round). {cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}.\n\n"
        f"{table}\n\nMachine: {note} (shared machine: compare the ratio, not absolute rates).\n"
    )
    append_benchmarks(text)


if __name__ == "__main__":
    sys.exit(main())
