"""Chat conversations -> token ids and a per-token "train on this" mask (docs/sft.md).

A conversation is a JSON object with ``messages``: a list of ``{"role", "content"}`` turns,
roles ``system``/``user``/``assistant``, at least one ``assistant`` turn. It is rendered with

- the tokenizer's own template when it has one (a Jinja ``chat_template`` string attribute, as
  Hugging Face tokenizers carry; rendered with ``jinja2`` in a sandbox), or
- the default template of this module, for tokenizers without one (our tiktoken tokenizer)::

      <BOS> "<|system|>\\n" content <EOS> "<|user|>\\n" content <EOS> "<|assistant|>\\n" content <EOS> ...

  the role headers are ordinary text, each turn ends with the tokenizer's EOS token (so a model
  generating after ``"<|assistant|>\\n"`` stops at EOS).

Only assistant turns train: the mask is True on each assistant turn's content and its
end-of-turn token(s), False on everything else (BOS, headers, system and user turns). With a
Jinja template the pieces are found by rendering growing prefixes of the conversation, so the
template must render a conversation as a prefix of any longer one (chat templates do).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

__all__ = [
    "ROLES",
    "ChatTokenizer",
    "read_conversations",
    "resolve_chat_template",
    "tokenize_conversation",
    "validate_conversation",
]

ROLES = ("system", "user", "assistant")
Message = dict[str, str]


class ChatTokenizer(Protocol):
    """What the chat code needs of a tokenizer (ours, or any with the same methods)."""

    @property
    def bos_id(self) -> int | None: ...  # None: the tokenizer has no BOS (Qwen3's)

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]: ...


def validate_conversation(obj: Any, where: str) -> list[Message]:
    """The messages of one parsed JSONL record; ``ValueError`` naming ``where`` (file:line)
    and the rule otherwise."""
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
        raise ValueError(f'{where}: expected an object with a "messages" list, got {_short(obj)}')
    messages = obj["messages"]
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError(
                f'{where}: message {i} must be an object with a string "content", got {_short(m)}'
            )
        if m.get("role") not in ROLES:
            raise ValueError(
                f"{where}: message {i} has unknown role {m.get('role')!r}; "
                f"roles are {', '.join(ROLES)}"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant message, so nothing to train on")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _short(obj: Any, limit: int = 80) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_conversations(path: str | Path) -> Iterator[tuple[int, list[Message]]]:
    """(line number, messages) of every non-blank line of a JSONL file; ``ValueError`` naming
    the file and line of the first malformed one."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 (byte {e.start}: {e.reason})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
            yield lineno, validate_conversation(obj, where)


def resolve_chat_template(
    tokenizer: object, choice: Literal["auto", "default", "tokenizer"]
) -> str | None:
    """The Jinja template to use (``None``: the default template). ``auto`` takes the
    tokenizer's ``chat_template`` when it has one; ``tokenizer`` requires it."""
    template = getattr(tokenizer, "chat_template", None)
    has = isinstance(template, str) and template.strip() != ""
    if choice == "tokenizer" and not has:
        raise ValueError(
            f"sft.chat_template = 'tokenizer' but {type(tokenizer).__name__} has no "
            f"chat_template; use 'auto' or 'default' (docs/sft.md)"
        )
    return template if has and choice != "default" else None  # type: ignore[return-value]


def tokenize_conversation(
    tokenizer: ChatTokenizer, messages: Sequence[Message], template: str | None
) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, per token, whether it is trained on."""
    pieces = (
        _default_pieces(messages)
        if template is None
        else _jinja_pieces(tokenizer, messages, template)
    )
    bos = [tokenizer.bos_id] if template is None and tokenizer.bos_id is not None else []
    ids: list[int] = bos
    train: list[bool] = [False] * len(ids)
    for piece, trained in pieces:
        if isinstance(piece, int):
            part = [tokenizer.eos_id]
        else:
            part = _encode_with_specials(tokenizer, piece)
        ids += part
        train += [trained] * len(part)
    return ids, train


_EOS = 0  # marker for the EOS token in the default template's pieces


def _default_pieces(messages: Sequence[Message]) -> list[tuple[str | int, bool]]:
    pieces: list[tuple[str | int, bool]] = []
    for m in messages:
        trained = m["role"] == "assistant"
        pieces += [(f"<|{m['role']}|>\n", False), (m["content"], trained), (_EOS, trained)]
    return pieces


def _special_names(tokenizer: object) -> dict[str, int]:
    specials = getattr(tokenizer, "special_tokens", None)
    return dict(specials) if isinstance(specials, dict) else {}


def _encode_with_specials(tokenizer: ChatTokenizer, text: str) -> list[int]:
    """``text`` with the tokenizer's special-token strings mapped to their ids (a template
    writes them as text) and everything between encoded as ordinary text."""
    specials = _special_names(tokenizer)
    if not text:
        return []
    if not specials:
        return tokenizer.encode(text, bos=False, eos=False)
    pattern = "(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")"
    ids: list[int] = []
    for part in re.split(pattern, text):
        if part in specials:
            ids.append(specials[part])
        elif part:
            ids += tokenizer.encode(part, bos=False, eos=False)
    return ids


def _jinja_pieces(
    tokenizer: ChatTokenizer, messages: Sequence[Message], template: str
) -> list[tuple[str | int, bool]]:
    render = _jinja_renderer(tokenizer, template)
    pieces: list[tuple[str | int, bool]] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render(messages[:i], True)
        turn = render(messages[: i + 1], False)
        for earlier, later in ((done, prompt), (prompt, turn)):
            if not later.startswith(earlier):
                raise ValueError(
                    "the tokenizer's chat_template does not render a conversation as a prefix "
                    "of a longer one, so assistant turns cannot be located; use "
                    "sft.chat_template = 'default'"
                )
        pieces += [(prompt[len(done) :], False), (turn[len(prompt) :], True)]
        done = turn
    full = render(messages, False)
    if not full.startswith(done):
        raise ValueError("the tokenizer's chat_template is not prefix-stable; use 'default'")
    pieces.append((full[len(done) :], False))
    return pieces


def _jinja_renderer(tokenizer: ChatTokenizer, template: str) -> Any:
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 comes with torch
        raise ValueError(
            "the tokenizer has a chat_template but jinja2 is not installed: "
            "`pip install jinja2`, or set sft.chat_template = 'default'"
        ) from e

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat_template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template)
    names = {i: s for s, i in _special_names(tokenizer).items()}
    bos_name = getattr(tokenizer, "bos_token", None) or ""
    tokens = {
        "bos_token": bos_name
        if tokenizer.bos_id is None
        else names.get(tokenizer.bos_id, bos_name),
        "eos_token": names.get(tokenizer.eos_id, getattr(tokenizer, "eos_token", "")),
    }

    def render(messages: Sequence[Message], add_generation_prompt: bool) -> str:
        return compiled.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **tokens
        )

    return render
