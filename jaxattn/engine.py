"""A small continuous-batching generation engine over a paged KV cache: the loop.

The host loop admits requests, schedules chunked prefill and decodes, and releases finished
sequences (``jaxattn.scheduler``); each step packs the schedule and runs one jitted function of
(model weights, donated KV caches, donated page table) that frees finished sequences, allocates
pages, writes K/V, runs attention in every layer and samples the next tokens
(``jaxattn.engine_step``). The model is any ``jaxattn.models.base.PagedModel``.
"""

from __future__ import annotations

import collections
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxattn
from jaxattn.backends import OPS, check_serves
from jaxattn.checks import is_positive_int
from jaxattn.engine_step import make_engine_step, pack_step
from jaxattn.kv_cache import LAYOUTS
from jaxattn.models.base import ModelConfig, PagedModel
from jaxattn.sampling import SamplingParams
from jaxattn.scheduler import Request, Scheduler
from jaxattn.sharding import tensor_parallel_mesh

__all__ = ["Engine", "Request"]


def _shared_entropy() -> int:
    """Fresh entropy for the engine's request seeds, the same in every process of a
    ``jax.distributed`` job (process 0's), so every process samples the same tokens."""
    entropy = np.random.SeedSequence().entropy % 2**31      # int32: what JAX carries without x64
    if jax.process_count() > 1:
        entropy = int(multihost_utils.broadcast_one_to_all(np.int32(entropy)))
    return entropy


