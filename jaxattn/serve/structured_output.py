"""Structured output: a request's tokens held to a JSON schema, any JSON object, a regular
expression, a list of choices or a Lark grammar, through llguidance (``pip install llguidance``,
part of the ``serve`` extra: a Rust library with no Python dependencies, no torch).

A request asks with ``SamplingParams(structured_outputs=StructuredOutputs(...))`` (vLLM's names) on
an ``Engine`` made with a ``GrammarCompiler`` of the model's tokenizer. The request then holds a
``Grammar``: the matcher of its grammar, advanced by its tokens as they reach the host. Before a
step the host fills, for each row that samples under a grammar, a bitmask of the tokens its
grammar allows next (``fill_masks``, llguidance's thread pool); the step sets the other tokens'
logits to -inf before it picks a token (``jaxattn.serve.sampling.mask_logits``). The request ends
("stop") when its grammar is complete and allows no more tokens.

A row's mask needs the row's previous token on the host, which the engine's overlap brings one
step late: a step with rows under a grammar is launched in two parts, the model's forward pass
(its rows' logits) and, once the tokens of the step before reached the host and advanced the
grammars, the pick of its tokens among the masks' (``jaxattn.serve.step``). The host fills the
masks while the GPU runs the forward pass, and such a request computes a token every step; steps
with no grammar row pick their tokens inside the step, as before, and upload no mask.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Grammar", "GrammarCompiler", "StructuredOutputs", "fill_masks", "mask_words"]

# JSON schemas are compiled with fixed separators and no free whitespace, as json.dumps writes
# JSON: a model cannot spend its tokens on whitespace (llguidance's default allows any), and the
# grammar of a schema with bounded strings and arrays is finite. A schema's "x-guidance" key
# overrides these (llguidance's JSON options).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Distinct grammars compiled and kept (a matcher per request is a copy of its grammar's).
COMPILED_GRAMMARS = 256


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """What a request's output must match (vLLM's ``StructuredOutputsParams``): exactly one of

    Attributes:
      json: a JSON schema (a dict, kept as its JSON text): the output is one JSON value it accepts.
      json_object: True: the output is one JSON object (OpenAI's ``{"type": "json_object"}``).
      regex: a regular expression (Rust's ``regex`` syntax) the whole output matches.
      choice: the output is one of these strings.
      grammar: a Lark grammar (llguidance's syntax, which also embeds JSON schemas and regexes).
    """

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json))
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise ValueError(f"StructuredOutputs: choice must be a non-empty list of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"StructuredOutputs: {name} must be None or a string, got {type(value).__name__}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"StructuredOutputs: json_object must be a bool, got {self.json_object!r}")
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] * self.json_object
        if len(given) != 1:
            raise ValueError(f"StructuredOutputs: exactly one of json, json_object, regex, choice, grammar must be "
                             f"set, got {given or 'none'}")

    def llguidance_grammar(self) -> str:
        """The grammar as llguidance's ``LLMatcher`` takes it."""
        from llguidance import LLMatcher

        if self.json is not None or self.json_object:
            schema = self.json if self.json is not None else '{"type": "object"}'
            try:
                return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except ValueError as err:
                raise ValueError(f"StructuredOutputs: json is not a JSON object: {err}") from None
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar)


class Grammar:
    """One request's grammar state: the tokens it allows next, advanced token by token."""

    def __init__(self, matcher: Any):
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advances past ``token``; returns whether the grammar is done: complete with no token
        allowed after it, or broken by a ``token`` it did not allow (the masks keep those out)."""
        self.matcher.consume_token(int(token))
        return self.matcher.is_stopped() or self.matcher.is_error()


class GrammarCompiler:
    """Compiles ``StructuredOutputs`` into ``Grammar``s over one tokenizer.

    Args:
      tokenizer_json: the model's ``tokenizer.json`` text (Hugging Face ``tokenizers``).
      vocab_size: the model's vocabulary (its logits), which may be larger than the tokenizer's:
        the ids past the tokenizer's are never allowed.
      eos_token_ids: the tokens that end a request: allowed where the grammar is complete.
    """

    def __init__(self, tokenizer_json: str, *, vocab_size: int, eos_token_ids: Sequence[int] = ()):
        try:
            import llguidance
        except ImportError as err:
            raise ImportError("structured output needs llguidance: pip install llguidance "
                              "(or jaxattn[serve])") from err
        if not (isinstance(vocab_size, int) and not isinstance(vocab_size, bool) and vocab_size >= 1):
            raise ValueError(f"GrammarCompiler: vocab_size must be an int >= 1, got {vocab_size!r}")
        if not isinstance(tokenizer_json, str):
            raise ValueError(f"GrammarCompiler: tokenizer_json must be the text of a tokenizer.json, got "
                             f"{type(tokenizer_json).__name__}")
        eos = [int(t) for t in eos_token_ids]
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos or None)
        self.vocab_size = vocab_size
        self._compiled = functools.lru_cache(maxsize=COMPILED_GRAMMARS)(self._compile)

    @classmethod
    def from_file(cls, path: str | pathlib.Path, *, vocab_size: int,
                  eos_token_ids: Sequence[int] = ()) -> "GrammarCompiler":
        """The compiler of the tokenizer in ``path`` (a ``tokenizer.json``)."""
        return cls(pathlib.Path(path).read_text(), vocab_size=vocab_size, eos_token_ids=eos_token_ids)

    def _compile(self, spec: StructuredOutputs) -> Any:
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, spec.llguidance_grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def grammar(self, spec: StructuredOutputs) -> Grammar:
        """A fresh ``Grammar`` of ``spec``; ValueError with llguidance's message when ``spec`` does
        not compile (an invalid schema, regex or grammar). A spec compiled before is copied."""
        if not isinstance(spec, StructuredOutputs):
            raise ValueError(f"GrammarCompiler.grammar: spec must be a StructuredOutputs, got {type(spec).__name__}")
        return Grammar(self._compiled(spec).deep_copy())


def mask_words(vocab_size: int) -> int:
    """int32 words of a row's token bitmask (bit ``t % 32`` of word ``t // 32``: token t allowed)."""
    return -(-vocab_size // 32)


@functools.cache
def _executor():
    import llguidance

    return llguidance.LLExecutor()


def fill_masks(rows: Sequence[tuple[Grammar, int]], masks: np.ndarray) -> None:
    """Writes into ``masks`` (int32[R, mask_words], C-contiguous) row i's bitmask of the tokens
    its grammar allows next, for each ``(grammar, i)`` in ``rows``, on llguidance's threads."""
    from llguidance.numpy import fill_next_token_bitmask_par

    if rows:
        fill_next_token_bitmask_par(_executor(), [(g.matcher, i) for g, i in rows], masks)
