"""Tiny randomly initialised targets and tokenizers for tests (no hub, no network)."""

from __future__ import annotations

from pathlib import Path

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama-3 style: header tokens, no newline after the end-of-turn token.
LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
SPECIAL = ["<unk>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens and the target verifies them.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "user assistant system Hello! How can I help you today? Please explain the theory of relativity.",
    "Translate to French: good morning -> bonjour. Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
]


def make_tokenizer(template: str = "chatml", vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(_CORPUS * 4, trainer)
    eos = "<|im_end|>" if template == "chatml" else "<|eot_id|>"
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token=eos, pad_token=eos)
    tok.chat_template = CHATML_TEMPLATE if template == "chatml" else LLAMA3_TEMPLATE
    return tok


def tiny_config(family: str = "llama", vocab_size: int = 400, layers: int = 4, hidden: int = 64):
    from transformers import AutoConfig

    kw = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=family in ("qwen2", "qwen3"),
        eos_token_id=2,
        pad_token_id=2,
    )
    if family == "qwen3":
        kw["head_dim"] = hidden // 4
    return AutoConfig.for_model(family, **kw)


def make_tiny_target_dir(path: Path, family: str = "llama", template: str = "chatml", seed: int = 0, **kw) -> Path:
    """Write a tiny random HF model + tokenizer to ``path`` and return it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    tok = make_tokenizer(template)
    cfg = tiny_config(family, vocab_size=len(tok), **kw)
    model = AutoModelForCausalLM.from_config(cfg)
    # Larger-than-default init so the tiny model's distributions are not uniform.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


# ------------------------------------------------------------------------------ shared test helpers
WORDS = "the quick brown fox jumps over lazy dog speculative decoding drafts tokens target verifies them".split()


def write_chat(path: Path, conversations: int, assistant_words: int = 16, turns: int = 1, seed: int = 0) -> Path:
    """A JSONL file of random chats in OpenAI ``messages`` form (``turns`` user/assistant pairs)."""
    import json
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(conversations):
            msgs = []
            for _ in range(turns):
                msgs.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=6))})
                msgs.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=assistant_words))})
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def tiny_eagle3_recipe(root: Path, conversations: int = 10, eval_section: dict | None = None) -> Path:
    """A one-epoch EAGLE-3 recipe for an 8-layer tiny Llama (three distinct auxiliary layers, as
    SpecForge's fc needs) on ``conversations`` random chats (the first 10 trained), under ``root``."""
    import yaml

    target = make_tiny_target_dir(root / "target", "llama", layers=8)
    data = write_chat(root / "chat.jsonl", conversations, assistant_words=12)
    recipe = {
        "algorithm": "eagle3", "output_dir": str(root / "run"), "seed": 0,
        "target": {"model": str(target)},
        "data": {"source": str(data), "num_conversations": 10, "max_length": 64, "heldout": 2},
        "drafter": {"num_layers": 1, "draft_vocab_size": 128},
        "loss": {"ttt_steps": 1},
        "capture": {"mode": "memory"},
        "train": {"lr": 1e-3, "warmup_steps": 1, "epochs": 1, "batch_tokens": 256, "checkpoint_every": 100},
        "eval": eval_section or {"enabled": False},
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def random_samples(target, n: int = 4, T: int = 24, seed: int = 0) -> list[dict]:
    """``n`` training samples of ``T`` random tokens, every position counted."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, target.vocab_size, (T,), generator=g), "loss_mask": torch.ones(T, dtype=torch.bool)}
            for _ in range(n)]


def save_checkpoint(drafter, target, path: Path, recipe=None, step: int = 7) -> Path:
    """``drafter`` as a draftlab checkpoint at ``path`` (no trainer state)."""
    from draftlab import atomic
    from draftlab import checkpoint as ckpt

    with atomic.directory(path) as tmp:
        ckpt.save_weights(tmp, drafter.state_dict(), ckpt.checkpoint_meta(drafter, target.identity, recipe, step))
    return path


def final_hidden(target, ids: torch.Tensor) -> torch.Tensor:
    """The target's last hidden state (after its final norm) for ``ids`` [B, T]."""
    return target(ids, layers=[target.num_layers], logits=None).hidden[target.num_layers]


def padded_batch(target, T: int, short: int):
    """Two right-padded rows of random tokens, of lengths ``T`` and ``short``, whose first 3
    positions are prompt (loss_mask False): (rows, batch)."""
    rows = [s["input_ids"] for s in random_samples(target, n=2, T=T, seed=3)]
    rows[1] = rows[1][:short]
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    attn = torch.zeros_like(ids, dtype=torch.bool)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for b, row in enumerate(rows):
        attn[b, : len(row)] = True
        mask[b, 3 : len(row)] = True
    return rows, {"input_ids": ids, "loss_mask": mask, "attention_mask": attn.long()}


def edit_checkpoint(path: Path, meta=None, weights=None) -> None:
    """Damage a checkpoint in place: ``meta(drafter_meta_dict)`` and ``weights(state_dict)``
    edit its JSON's drafter section and its tensors."""
    import json

    from safetensors.torch import load_file, save_file

    from draftlab import checkpoint as ckpt

    if meta:
        m = json.loads((path / ckpt.META).read_text())
        meta(m["drafter"])
        (path / ckpt.META).write_text(json.dumps(m))
    if weights:
        s = load_file(path / ckpt.WEIGHTS)
        weights(s)
        save_file(s, path / ckpt.WEIGHTS)


def assert_one_line(excinfo, match: str) -> None:
    """The raised error's message is one line and matches ``match`` (a regex)."""
    import re

    msg = str(excinfo.value)
    assert "\n" not in msg and re.search(match, msg), msg


@torch.no_grad()
def exact_joint(target, prompt, depth, temperature, top_k):
    """{(t0, .., t_{depth-1}): probability} of the target's first tokens under processing."""
    from draftlab.inference.sampling import process_logits

    joint = {(): 1.0}
    for _ in range(depth):
        seqs = list(joint)
        logits = target(torch.tensor([prompt + list(s) for s in seqs]), logits="last").logits[:, -1]
        probs = process_logits(logits, temperature, top_k)
        joint = {
            s + (t,): joint[s] * float(probs[i, t]) for i, s in enumerate(seqs) for t in probs[i].nonzero().flatten().tolist()
        }
    return joint


def assert_follows_target(counts, target, prompt, depth: int, temperature: float, top_k: int, n: int) -> None:
    """``counts`` of ``n`` sampled ``depth``-token continuations of ``prompt`` fit the target's
    exact joint (chi-square), and the test has power: a joint shifted 30 % towards top-k = 2
    is rejected."""
    joint = exact_joint(target, prompt, depth, temperature, top_k)
    assert chi2_pvalue(counts, joint, n) > 1e-3
    skewed = exact_joint(target, prompt, depth, temperature, 2)
    assert chi2_pvalue(counts, {c: 0.7 * joint[c] + 0.3 * skewed.get(c, 0.0) for c in joint}, n) < 1e-3


def assert_batch_follows_target(decoder, target, prompts, temperature: float, top_k: int, n: int) -> None:
    """``n`` seeded decodings of the batch ``prompts`` (3 new tokens, chains of 2): each row's
    continuations fit the target's exact joint (:func:`assert_follows_target`), and the first
    step accepted 0, 1 and 2 drafts at times, so every verify path was taken."""
    from collections import Counter

    from draftlab.inference.shapes import Chain

    counts, accepted = [Counter() for _ in prompts], Counter()
    for s in range(n):
        res = decoder.generate(prompts, 3, Chain(2), temperature=temperature, top_k=top_k, seed=s)
        for b, row in enumerate(res.rows):
            counts[b][tuple(row.tokens)] += 1
            accepted.update(row.accept_lengths[:1])
    assert len(accepted) == 3, accepted
    for b, p in enumerate(prompts):
        assert_follows_target(counts[b], target, p, 3, temperature, top_k, n)


def chi2_pvalue(counts, joint: dict, n: int) -> float:
    """Chi-square goodness of fit; cells expecting fewer than 5 draws are pooled."""
    assert set(counts) <= set(joint), f"sampled outside the target's support: {set(counts) - set(joint)}"
    big = [c for c, p in joint.items() if p * n >= 5]
    small = [c for c in joint if c not in big]
    obs = [counts[c] for c in big] + ([sum(counts[c] for c in small)] if small else [])
    exp = [joint[c] * n for c in big] + ([sum(joint[c] for c in small) * n] if small else [])
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def run_train_script(family: str, recipe: Path, kill_after: int | None = None, timeout: int = 600):
    """``python train/<family>.py RECIPE`` as a user launches it, one thread; with ``kill_after``,
    SIGKILLed once that checkpoint step is written (tests/kill_after_checkpoint.py)."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    killer = [str(repo / "tests" / "kill_after_checkpoint.py"), str(kill_after)] if kill_after else []
    return subprocess.run([sys.executable, *killer, str(repo / "train" / f"{family}.py"), str(recipe)], cwd=repo,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=timeout)


def assert_resumes_bitwise(family: str, straight: Path, killed: Path, step: int = 4, timeout: int = 600) -> dict[str, torch.Tensor]:
    """``python train/<family>.py`` of ``straight`` through; of ``killed``, SIGKILLed once checkpoint 2
    is written, then launched again: it resumes, and both runs' weights at ``step`` are equal to the
    bit. Returns those weights."""
    import yaml
    from safetensors.torch import load_file

    from draftlab import checkpoint as ckpt

    def run_dir(recipe: Path) -> Path:
        return Path(yaml.safe_load(recipe.read_text())["output_dir"])

    res = run_train_script(family, straight, timeout=timeout)
    assert res.returncode == 0, res.stderr[-2000:]
    res = run_train_script(family, killed, kill_after=2, timeout=timeout)
    assert res.returncode != 0 and ckpt.list_checkpoints(run_dir(killed))[-1].name == "step-0000002"
    res = run_train_script(family, killed, timeout=timeout)
    assert res.returncode == 0 and "resumed from" in res.stdout, res.stderr[-2000:]
    a, b = (load_file(ckpt.step_dir(run_dir(r), step) / ckpt.WEIGHTS) for r in (straight, killed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return a


def spy_drafts(monkeypatch, proposer) -> dict[str, list[torch.Tensor]]:
    """Record what ``proposer`` drafts in each loop: ``host`` (each step's stacked chains of every
    row) and ``device`` (each step's drafts of the first three rows)."""
    drafted = {"host": [], "device": []}
    batched, on_device = proposer.batched, proposer.on_device

    def spy_host(n, shape):
        rows = batched(n, shape)
        propose = rows.propose

        def spied(s):
            drafts = propose(s)
            drafted["host"].append(torch.stack([d.tokens for d in drafts]))
            return drafts

        rows.propose = spied
        return rows

    def spy_device(rows, room, shape):
        drafter = on_device(rows, room, shape)
        draft = drafter.draft

        def spied(b, k):
            drafts = draft(b, k)
            drafted["device"].append(drafts[:3].clone())
            return drafts

        drafter.draft = spied
        return drafter

    monkeypatch.setattr(proposer, "batched", spy_host)
    monkeypatch.setattr(proposer, "on_device", spy_device)
    return drafted
