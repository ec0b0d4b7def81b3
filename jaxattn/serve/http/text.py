"""Text for the HTTP server: a checkpoint's tokenizer files, its chat template, and incremental
detokenization with OpenAI's ``stop`` strings.

The tokenizer is ``tokenizer.json`` (the ``tokenizers`` package); ``tokenizer_config.json`` gives
the BOS/EOS tokens and the chat template (or ``chat_template.jinja`` beside it), rendered with
Jinja as transformers' ``apply_chat_template`` renders it; ``generation_config.json`` adds its
``eos_token_id`` to the stop tokens.
"""

from __future__ import annotations

import datetime
import functools
import json
import pathlib
from collections.abc import Sequence

__all__ = ["ChatTemplateError", "TextStream", "TextTokenizer"]

# Prompt tokens decoded before the first output token, for its leading space and merges (as vLLM).
_CONTEXT_TOKENS = 5


class ChatTemplateError(ValueError):
    """The chat template refused the messages (its ``raise_exception``) or failed to render them."""


def _token_text(value) -> str | None:
    """A tokenizer_config.json special token: a string or an AddedToken dict ({"content": ...})."""
    return value.get("content") if isinstance(value, dict) else value


def _read_json(path: pathlib.Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


class TextTokenizer:
    """A checkpoint directory's tokenizer: encode, decode, chat template, stop token ids."""

    def __init__(self, directory: str | pathlib.Path):
        from tokenizers import Tokenizer

        directory = pathlib.Path(directory)
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config = _read_json(directory / "tokenizer_config.json")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template_file = directory / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        if isinstance(template, list):             # named templates: the default one
            template = {t["name"]: t["template"] for t in template}.get("default")
        self.chat_template: str | None = template
        eos_ids = _read_json(directory / "generation_config.json").get("eos_token_id")
        eos_ids = [] if eos_ids is None else [eos_ids] if isinstance(eos_ids, int) else list(eos_ids)
        if self.eos_token is not None and (token_id := self.tokenizer.token_to_id(self.eos_token)) is not None:
            eos_ids.append(token_id)
        self.stop_token_ids: tuple[int, ...] = tuple(sorted(set(eos_ids)))
        self._token_texts: dict[int, str] = {}        # token_text's, at most one per vocabulary entry

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it tokenizes (encode holds it): a long prompt
        # tokenized in a worker thread then leaves the server's event loop free.
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token's text alone (a special token's too), for logprobs; each token decoded once
        (a logprobs stream asks for 1 + top_logprobs texts per token, on the event loop)."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    @functools.cached_property
    def _template(self):
        """The chat template compiled as transformers compiles it (a sandbox, its globals)."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise ChatTemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
        return env.from_string(self.chat_template)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The chat template applied to ``messages`` (and ``tools``, OpenAI's tool dicts) with the
        generation prompt; ValueError without a template, ChatTemplateError when the template
        refuses or fails on the messages."""
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template: use /v1/completions")
        try:
            return self._template.render(messages=messages, tools=tools, add_generation_prompt=True,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except ChatTemplateError:
            raise
        except Exception as err:                    # the messages broke the template (jinja2 or a TypeError)
            raise ChatTemplateError(f"the chat template failed on these messages: {type(err).__name__}: "
                                    f"{err}") from err

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of the rendered chat (its special tokens come from the template, as in
        transformers' ``apply_chat_template``)."""
        return self.encode(self.render_chat(messages, tools), add_special_tokens=False)


class TextStream:
    """A request's output text as tokens arrive: incremental detokenization (a token that ends
    inside a multi-byte character waits for the next), cut at the first of ``stop`` strings
    that appears once ``min_tokens`` tokens have come (vLLM's: no stop before them).

    ``add(ids)`` takes new tokens; ``take(final)`` returns the text not yet taken, holding back
    the end that could still begin a stop string unless ``final``. ``stopped`` is set once a stop
    string appeared (the text ends before it, and later tokens are ignored).
    """

    def __init__(self, tokenizer: TextTokenizer, prompt: Sequence[int], stop: Sequence[str] = (),
                 min_tokens: int = 0):
        self.tokenizer, self.stop, self.min_tokens = tokenizer, tuple(stop), min_tokens
        self._count = 0                             # tokens added
        self._ids = list(prompt[-_CONTEXT_TOKENS:])
        self._prefix, self._read = 0, len(self._ids)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text, self._taken, self.stopped = "", 0, False

    def add(self, ids: Sequence[int]) -> None:
        if self.stopped or not ids:
            return
        self._ids += ids
        self._count += len(ids)
        before = self.tokenizer.decode(self._ids[self._prefix:self._read])
        after = self.tokenizer.decode(self._ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return
        start = max(len(self.text) - self._holdback, 0)
        self.text += after[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        if self._count < self.min_tokens:
            return
        cuts = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if cuts:
            self.text, self.stopped = self.text[:min(cuts)], True

    def take(self, final: bool = False) -> str:
        end = len(self.text) if final or self.stopped else max(len(self.text) - self._holdback, self._taken)
        out, self._taken = self.text[self._taken:end], end
        return out
