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
