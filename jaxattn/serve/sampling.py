"""Next-token sampling inside the jitted engine step: temperature, top-k, top-p, per-request seeds.

Every parameter is a per-row array, so one compiled step serves any mix of greedy and sampled
requests. Randomness comes from ``fold_in(key(seed), position)``: a request's tokens depend on its
seed and its own tokens only, never on what else is in the batch (or on being preempted and
recomputed). Top-k and top-p find their cut-off by a radix search over the bits of the values
(eight passes of 16 candidate thresholds) rather than a sort over the vocabulary: straight-line
code that GPU command buffers capture, with no O(V log V) sort per row. On the CPU, where that
search costs more than the model for a large vocabulary, conditionals skip it (and the sampling
altogether) when no row of the step needs it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.checks import INT32_MAX, is_int, is_positive_float32, is_real
from jaxattn.serve.structured_output import StructuredOutputs

# Temperatures below this are greedy (as vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5
# The most alternatives a token's logprobs list (OpenAI's bound, vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# The most stop tokens a request with min_tokens holds back (a step's banned tokens per row).
MAX_BANNED = 128
# A banned-token slot that bans nothing (an index past any vocabulary: the scatter drops it).
_NO_TOKEN = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a request picks its tokens (names as vLLM's ``SamplingParams``).

    Attributes:
      temperature: 0 (the default, unlike vLLM's 1.0) is greedy: the argmax of the logits.
      top_k: keep the k most likely tokens (ties with the k-th are kept too); 0 or -1: all.
      top_p: keep the smallest set of most likely tokens whose probability reaches top_p (after
        top-k), in (0, 1]; 1: all.
      seed: the request's random stream, an int in [0, 2**32); None: the engine draws one.
      stop_token_ids: the request ends when it generates one of these; the stop token is the last
        token of its output (as in vLLM's ``token_ids``).
      min_tokens: the request generates no stop token before it has this many output tokens (its
        stop tokens are masked out of the logits until then, as vLLM's; at most ``MAX_BANNED``
        stop tokens with it).
      logprobs: None, or report each generated token's log-probability and the ``logprobs`` most
        likely alternatives (0 to ``MAX_LOGPROBS``), from the model's own distribution (the
        log-softmax of the logits, before temperature, top-k and top-p: vLLM's default).
      structured_outputs: None, or what the output must match (``jaxattn.serve.structured_output``;
        the engine needs a ``GrammarCompiler``): tokens its grammar does not allow are never picked.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self):
        if not (is_real(self.temperature) and (self.temperature == 0 or is_positive_float32(self.temperature))):
            raise ValueError(f"SamplingParams: temperature must be a finite number >= 0, got {self.temperature!r} "
                             f"(finite in float32)")
        if not is_int(self.top_k) or not -1 <= self.top_k < 2**31:
            raise ValueError(f"SamplingParams: top_k must be an int in [-1, 2**31) (0 or -1: all tokens), "
                             f"got {self.top_k!r}")
        if not (is_positive_float32(self.top_p) and self.top_p <= 1):
            raise ValueError(f"SamplingParams: top_p must be a number in (0, 1], got {self.top_p!r} (above 0 in "
                             f"float32)")
        if self.seed is not None and not (is_int(self.seed) and 0 <= self.seed < 2**32):
            raise ValueError(f"SamplingParams: seed must be None or an int in [0, 2**32), got {self.seed!r}")
        stop = tuple(self.stop_token_ids) if isinstance(self.stop_token_ids, (list, tuple)) else None
        if stop is None or not all(is_int(t) and 0 <= t <= INT32_MAX for t in stop):
            raise ValueError(f"SamplingParams: stop_token_ids must be ints >= 0 (a list or tuple, below 2**31), got "
                             f"{self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"SamplingParams: min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.min_tokens and len(stop) > MAX_BANNED:
            raise ValueError(f"SamplingParams: min_tokens holds back at most {MAX_BANNED} stop_token_ids, got "
                             f"{len(stop)}")
        if self.logprobs is not None and not (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"SamplingParams: logprobs must be None or an int in [0, {MAX_LOGPROBS}], "
                             f"got {self.logprobs!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError(f"SamplingParams: structured_outputs must be None or a StructuredOutputs, got "
                             f"{type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of one step (B rows), as device arrays.

    Attributes:
      temperature: float32[B]; below ``GREEDY_TEMPERATURE``: greedy.
      top_k: int32[B]; <= 0: all tokens.
      top_p: float32[B].
      seed: uint32[B].
      banned: int32[B, MAX_BANNED], token ids each row may not take (its stop tokens while it has
        fewer than ``min_tokens`` outputs), padded with an id past the vocabulary; None: none.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    banned: jax.Array | None = None

    @classmethod
    def from_params(cls, params: list[SamplingParams | None], seeds: list[int],
                    generated: list[int] | None = None) -> "SamplingBatch":
        """Host arrays for rows with ``params`` (None: a padding row, greedy) and resolved ``seeds``;
        ``generated``: each row's output tokens before the one it samples (for ``min_tokens``;
        None: every row is past it)."""
        rows = [p or SamplingParams() for p in params]
        banned = np.full((len(rows), MAX_BANNED), _NO_TOKEN, np.int32)
        for i, (p, count) in enumerate(zip(rows, generated or [])):
            if count < p.min_tokens:
                banned[i, :len(p.stop_token_ids)] = p.stop_token_ids
        return cls(temperature=np.asarray([p.temperature for p in rows], np.float32),
                   top_k=np.asarray([p.top_k for p in rows], np.int32),
                   top_p=np.asarray([p.top_p for p in rows], np.float32),
                   seed=np.asarray(seeds, np.uint32), banned=banned)


def sample(logits: jax.Array, params: SamplingBatch, positions: jax.Array) -> jax.Array:
    """int32[B]: the next token of each row.

    Args:
      logits: [B, V] (any float dtype; computed in float32).
      params: the rows' sampling parameters.
      positions: int32[B], the position the sampled token takes in its sequence: with the seed,
        it picks the row's random numbers.
    """
    logits = logits.astype(jnp.float32)
    if params.banned is not None:
        rows = jnp.arange(logits.shape[0])[:, None]
        logits = logits.at[rows, params.banned].set(-jnp.inf, mode="drop")
    greedy = params.temperature < GREEDY_TEMPERATURE
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = _unless(jnp.all(greedy), lambda: _sample(logits, params, positions), lambda: greedy_tokens)
    return jnp.where(greedy, greedy_tokens, sampled)


def mask_logits(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """``logits`` [B, V] with -inf where a row's token is not allowed: ``allowed`` int32[B,
    ceil(V / 32)] is a bitmask per row, bit ``t % 32`` of word ``t // 32`` for token t
    (``jaxattn.serve.structured_output.fill_masks``; all ones: every token). ValueError unless
    ``allowed`` is int32 of that shape."""
    rows, vocab = logits.shape
    if allowed.dtype != jnp.int32 or allowed.shape != (rows, -(-vocab // 32)):
        raise ValueError(f"mask_logits: allowed must be int32[{rows}, {-(-vocab // 32)}] (a bitmask per row of "
                         f"logits [{rows}, {vocab}]), got {allowed.dtype}{list(allowed.shape)}")
    bits = jax.lax.shift_right_logical(allowed[:, :, None], jnp.arange(32, dtype=jnp.int32)[None, None, :]) & 1
    keep = bits.reshape(allowed.shape[0], -1)[:, :logits.shape[-1]].astype(bool)
    return jnp.where(keep, logits, -jnp.inf)


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The model's log-probabilities (log-softmax of the logits in float32) of ``tokens`` int32[B]
    and of each row's ``MAX_LOGPROBS`` most likely tokens: ``(float32[B], top ids int32[B, K],
    their log-probabilities float32[B, K])``, K = min(MAX_LOGPROBS, V), most likely first."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top_logprobs, top_ids = _top_k(logprobs, min(MAX_LOGPROBS, logits.shape[-1]))
    return chosen, top_ids, top_logprobs


def _top_k(x: jax.Array, k: int, block: int = 128) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)`` of float32 ``x`` [B, V] (values, int32 ids), exactly, in two small
    top-k's instead of one over V: each of the k largest values lies in one of the k blocks of
    ``block`` values with the largest maxima. (XLA's GPU TopK kernel is built for k up to 16,
    ``xla/service/gpu/kernels/topk_kernel*.cu.cc``; a larger k sorts whole rows. Not yet timed.)"""
    rows, vocab = x.shape
    if vocab <= k * block:
        values, ids = jax.lax.top_k(x, k)
        return values, ids.astype(jnp.int32)
    blocks = jnp.pad(x, ((0, 0), (0, -vocab % block)), constant_values=-jnp.inf).reshape(rows, -1, block)
    _, best = jax.lax.top_k(jnp.max(blocks, axis=-1), k)                               # [B, k] block ids
    candidates = jnp.take_along_axis(blocks, best[:, :, None], axis=1).reshape(rows, k * block)
    values, at = jax.lax.top_k(candidates, k)
    ids = jnp.take_along_axis(best, at // block, axis=1) * block + at % block
    return values, ids.astype(jnp.int32)


def _sample(logits: jax.Array, params: SamplingBatch, positions: jax.Array) -> jax.Array:
    return gumbel_argmax(filtered_logits(logits, params), params.seed, positions)


def filtered_logits(logits: jax.Array, params: SamplingBatch) -> jax.Array:
    """float32 ``logits`` [B, V] divided by each row's temperature, -inf outside its top-k and
    top-p: the softmax of the result is the distribution a sampled row draws from (its stop
    tokens banned by the caller)."""
    vocab = logits.shape[-1]
    scaled = logits.astype(jnp.float32) / jnp.maximum(params.temperature, GREEDY_TEMPERATURE)[:, None]

    def top_k(scaled):
        k = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, vocab), vocab)
        keys = _sortable(scaled)
        return jnp.where(keys >= _threshold(keys, jnp.ones_like(scaled), k.astype(jnp.float32))[:, None],
                         scaled, -jnp.inf)

    def top_p(scaled):
        probs = jax.nn.softmax(scaled, axis=-1)
        keys = _sortable(probs)
        cut = _threshold(keys, probs, params.top_p * jnp.sum(probs, axis=-1))
        return jnp.where((keys >= cut[:, None]) | (params.top_p[:, None] >= 1.0), scaled, -jnp.inf)

    scaled = _unless(jnp.all((params.top_k <= 0) | (params.top_k >= vocab)), lambda: top_k(scaled), lambda: scaled)
    return _unless(jnp.all(params.top_p >= 1.0), lambda: top_p(scaled), lambda: scaled)


