"""Speculative decoding inside the engine step: the configuration, the n-gram and oracle
drafters and the verification of draft tokens (a draft model's drafts: ``jaxattn.serve.step``).

A speculating decode row computes its pending token and K draft tokens in one step (``q_len = K +
1``, the spec-decode attention path); the logits of those K + 1 tokens decide how many drafts are
kept (``verify_drafts``): greedy rows keep the longest prefix of drafts equal to the model's argmax,
sampled rows keep draft i with probability ``p_i(draft)`` and, at the first rejection, draw from
``p_i`` without the draft (rejection sampling with a one-token draft distribution, Leviathan et
al. 2023), so their tokens follow the model's distribution exactly. Either way the row gains the
kept drafts and one token drawn by the model.

Drafts are proposed on the device, in the step that samples the token before them
(``ngram_drafts``: prompt lookup over each sequence's own tokens; or a draft model's greedy
tokens), so the host never waits for a token to draft the next step: the overlapped loop
schedules step n+1 while step n runs, as without speculation.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp

from jaxattn.checks import is_int
from jaxattn.serve.sampling import GREEDY_TEMPERATURE, SamplingBatch, filtered_logits, gumbel_argmax

__all__ = ["SpeculativeConfig", "ngram_drafts", "oracle_drafts", "verify_drafts", "MAX_SPECULATIVE_TOKENS"]

# Drafts per step at most: a verify row has K + 1 tokens, and the spec-decode kernels take up to 16.
MAX_SPECULATIVE_TOKENS = 15
# The longest n-gram matched: the step's search is unrolled over n, so its compile time grows with
# it (on CPU, 14.5 s to a first token at 16, 22 s at 64, 365 s at 256).
MAX_PROMPT_LOOKUP = 64
METHODS = ("ngram", "draft_model", "oracle")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates (vLLM's ``speculative_config`` names).

    Attributes:
      method: "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence of the
        sequence's last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``),
        "draft_model" (``model``'s greedy tokens: a smaller model of the same vocabulary, run in
        the step over its own caches in the engine's page table), or "oracle", for benchmarks and
        tests: the drafts are the tokens a request was given ahead of time
        (``Request.draft_oracle``, what follows its prompt), e.g. the model's own greedy
        continuation (every draft kept: speculation's upper bound) or tokens it never picks (none
        kept: its overhead).
      num_speculative_tokens: drafts per step, K in [1, ``MAX_SPECULATIVE_TOKENS``].
      prompt_lookup_max, prompt_lookup_min: the longest and shortest n-gram matched (vLLM's
        defaults: both 5 when neither is given, else the one given for the other).
      model: the draft model of "draft_model" (required there, refused elsewhere): a local Hugging
        Face checkpoint directory or a preset name of ``jaxattn.serve.models.llama`` (random weights:
        benchmarks), loaded by the ``Engine`` (which also takes the module itself).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"SpeculativeConfig: method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.model, str | None):
            raise ValueError(f"SpeculativeConfig: model must be a str (a checkpoint directory or a preset name), "
                             f"got {type(self.model).__name__}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(f"SpeculativeConfig: model must be a checkpoint directory or preset name with method "
                             f"\"draft_model\" and None otherwise, got {self.model!r} with {self.method!r}")
        k = self.num_speculative_tokens
        if not (is_int(k) and 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(f"SpeculativeConfig: num_speculative_tokens must be an int in [1, "
                             f"{MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lookup_max, lookup_min = self.prompt_lookup_max, self.prompt_lookup_min
        for name, value in (("prompt_lookup_max", lookup_max), ("prompt_lookup_min", lookup_min)):
            if value is not None and not (is_int(value) and 1 <= value <= MAX_PROMPT_LOOKUP):
                raise ValueError(f"SpeculativeConfig: {name} must be None or an int >= 1, got {value!r} (at most "
                                 f"{MAX_PROMPT_LOOKUP})")
        if lookup_max is None and lookup_min is None:
            lookup_max = lookup_min = 5
        lookup_max = lookup_min if lookup_max is None else lookup_max
        lookup_min = lookup_max if lookup_min is None else lookup_min
        if lookup_min > lookup_max:
            raise ValueError(f"SpeculativeConfig: prompt_lookup_min must be <= prompt_lookup_max, got "
                             f"{lookup_min} > {lookup_max}")
        object.__setattr__(self, "prompt_lookup_max", int(lookup_max))
        object.__setattr__(self, "prompt_lookup_min", int(lookup_min))

    @classmethod
    def parse(cls, value: Any) -> "SpeculativeConfig":
        """A ``SpeculativeConfig`` from itself, a dict or its JSON text (``--speculative-config``);
        ValueError naming an unknown or bad field."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"SpeculativeConfig: not valid JSON: {err}") from None
        if not isinstance(value, dict):
            raise ValueError(f"SpeculativeConfig: expected a dict (or its JSON text), got {type(value).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields, key=str)
        if unknown:
            raise ValueError(f"SpeculativeConfig: unknown field(s) {unknown}; the fields are {sorted(fields)}")
        if "method" not in value:
            raise ValueError(f"SpeculativeConfig: method is required (one of {METHODS})")
        return cls(**value)

    @property
    def num_drafts(self) -> int:
        return self.num_speculative_tokens


def ngram_drafts(history: jax.Array, lengths: jax.Array, *, num_drafts: int, min_n: int, max_n: int) -> jax.Array:
    """int32[B, num_drafts]: prompt-lookup drafts for sequences whose tokens are ``history[b,
    :lengths[b]]`` (int32[B, C]).

    The longest suffix of n tokens (``min_n <= n <= max_n``) that occurred earlier is matched at
    its latest earlier occurrence, and the drafts are the tokens that followed it, continued
    periodically past the end of the sequence (a repeating text keeps its period). With no match
    the drafts repeat the last token (they cost a verify row and are likely rejected)."""
    rows, capacity = history.shape
    pos = jnp.arange(capacity, dtype=jnp.int32)[None, :]
    lengths = lengths[:, None]
    # suffix[:, i]: the i-th token from the end
    suffix = jnp.take_along_axis(history, jnp.maximum(lengths - 1 - jnp.arange(max_n)[None, :], 0), axis=1)
    run = jnp.ones((rows, capacity), bool)
    matched = jnp.zeros((rows, capacity), jnp.int32)     # at j: the match length of tokens ending at j - 1
    for i in range(max_n):
        before = jnp.pad(history, ((0, 0), (1 + i, 0)))[:, :capacity]                    # history[:, j - 1 - i]
        run &= (pos >= 1 + i) & (before == suffix[:, i:i + 1]) & (i < lengths)
        matched += run
    candidate = (pos < lengths) & (matched >= min_n)      # j = length would match the suffix itself
    score = jnp.where(candidate, matched * capacity + pos, -1)
    start = jnp.argmax(score, axis=1).astype(jnp.int32)[:, None]
    period = jnp.maximum(lengths - start, 1)
    drafts = jnp.take_along_axis(history, start + jnp.arange(num_drafts)[None, :] % period, axis=1)
    last = jnp.take_along_axis(history, jnp.maximum(lengths - 1, 0), axis=1)
    return jnp.where(jnp.max(score, axis=1, keepdims=True) >= 0, drafts, last).astype(jnp.int32)


def oracle_drafts(history: jax.Array, lengths: jax.Array, *, num_drafts: int) -> jax.Array:
    """int32[B, num_drafts]: the tokens stored in ``history`` (int32[B, C]) right after each
    sequence's ``lengths[b]`` tokens (0 past C): an "oracle" drafter's, whose history was seeded
    with the tokens to come."""
    capacity = history.shape[1]
    at = lengths[:, None] + jnp.arange(num_drafts)[None, :]
    return jnp.where(at < capacity, jnp.take_along_axis(history, jnp.minimum(at, capacity - 1), axis=1), 0)


def verify_drafts(logits: jax.Array, drafts: jax.Array, speculating: jax.Array, sampling: SamplingBatch | None,
                  positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Verifies each row's ``drafts`` (int32[R, K]) against ``logits`` [R, K + 1, V], the model's
    logits after the row's pending token and after each draft.

    Args:
      speculating: bool[R]; the other rows keep no draft and draw their token from ``logits[:, K]``
        exactly as ``sampling.sample`` does.
      sampling: the rows' sampling parameters (None: greedy).
      positions: int32[R, K + 1], the position of the token each logits row picks (with the
        seed, its random numbers: a position's numbers are used once, in the step that decides it).

    Returns:
      ``(tokens int32[R, K + 1], accepted int32[R], next_tokens int32[R])``: a row gains
      ``tokens[:accepted + 1]``, its ``accepted`` kept drafts then ``next_tokens``, the model's.
    """
    rows, width, vocab = logits.shape
    k = width - 1
    flat = logits.reshape(rows * width, vocab).astype(jnp.float32)
    if sampling is not None and sampling.banned is not None:
        banned = jnp.repeat(sampling.banned, width, axis=0)
        flat = flat.at[jnp.arange(rows * width)[:, None], banned].set(-jnp.inf, mode="drop")
    best = jnp.argmax(flat, axis=-1).astype(jnp.int32).reshape(rows, width)
    accept = drafts == best[:, :k]
    choice = best
    if sampling is not None:
        params = jax.tree.map(lambda x: jnp.repeat(x, width, axis=0), dataclasses.replace(sampling, banned=None))
        scaled = filtered_logits(flat, params)
        probs = jax.nn.softmax(scaled, axis=-1).reshape(rows, width, vocab)
        p_draft = jnp.take_along_axis(probs[:, :k], drafts[:, :, None], axis=2)[:, :, 0]

        def uniform(seed, position):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), position), 1)
            return jax.random.uniform(key, (), jnp.float32)

        u = jax.vmap(uniform)(params.seed, positions.reshape(-1)).reshape(rows, width)
        # at a rejection the token comes from p without the draft; after the last draft, from p
        excluded = jnp.concatenate([drafts, jnp.full((rows, 1), vocab, jnp.int32)], axis=1).reshape(-1)
        scaled = scaled.at[jnp.arange(rows * width), excluded].set(-jnp.inf, mode="drop")
        drawn = gumbel_argmax(scaled, params.seed, positions.reshape(-1)).reshape(rows, width)
        greedy = (sampling.temperature < GREEDY_TEMPERATURE)[:, None]
        accept = jnp.where(greedy, accept, u[:, :k] < p_draft)
        choice = jnp.where(greedy, best, drawn)
    accept |= ~speculating[:, None]                       # the others pick after the last position
    kept = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    next_tokens = jnp.take_along_axis(choice, kept[:, None], axis=1)[:, 0]
    accepted = jnp.where(speculating, kept, 0)
    drafts_then_next = jnp.concatenate([drafts, jnp.zeros((rows, 1), jnp.int32)], axis=1)
    tokens = jnp.where(jnp.arange(width)[None, :] < accepted[:, None], drafts_then_next, next_tokens[:, None])
    return tokens, accepted, next_tokens
