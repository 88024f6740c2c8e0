"""A drifting policy for the rollout workload (``draftlab rollouts make-policies``): RAFT-style
updates (reward-ranked fine-tuning, arXiv 2304.06767) of a target on its own rewarded samples.

Epoch e samples ``samples`` rollouts per problem from policy e at temperature 1 (draftlab's plain
decoder), keeps up to ``keep`` distinct rewarded responses per problem, and fine-tunes policy e
on them for ``steps`` steps (LoRA adapters through peft on every linear layer of the decoder,
loss on the response tokens only), then merges the adapters and saves policy e + 1 as an HF
model directory (safetensors, tokenizer), the form the workload loads. A problem none of whose
samples is rewarded contributes its reference answer instead (STaR's rationalization), so the
policy moves where it never succeeds too. Policy 0 is the target itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from draftlab.errors import DraftlabError

LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _examples(target, problems, prompts, samples: int, keep: int, max_new_tokens: int, seed: int):
    """(training examples [(prompt, response)], mean reward, problems with a rewarded sample)."""
    from draftlab.inference.decoder import generate_plain_batch
    from draftlab.inference.rollout_tasks import reward

    tok, eos = target.tokenizer, target.tokenizer.eos_token_id
    examples, rewards, solved = [], [], 0
    for i, (problem, prompt) in enumerate(zip(problems, prompts)):
        rows = generate_plain_batch(target, [prompt] * samples, max_new_tokens, temperature=1.0, seed=seed * 7919 + i,
                                    eos_token_id=eos).rows
        good = []
        for row in rows:
            r = reward(problem, tok.decode(row.tokens, skip_special_tokens=True))
            rewards.append(r)
            if r > 0 and row.tokens not in good:
                good.append(row.tokens)
        solved += bool(good)
        if not good:
            good = [tok.encode(problem.answer, add_special_tokens=False) + [eos]]
        examples += [(prompt, g) for g in good[:keep]]
    return examples, sum(rewards) / len(rewards), solved


def _finetune(model_dir: str, examples, steps: int, lr: float, rank: int, seed: int, pad: int):
    """The model at ``model_dir`` after ``steps`` LoRA steps on ``examples``, adapters merged; and the losses."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise DraftlabError(f"make-policies needs the peft package (pip install peft): {e}") from None
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=LORA_MODULES))
    width = max(len(p) + len(r) for p, r in examples)
    ids = torch.full((len(examples), width), pad, dtype=torch.long)
    labels = torch.full_like(ids, -100)  # the loss reads the responses only
    mask = torch.zeros_like(ids)
    for b, (p, r) in enumerate(examples):
        ids[b, : len(p) + len(r)] = torch.tensor(p + r)
        labels[b, len(p) : len(p) + len(r)] = torch.tensor(r)
        mask[b, : len(p) + len(r)] = 1
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return model.merge_and_unload().eval(), losses


def make_policies(target_spec: str, out: Path, problems, epochs: int, samples: int = 4, keep: int = 2, steps: int = 2,
                  lr: float = 1e-3, rank: int = 8, max_new_tokens: int = 64, seed: int = 0, log=None) -> Path:
    """Policies 0..epochs-1 under ``out`` and their ``policies.json``; returns the manifest's path."""
    from draftlab import atomic
    from draftlab.inference.policies import write_manifest
    from draftlab.inference.rollouts import prompt_of
    from draftlab.models.target import Target, resolve_target

    for name, v, low in (("--epochs", epochs, 1), ("--samples", samples, 1), ("--keep", keep, 1), ("--steps", steps, 1),
                         ("--lora-rank", rank, 1), ("--max-new-tokens", max_new_tokens, 2)):
        if v < low:
            raise DraftlabError(f"{name} must be >= {low}, got {v}")
    if not lr > 0:
        raise DraftlabError(f"--lr must be > 0, got {lr}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DraftlabError(f"--out {out}: exists and is not an empty directory")
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    entries, history = [str(Path(target_spec).resolve()) if Path(target_spec).is_dir() else target_spec], []
    model_dir = resolve_target(target_spec)[0]
    for e in range(epochs - 1):
        target = Target.load(model_dir, dtype="float32")
        prompts = [prompt_of(target.tokenizer, p) for p in problems]
        examples, mean_reward, solved = _examples(target, problems, prompts, samples, keep, max_new_tokens, seed + e)
        model, losses = _finetune(model_dir, examples, steps, lr, rank, seed + e, target.tokenizer.eos_token_id)
        name = f"policy-{e + 1:03d}"
        with atomic.directory(out / name) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            target.tokenizer.save_pretrained(tmp)
        history.append({"epoch": e, "mean_reward": mean_reward, "solved": solved, "examples": len(examples), "losses": losses})
        log(f"epoch {e}: mean reward {mean_reward:.3f}, {solved}/{len(problems)} problems solved, "
            f"{len(examples)} examples, loss {losses[0]:.3f} -> {losses[-1]:.3f}; wrote {name}")
        entries.append(name)
        model_dir = str(out / name)
        del target, model
    made_by = {"method": f"RAFT: LoRA r={rank} on {', '.join(LORA_MODULES)}, merged", "target": target_spec,
               "samples": samples, "keep": keep, "steps": steps, "lr": lr, "max_new_tokens": max_new_tokens, "seed": seed,
               "epochs": history}
    out.mkdir(parents=True, exist_ok=True)
    return write_manifest(out, entries, problems, made_by)
