"""Chat-format image-text samples (docs/vlm.md, "Data"): a ``messages`` list of
``{"role", "content"}`` turns whose content is a string (``<image>`` where an image goes, the
LLaVA convention) or a list of parts ``{"type": "image"}`` / ``{"type": "text", "text": ...}``
(the Hugging Face datasets' layout), with the sample's images in order.

The conversation is rendered as the chat SFT data renders it (``data/chat_template.py``: the
tokenizer's Jinja template, else the default one) and trains on the assistant turns only (their
content and end-of-turn tokens); each image marker becomes the image's placeholders, never
trained on.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from torchtitan.data.chat_template import (
    ChatTokenizer,
    _default_pieces,
    _encode_with_specials,
    _jinja_pieces,
    validate_conversation,
)

__all__ = ["MARKER", "chat_messages", "chat_tokens", "markers"]

MARKER = "<image>"
Message = dict[str, str]


def _part_text(part: Any, where: str, i: int) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "image":
        return MARKER
    if kind == "text":
        return part.get("text") or ""
    raise ValueError(
        f"{where}: message {i} has a content part {str(part)[:60]!r}; image-text chat reads "
        "parts of type 'text' (with 'text') and 'image'"
    )


def chat_messages(messages: Any, where: str) -> list[Message]:
    """The validated turns, each content a string with :data:`MARKER` where its images go;
    ``ValueError`` naming ``where`` otherwise."""
    if not isinstance(messages, list):
        raise ValueError(f"{where}: 'messages' must be a list of turns, got {str(messages)[:60]}")
    turns = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            m = {**m, "content": "".join(_part_text(p, where, i) for p in m["content"])}
        turns.append(m)
    return validate_conversation({"messages": turns}, where)


def chat_tokens(
    tokenizer: ChatTokenizer,
    messages: Sequence[Message],
    template: str | None,
    images: Iterator[list[int]],
) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation with each marker replaced by the next of
    ``images`` (an image's placeholder ids), and per token whether it is trained on."""
    if template is None:
        pieces = _default_pieces(messages)
        ids: list[int] = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    else:
        pieces, ids = _jinja_pieces(tokenizer, messages, template), []
    train = [False] * len(ids)
    for piece, trained in pieces:
        if isinstance(piece, int):  # the default template's end of turn
            ids.append(tokenizer.eos_id)
            train.append(trained)
            continue
        for j, text in enumerate(piece.split(MARKER)):
            if j:
                run = next(images)
                ids += run
                train += [False] * len(run)
            part = _encode_with_specials(tokenizer, text)
            ids += part
            train += [trained] * len(part)
    return ids, train


def markers(messages: Sequence[Message]) -> int:
    """Image markers in the turns."""
    return sum(m["content"].count(MARKER) for m in messages)