def gumbel_argmax(scaled: jax.Array, seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """int32[B]: a draw from each row's ``softmax(scaled)`` [B, V] (the Gumbel-max trick), its
    noise from ``fold_in(key(seed), position)``: a token's draw depends on its request's seed and
    its position only."""
    vocab = scaled.shape[-1]

    def gumbel(seed, position):
        return jax.random.gumbel(jax.random.fold_in(jax.random.key(seed), position), (vocab,), jnp.float32)

    noise = jax.vmap(gumbel)(seeds, positions)
    return jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)


def _unless(skip: jax.Array, compute, skipped):
    """``compute()``, which equals ``skipped()`` when ``skip`` holds. On the CPU a conditional skips
    the work; elsewhere it always runs, as straight-line code that GPU command buffers capture."""
    return jax.lax.platform_dependent(cpu=lambda: jax.lax.cond(skip, skipped, compute), default=compute)


def _sortable(x: jax.Array) -> jax.Array:
    """uint32 keys of float32 ``x`` in the same order as the values (-inf lowest)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _threshold(keys: jax.Array, weights: jax.Array, target: jax.Array) -> jax.Array:
    """uint32[B]: per row, the largest t with ``sum(weights[keys >= t]) >= target`` (t = 0 when
    no t > 0 qualifies), found 4 bits at a time from the top: 8 passes over [B, V], each summing
    the weights above 16 candidate thresholds."""
    digits = jnp.arange(16, dtype=jnp.uint32)
    prefix = jnp.zeros(keys.shape[:1], jnp.uint32)
    for shift in range(28, -1, -4):
        candidates = prefix[:, None] + (digits << shift)[None, :]                       # [B, 16]
        above = keys[:, None, :] >= candidates[:, :, None]                             # [B, 16, V]
        mass = jnp.sum(jnp.where(above, weights[:, None, :], 0.0), axis=2)             # [B, 16]: row reductions
        best = jnp.max(jnp.where(mass >= target[:, None], digits[None, :], 0), axis=1)
        prefix = prefix + (best << shift)
    return prefix
