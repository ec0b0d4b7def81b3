"""OpenAI's ``logprobs`` objects of generated tokens (``scheduler.TokenLogprobs`` entries, one per
token id): the completions form (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``)
and the chat form (``content[*]``: ``token``, ``logprob``, ``bytes``, ``top_logprobs``).

A token's text is the tokenizer's decoding of it alone (special tokens included; a piece of a
multi-byte character decodes to U+FFFD, its ``bytes`` are those of that text, as vLLM's); without a
tokenizer it is ``"token_id:<id>"`` (vLLM's ``return_tokens_as_token_ids`` spelling).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jaxattn.serve.scheduler import TokenLogprobs

__all__ = ["TokenText", "chat_logprobs", "completion_logprobs", "token_id_text"]

TokenText = Callable[[int], str]


def token_id_text(token: int) -> str:
    return f"token_id:{token}"


def completion_logprobs(ids: Sequence[int], entries: Sequence[TokenLogprobs], token_text: TokenText,
                        offset: int) -> dict:
    """The completions ``logprobs`` of ``ids`` whose text starts ``offset`` characters into the
    choice's text."""
    tokens = [token_text(token) for token in ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [{token_text(token): logprob for token, logprob in entry.top} for entry in entries],
            "text_offset": offsets}


def chat_logprobs(ids: Sequence[int], entries: Sequence[TokenLogprobs], token_text: TokenText) -> dict:
    """The chat ``logprobs`` (``{"content": [...]}``) of ``ids``."""
    def item(token: int, logprob: float) -> dict:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(token, entry.logprob), "top_logprobs": [item(t, lp) for t, lp in entry.top]}
                        for token, entry in zip(ids, entries)]}