class Engine:
    """Generation for many requests with a fixed number of sequence slots (greedy unless a
    request's ``SamplingParams`` say otherwise).

    Args:
      model: the decoder, a ``jaxattn.models.base.PagedModel``: a ``Llama`` (KV pools) or a
        ``jaxattn.models.deepseek.DeepSeek`` (MLA latent pools).
      max_seqs: sequences in flight (the static batch B).
      max_seq_len: longest prompt + generation a request may have.
      page_size, layout, kv_dtype: KV cache shape; ``num_pages`` defaults to enough for
        ``max_seqs`` sequences of ``max_seq_len`` (it must hold at least one such sequence).
      chunk_size: prompt tokens per step (the mixed step has ``max_seqs + chunk_size`` tokens).
      backend: "auto" or one backend that runs every op of ``model.attention_ops`` (checked here).
      enable_prefix_caching: a request starts on the cached pages of its longest cached prompt
        prefix and prefills only the rest (see ``jaxattn.scheduler``).
      mesh: tensor parallelism over all the mesh's devices (``jaxattn.models.llama``'s docstring):
        the weights split by heads, MLP columns and vocabulary, the KV pools by KV heads, the page
        table replicated; the same jitted step then runs on every device, with XLA's all-reduces
        inside. Under ``jax.distributed`` (one process per GPU) every process runs the same engine
        with the same requests.

    Raises ValueError naming the argument that does not fit. ``stats`` counts prompt tokens,
    cached tokens, computed tokens, evicted pages and preemptions (``jaxattn.scheduler.Scheduler``).
    """

    def __init__(self, model: PagedModel, *, max_seqs: int, max_seq_len: int, page_size: int = 16,
                 num_pages: int | None = None, chunk_size: int = 256, backend: str = "auto",
                 layout: str = "HND", kv_dtype=None, enable_prefix_caching: bool = True,
                 mesh: Mesh | None = None):
        _check_model(model)
        check_serves(backend, model.attention_ops, where="Engine")
        for name, value in (("chunk_size", chunk_size), ("max_seqs", max_seqs), ("max_seq_len", max_seq_len),
                            ("page_size", page_size)):
            if not is_positive_int(value):
                raise ValueError(f"Engine: {name} must be an int >= 1, got {value!r}")
        if num_pages is not None and not is_positive_int(num_pages):
            raise ValueError(f"Engine: num_pages must be None or an int >= 1, got {num_pages!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"Engine: layout must be one of {LAYOUTS}, got {layout!r}")
        if kv_dtype is not None and not _is_dtype(kv_dtype):
            raise ValueError(f"Engine: kv_dtype must be None (the model's dtype) or a dtype, got {kv_dtype!r}")
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"Engine: enable_prefix_caching must be a bool, got {enable_prefix_caching!r}")
        if mesh is not None and not isinstance(mesh, Mesh):
            raise ValueError(f"Engine: mesh must be None or a jax.sharding.Mesh, got {type(mesh).__name__}")
        pages_per_seq = -(-max_seq_len // page_size)
        if num_pages is None:
            num_pages = 1 + max_seqs * pages_per_seq
        if num_pages < 1 + pages_per_seq:
            raise ValueError(f"Engine: num_pages must be >= {1 + pages_per_seq} (the null page and one sequence "
                             f"of max_seq_len={max_seq_len}), got {num_pages}")
        self.model = model
        self.max_seqs, self.max_seq_len, self.chunk_size, self.backend = max_seqs, max_seq_len, chunk_size, backend
        self.page_size = page_size
        self._step, self._weights = make_engine_step(model)
        self.caches = model.init_caches(num_pages, page_size, layout, kv_dtype, mesh=mesh)
        self.table = jaxattn.PageTable.create(num_pages, max_seqs, pages_per_seq, page_size)
        if mesh is not None:
            self._weights = jax.device_put(self._weights, jax.tree.leaves(model.param_shardings(mesh)))
            self.table = jax.device_put(self.table, NamedSharding(tensor_parallel_mesh(mesh)[0], PartitionSpec()))
        self.scheduler = Scheduler(max_seqs=max_seqs, num_pages=num_pages, page_size=page_size,
                                   chunk_size=chunk_size, enable_prefix_caching=enable_prefix_caching)
        # pages one step may allocate (rows of one page, plus the chunk's pages) or cache
        self._step_pages = max_seqs + chunk_size // page_size + 1
        self._next_id = 0
        self._seeds = np.random.default_rng(_shared_entropy())

    @property
    def stats(self) -> collections.Counter[str]:
        """prompt_tokens, cached_tokens, computed_tokens, evicted_pages, preemptions."""
        return self.scheduler.stats

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add_request(self, prompt, max_new_tokens: int, *, sampling: SamplingParams | None = None) -> Request:
        """Queues a request for up to ``max_new_tokens`` (an int >= 1) tokens after ``prompt`` (a
        non-empty 1-D sequence or array of int token ids in ``[0, vocab_size)``), picked as
        ``sampling`` says (default: greedy; its ``stop_token_ids`` end the request early).
        ValueError naming the argument that does not fit."""
        if not is_positive_int(max_new_tokens):
            raise ValueError(f"Engine.add_request: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        max_new_tokens = int(max_new_tokens)
        prompt = self._prompt_ids(prompt)
        if prompt.size + max_new_tokens > self.max_seq_len:
            raise ValueError(f"Engine.add_request: len(prompt) + max_new_tokens must be <= "
                             f"max_seq_len={self.max_seq_len}, got {prompt.size} + {max_new_tokens}")
        if sampling is None:
            sampling = SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"Engine.add_request: sampling must be a SamplingParams, got {type(sampling).__name__}")
        seed = int(self._seeds.integers(2**32)) if sampling.seed is None else sampling.seed
        request = Request(self._next_id, prompt, max_new_tokens, sampling, seed)
        self._next_id += 1
        self.scheduler.add(request)
        return request

    def _prompt_ids(self, prompt) -> np.ndarray:
        """``prompt`` as int32[L]; ValueError unless it is a non-empty 1-D sequence of ints in
        ``[0, vocab_size)`` (floats are not truncated, nested lists not flattened)."""
        try:
            ids = np.asarray(prompt)
        except ValueError:                           # ragged nesting
            ids = None
        if ids is None or ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            got = type(prompt).__name__ if ids is None else f"{ids.dtype}{list(ids.shape)}"
            raise ValueError(f"Engine.add_request: prompt must be a non-empty 1-D sequence of int token ids, "
                             f"got {got}")
        vocab_size = self.model.cfg.vocab_size
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"Engine.add_request: prompt token ids must be in [0, {vocab_size}) (the model's "
                             f"vocab_size), got ids from {ids.min()} to {ids.max()}")
        return ids.astype(np.int32)

    def step(self) -> list[Request]:
        """Runs one engine step; returns the requests that finished in it."""
        return [r for r, _ in self._step_tokens() if r.done]

    def stream(self) -> Iterator[tuple[Request, list[int]]]:
        """Steps until every request is done (including requests added meanwhile), yielding
        ``(request, new_tokens)`` for each request that got tokens, step by step; the last yield of
        a request has ``request.done`` set."""
        while self.has_work:
            yield from self._step_tokens()

    def run(self, on_step: Callable[[int, int], None] | None = None) -> list[Request]:
        """Steps until every request is done; ``on_step(done, total)`` after each step."""
        total = len(self.scheduler.waiting) + len(self.scheduler.running)
        done: list[Request] = []
        while self.has_work:
            done += self.step()
            if on_step:
                on_step(len(done), total)
        return sorted(done, key=lambda r: r.id)

    def _step_tokens(self) -> list[tuple[Request, list[int]]]:
        """One engine step -> the new tokens of each request that got some."""
        schedule = self.scheduler.schedule()
        inputs = pack_step(schedule, max_seqs=self.max_seqs, chunk_size=self.chunk_size, page_size=self.page_size,
                           max_pages_per_seq=self.table.max_pages_per_seq, step_pages=self._step_pages)
        next_tokens, ok, self.caches, self.table = self._step(
            self._weights, self.caches, self.table, inputs.release_ids, inputs.tokens, inputs.seq_ids,
            inputs.q_lens, inputs.sampling, inputs.prefix, max_q_len=inputs.max_q_len, backend=self.backend)
        next_tokens, ok = np.asarray(next_tokens), np.asarray(ok)
        if not ok[:len(schedule.rows)].all():
            raise RuntimeError("Engine: page allocation failed for a scheduled request (allocator bug)")
        return self.scheduler.complete(schedule, next_tokens, lambda: np.asarray(self.table.block_tables))


def _check_model(model) -> None:
    """ValueError unless ``model`` is an ``nnx.Module`` implementing ``PagedModel`` whose
    ``attention_ops`` are ops of ``jaxattn.backends.OPS``."""
    implements = isinstance(model, PagedModel) and isinstance(model.cfg, ModelConfig)
    if not isinstance(model, nnx.Module) or not implements:
        raise ValueError(f"Engine: model must be an nnx.Module implementing jaxattn.models.base.PagedModel "
                         f"(cfg.vocab_size, attention_ops, init_caches, forward_paged, logits, param_shardings), "
                         f"got {type(model).__name__}")
    ops = model.attention_ops
    if not isinstance(ops, tuple) or not ops or not set(ops) <= set(OPS):
        raise ValueError(f"Engine: model.attention_ops must be a non-empty tuple of ops from {OPS}, got {ops!r}")


def _is_dtype(value) -> bool:
    try:
        jnp.dtype(value)
    except TypeError:
        return False
    return True
