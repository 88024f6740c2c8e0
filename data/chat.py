"""Chat template rendering and the assistant-only loss mask, exact at token boundaries.

How the mask is found (no assumption about a particular template):

1. Render the whole conversation once (``F``) and each prefix that ends just before an
   assistant turn with the generation prompt (``G_i``) and just after it (``E_i``). If the
   template renders prefixes consistently, ``G_i`` and ``E_i`` are prefixes of ``F``: the
   assistant's content starts at or after ``len(G_i)`` and the turn ends at ``len(E_i)``.
2. Inside ``F[len(G_i):len(E_i)]`` find the content (as is, or stripped, because templates
   such as Llama-3's ``| trim`` it): that is the character span of the assistant's words.
3. Tokenise ``F`` once with offsets. A token is masked when its characters overlap the
   content span -- so a token straddling a boundary counts as content: it carries content
   characters the drafter must produce, and no unmasked token holds any content.
4. After the content, the run of special tokens inside the turn (``<|im_end|>``,
   ``<|eot_id|>``, ``</s>`` ...) is masked too, so the drafter learns to stop; plain text after
   them (ChatML's trailing newline) is template glue the model never generates, so it is not.

The role header, system and user tokens stay 0. A template that rewrites earlier turns when
later ones are added (so prefixes do not line up) raises :class:`ChatTemplateError`.
"""

from __future__ import annotations

from typing import Sequence

from draftlab.errors import DraftlabError

Message = dict[str, str]


class ChatTemplateError(DraftlabError):
    """The tokenizer's chat template cannot be used to locate assistant turns exactly."""


def render(tokenizer, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
    """The chat template's text for ``messages`` (no tokenisation)."""
    if not messages:
        return ""  # templates may index messages[0]; an empty conversation renders nothing
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


def check_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DraftlabError("the target's tokenizer has no chat template (set one in tokenizer_config.json or chat_template.jinja)")
    if not getattr(tokenizer, "is_fast", False):
        raise DraftlabError("the target's tokenizer must be a fast (Rust) tokenizer: character offsets are needed for the loss mask")


def special_token_ids(tokenizer) -> set[int]:
    """Ids of all special tokens (declared specials plus added tokens flagged special)."""
    ids = set(tokenizer.all_special_ids)
    for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def assistant_spans(tokenizer, messages: Sequence[Message], text: str, stop_char: int | None = None) -> list[tuple[int, int, int]]:
    """``(content_start, content_end, turn_end)`` character spans of each assistant turn in
    ``text`` (the full rendering). Turns starting at or after ``stop_char`` are skipped (they
    would be truncated away anyway)."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = render(tokenizer, messages[:i], add_generation_prompt=True)
        if stop_char is not None and len(head) >= stop_char:
            break
        turn = render(tokenizer, messages[: i + 1])
        if not (text.startswith(head) and text.startswith(turn) and len(head) <= len(turn)):
            raise ChatTemplateError(
                "the chat template renders a conversation's prefix differently from the whole conversation; "
                "cannot locate assistant turns"
            )
        content = m["content"]
        start = text.find(content, len(head), len(turn))
        if start < 0:
            content = content.strip()
            start = text.find(content, len(head), len(turn))
        if start < 0:
            raise ChatTemplateError("the chat template changes assistant content beyond stripping whitespace")
        spans.append((start, start + len(content), len(turn)))
    return spans


def mask_from_spans(
    ids: Sequence[int], offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int, int]], special_ids: set[int]
) -> list[int]:
    """Loss mask over tokens given assistant spans (see module doc, steps 3-4)."""
    mask = [0] * len(ids)
    t, n = 0, len(ids)
    for cs, ce, te in spans:
        while t < n and offsets[t][1] <= cs:  # header and everything before the content
            t += 1
        while t < n and offsets[t][0] < ce and offsets[t][1] > cs:  # overlaps the content
            mask[t] = 1
            t += 1
        while t < n and offsets[t][0] < te and ids[t] in special_ids:  # end-of-turn token(s)
            mask[t] = 1
            t += 1
    return mask


def tokenize_conversation(tokenizer, messages: Sequence[Message], max_length: int) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of a conversation through the tokenizer's chat template;
    ``loss_mask`` is 1 on assistant content and its end-of-turn token(s). Truncated to
    ``max_length`` tokens (keeping the start)."""
    check_template(tokenizer)
    text = render(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    stop_char = None
    if len(ids) > max_length:
        ids, offsets = ids[:max_length], offsets[:max_length]
        stop_char = offsets[-1][1] if offsets else 0
    spans = assistant_spans(tokenizer, messages, text, stop_char)
    return ids, mask_from_spans(ids, offsets, spans, special_token_ids(tokenizer))


def prompt_ids(tokenizer, messages: Sequence[Message]) -> list[int]:
    """Token ids of the conversation up to its first assistant turn, ending with the
    generation prompt (the assistant header) -- an evaluation prompt."""
    check_template(tokenizer)
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    if not any(m["role"] == "user" for m in messages[:first]):
        raise DraftlabError("an evaluation prompt needs a user turn before the first assistant turn")
    text = render(tokenizer, messages[:first], add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
