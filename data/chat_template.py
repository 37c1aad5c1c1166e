"""Render a conversation with the tokenizer's own chat template and find the assistant tokens.

No separators are hard-coded. For assistant turn i the template is rendered twice:
    before = render(messages[:i], add_generation_prompt=True)   # up to where the answer starts
    after  = render(messages[:i+1])                               # through the end of that turn
and the turn is the character span [len(before), len(after)) of the full rendering (both must
be prefixes of it; templates that rewrite earlier turns are reported as "template_error").
Tokens are mapped to spans by their character offsets. A span ends at the first end-of-turn
token in it (the tokenizer's eos), because that is where generation stops: ChatML's trailing
"\n" after <|im_end|> is never generated, so it is not a training target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from transformers import PreTrainedTokenizerBase


class TemplateError(ValueError):
    """The template cannot render this conversation consistently (rejected roles, rewritten turns)."""


@dataclass
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant tokens (content + end-of-turn token)


def _render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict], generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja raise_exception(), e.g. Mistral's "roles must alternate"
        raise TemplateError(f"chat template refused the conversation: {e}") from e


def assistant_spans(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict],
                    last_only: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """Full rendering and the [start, end) character span of each (or only the last) assistant turn."""
    full = _render(tokenizer, messages, False)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if last_only:
        turns = turns[-1:]
    spans = []
    for i in turns:
        before = _render(tokenizer, messages[:i], True) if i else ""
        after = _render(tokenizer, messages[: i + 1], False)
        if not (full.startswith(before) and full.startswith(after) and len(before) <= len(after)):
            raise TemplateError("chat template is not prefix-stable (it rewrites earlier turns)")
        spans.append((len(before), len(after)))
    return full, spans


def _tokenize_prefix(tokenizer: PreTrainedTokenizerBase, text: str,
                     max_tokens: int | None) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and character offsets of the first `max_tokens` tokens (all if None).

    Long ShareGPT conversations are many times max_length; tokenizing only a growing character
    prefix is much faster. Only the last word before a cut can tokenize differently (tokenizers
    pre-split on spaces/punctuation), so a margin of tokens beyond max_tokens is kept and dropped.
    """
    margin = 64
    cut = len(text) if max_tokens is None else 8 * (max_tokens + margin)
    while True:
        # The template already wrote the special tokens (bos etc.), so do not add them again.
        enc = tokenizer(text[:cut], add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        if max_tokens is None:
            return ids, offsets
        if cut >= len(text) or len(ids) >= max_tokens + margin:
            return ids[:max_tokens], offsets[:max_tokens]
        cut *= 2


def render_with_mask(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict], last_only: bool = False,
                     eos_ids: Sequence[int] | None = None, max_tokens: int | None = None) -> Rendered:
    """Token ids of the rendered conversation and a mask that is 1 exactly on assistant tokens.

    max_tokens: keep only the first max_tokens tokens (cheaper than truncating afterwards).
    """
    if not tokenizer.is_fast:
        raise ValueError("loss masks need a fast tokenizer (character offsets)")
    full, spans = assistant_spans(tokenizer, messages, last_only)
    ids, offsets = _tokenize_prefix(tokenizer, full, max_tokens)
    eos = set(eos_ids if eos_ids is not None else [tokenizer.eos_token_id])
    mask = [0] * len(ids)
    k = 0
    for start, end in spans:
        while k < len(ids) and offsets[k][1] <= start:  # tokens wholly before the span
            k += 1
        while k < len(ids) and offsets[k][0] < end:
            mask[k] = 1
            k += 1
            if ids[k - 1] in eos:  # generation stops here; the rest of the span is template glue
                break
    return Rendered(ids, mask)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt) -> list[int]:
    """Token ids of a prompt: ids as they are, text tokenized as it is, chat messages ([{"role", "content"}])
    through the tokenizer's chat template with the generation prompt."""
    from eyas.models.errors import InputError

    if hasattr(prompt, "tolist") and not isinstance(prompt, (str, list, tuple)):
        ids = prompt.flatten().tolist()
    elif isinstance(prompt, str):
        ids = tokenizer(prompt)["input_ids"]
    elif prompt and isinstance(prompt[0], dict):
        if not getattr(tokenizer, "chat_template", None):
            raise InputError("the target's tokenizer has no chat template: give the prompt as text or token ids")
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise InputError("the prompt is empty: give at least one token")
    return list(ids)
