"""Tokenizer and chat template (from transformers).

The incremental detokenizer and the stop-string matcher that stream its text are plain carriers
in service/core/text.py.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
PREFIX_CHECK_BYTES_PER_TOKEN = 16  # above this many bytes per allowed token, count a prefix's tokens first


class InputTooLong(ValueError):
    """A text that cannot fit the token limit, found without tokenizing all of it."""


class Tokenizer:
    """Thin wrapper over a transformers tokenizer."""

    def __init__(self, model_dir: str | Path):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        processor_template = (
            Path(model_dir) / "chat_template.json"
        )  # vision-language models keep it with the processor
        if not getattr(self.hf, "chat_template", None) and processor_template.exists():
            self.hf.chat_template = json.loads(processor_template.read_text()).get("chat_template")
        self.vocab_size = len(self.hf)
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))
        self.image_token = "<image>"  # the text of an image placeholder (a LLaVA model's image token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    @cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the text bytes one token covers: the longest vocabulary entry in UTF-8
        (byte-level and SentencePiece spellings are never shorter than the bytes they stand for)."""
        return max(len(t.encode("utf-8")) for t in self.hf.get_vocab())

    def encode_bounded(self, text: str, max_tokens: int, add_special_tokens: bool = True) -> list[int]:
        """encode(), but a text that cannot fit max_tokens is refused cheaply (InputTooLong): by its
        size (no token covers more than max_token_bytes), else by the token count of a prefix."""
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > max_tokens * self.max_token_bytes:
            raise InputTooLong(
                f"{size} bytes cannot fit {max_tokens} tokens (no token covers more than "
                f"{self.max_token_bytes} bytes)"
            )
        cut = max_tokens * PREFIX_CHECK_BYTES_PER_TOKEN
        if len(text) > cut:  # a prefix's tokens (give or take the word cut in two) are a lower bound
            n = len(self.encode(text[:cut], add_special_tokens=False))
            if n > max_tokens + 8:
                raise InputTooLong(f"more than {n - 8} tokens in its first {cut} characters already")
        return self.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False
    ) -> str:
        """Apply the model's chat template; raises ValueError for bad roles / no template.
        `continue_final_message`: the last message, an assistant's, is left open to be continued."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("chat.continue_final_message: not with add_generation_prompt")
        if continue_final_message and (not messages or messages[-1]["role"] != "assistant"):
            raise ValueError("chat.continue_final_message: the last message must be the assistant's")
        for i, m in enumerate(messages):
            if m["role"] not in CHAT_ROLES:
                raise ValueError(
                    f"chat.messages[{i}].role: unknown role {m['role']!r} (one of {', '.join(CHAT_ROLES)})"
                )
        if not self.has_chat_template:
            raise ValueError("chat: this model has no chat template; send text or token_ids")
        flags = dict(
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message
        )
        if any(isinstance(m["content"], list) for m in messages):
            return self._render_chat_parts(messages, flags)
        return self._apply_template(messages, flags)

    def _apply_template(self, messages: list[dict], flags: dict[str, bool]) -> str:
        """The template's own refusals (`raise_exception`: "System role not supported", "roles must
        alternate") and its failures on these messages are the request's fault: ValueError."""
        from jinja2 import TemplateError

        try:
            return self.hf.apply_chat_template(messages, tokenize=False, **flags)
        except (TemplateError, TypeError) as e:
            raise ValueError(f"chat: the model's chat template refused the messages: {e}") from None

    def _render_chat_parts(self, messages: list[dict], flags: dict[str, bool]) -> str:
        """Messages whose content is a list of parts ({"type": "text", "text": ...} / {"type": "image"}).
        A template that renders such lists (LLaVA's) is used as it is when it puts one image
        placeholder per image; a text-only template gets each message's parts joined into one
        string, with the image placeholder where each image is."""
        n = sum(
            1
            for m in messages
            if isinstance(m["content"], list)
            for p in m["content"]
            if p["type"] == "image"
        )
        try:
            text = self._apply_template(messages, flags)
            if text.count(self.image_token) == n:
                return text
        except ValueError:  # a template that expects string content may fail on lists
            pass
        flat = [
            {
                **m,
                "content": "".join(
                    self.image_token if p["type"] == "image" else p["text"] for p in m["content"]
                ),
            }
            if isinstance(m["content"], list)
            else m
            for m in messages
        ]
        return self._apply_template(flat, flags)

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        max_tokens: int | None = None,
        continue_final_message: bool = False,
    ) -> tuple[str, list[int]]:
        text = self.render_chat(messages, add_generation_prompt, continue_final_message)
        # The template already holds the special tokens it wants.
        if max_tokens is None:
            return text, self.encode(text, add_special_tokens=False)
        return text, self.encode_bounded(text, max_tokens, add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def eos_token_ids(self, config, generation: dict | None = None) -> list[int]:
        """The model's end-of-sequence ids: config.json's, the tokenizer's and generation_config.json's
        (where instruct models list their end-of-turn tokens: Llama 3's <|eot_id|>, Gemma's <end_of_turn>)."""
        ids: set[int] = set()
        sources = (
            getattr(config, "eos_token_id", None),
            self.hf.eos_token_id,
            (generation or {}).get("eos_token_id"),
        )
        for src in sources:
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(x) for x in src)
        return sorted(ids)
