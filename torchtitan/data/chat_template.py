"""Chat samples to tokens: rendered with the tokenizer's chat template, assistant turns trained.

Templates are Jinja2 (the HuggingFace format: ``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token``, ``raise_exception``) and come with downloaded files, so they are
rendered in Jinja2's ``ImmutableSandboxedEnvironment``: a template can produce text and nothing
else (no attribute access to Python internals, no mutation of the data passed in).

Masking renders the conversation turn by turn: the text added by each message is one piece;
for an assistant message, the generation prompt the template puts before it (rendered with
``add_generation_prompt``) is an untrained piece, and the rest (the content and the end-of-turn
text the template puts after it) is trained. This needs a template whose rendering of the first
``k`` messages is a prefix of its rendering of ``k + 1``; others are refused with an error.
"""

from __future__ import annotations

import json
from typing import Any, NoReturn

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from torchtitan.config.errors import ConfigError
from torchtitan.data.packing import EncodedDocument
from torchtitan.data.sft import ChatSample
from torchtitan.protocols.tokenizer import BaseTokenizer

Piece = tuple[str, bool]  # (text, trained)


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def compile_chat_template(source: str, field: str) -> Any:
    """The sandboxed template; ``field`` (where the template came from) names it in errors."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    try:
        return environment.from_string(source)
    except TemplateError as e:
        raise ValueError(f"{field}: the chat template does not compile: {e}") from None


class ChatRendering:
    """Chat messages to text (and token ids) through the tokenizer's chat template, in the
    sandbox. ``section`` names the dataset's config fields in errors."""

    def __init__(self, tokenizer: BaseTokenizer, section: str = "training") -> None:
        self._tokenizer = tokenizer
        self._template = compile_chat_template(tokenizer.chat_template(), tokenizer.field)
        self._special_tokens = tokenizer.special_tokens()
        self._field = f"{section}.dataset_path"

    def text(
        self, messages: tuple[dict[str, str], ...], add_generation_prompt: bool, source: str
    ) -> str:
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
        except (
            Exception
        ) as e:  # a template is foreign code: any failure is a problem of the data or template
            raise ConfigError(
                f"{self._field}: {source}: the chat template of {self._tokenizer.field} "
                f"fails on this sample: {e}"
            ) from None

    def ids(
        self, messages: tuple[dict[str, str], ...], add_generation_prompt: bool, source: str
    ) -> list[int]:
        return self._tokenizer.encode_rendered(self.text(messages, add_generation_prompt, source))


class ChatEncoder:
    """Turns a ``ChatSample`` into tokens whose ``targets`` mark the assistant turns.

    A sample's first token is never trained: packed behind another sample or padding, it must
    not be predicted from them. ``section`` names the dataset's config fields in errors.
    """

    def __init__(self, tokenizer: BaseTokenizer, section: str = "training") -> None:
        self._tokenizer = tokenizer
        self._chat = ChatRendering(tokenizer, section)

    def __call__(self, sample: ChatSample) -> EncodedDocument:
        tokens: list[int] = []
        targets: list[bool] = []
        for text, trained in self.pieces(sample):
            ids = self._tokenizer.encode_rendered(text)
            tokens += ids
            targets += [trained] * len(ids)
        if targets:
            targets[0] = False
        return EncodedDocument(tokens, targets)

    def pieces(self, sample: ChatSample) -> list[Piece]:
        """The rendered sample cut into consecutive (text, trained) pieces."""
        pieces: list[Piece] = []
        rendered = ""
        for i, message in enumerate(sample.messages):
            assistant = message["role"] == "assistant"
            if assistant:  # the generation prompt before the answer is not trained
                text = self._extended(sample, rendered, i, add_generation_prompt=True)
                pieces.append((text[len(rendered) :], False))
                rendered = text
            text = self._extended(sample, rendered, i + 1, add_generation_prompt=False)
            pieces.append((text[len(rendered) :], assistant))
            rendered = text
        return pieces

    def _extended(
        self, sample: ChatSample, rendered: str, count: int, add_generation_prompt: bool
    ) -> str:
        """The text of the first ``count`` messages, which must extend ``rendered``."""
        text = self._chat.text(sample.messages[:count], add_generation_prompt, sample.source)
        if not text.startswith(rendered):
            raise ConfigError(
                f"{self._tokenizer.field}: the chat template does not render {sample.source} "
                f"turn by turn (its text for the first {count} messages does not extend its "
                "text for fewer); masking the prompt needs a template that does"
            )
        return text
