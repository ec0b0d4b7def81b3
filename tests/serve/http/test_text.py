"""``jaxattn.serve.http.text``: a token's text for logprobs is its decoding alone, each token
decoded once."""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers", reason="needs the [serve] extra (pip install -e \".[test]\")")


def test_token_text_is_each_token_decoded_alone_once(tmp_path):
    from jaxattn.serve.http.text import TextTokenizer
    from tests.serve.helpers import save_chat_checkpoint

    save_chat_checkpoint(tmp_path)
    tokenizer = TextTokenizer(tmp_path)
    vocab = tokenizer.tokenizer.get_vocab_size()
    ids = list(range(vocab)) + [0, vocab - 1, 7]
    decoded = [tokenizer.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert [tokenizer.token_text(t) for t in ids] == decoded
    assert [tokenizer.token_text(t) for t in ids] == decoded      # from the cache the second time
    assert len(tokenizer._token_texts) == vocab
