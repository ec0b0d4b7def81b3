"""The one chooser: which registered backend runs a call, for every op.

An explicit ``backend=`` runs that backend or raises ``ValueError`` naming it and why it cannot
take the call. ``auto`` walks the backends in ``ranking``'s order and takes the first that can run
here and take the call; the reference (``xla``) takes every valid call, so ``auto`` always finds one.

``ranking``: the backends that rank the call (``OpSupport.rank`` not None), by rank (ties in
registry order); then, when this GPU's measured choice table (``jaxattn.choice_table``) has an
entry near the call, the backends that entry measured are put in its measured order, in the places
they hold in the rank order, and the backends it did not measure keep their places (ranks [trtllm,
triton, xla], measured [triton, trtllm]: [triton, trtllm, xla]). A backend whose rank is None stays
out whatever the table says. Without a table for this GPU (and on CPU) or a near entry, the ranks
decide alone. The table orders plans (``"X"`` whole, ``"D+X"`` with the decodes split off to D);
``ranking`` reads each backend at its fastest plan (``choice_table.measured_order``), and whether
a ``paged_attention`` step splits its decodes off is read from the same entry when it timed both
plans, else a rule (``auto_route``).

``route`` is what a call runs: one backend, or for ``paged_attention`` under ``auto`` the leading
decodes of a mixed batch on one backend and the rest on another (``Route``); an ``mla_prefill`` call
under ``auto`` always serves its leading decodes absorbed, as ``mla_paged_attention`` on the backend
``auto`` picks for that op, and the rest expanded. ``jaxattn.plan`` asks
for it once per step; a call given bare metadata asks per call.

Choices use static information only (shapes, dtypes, options, ``meta.max_q_len``, what is
installed), and each distinct choice that skipped a backend is logged once with the reasons.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from jaxattn import backends, choice_table
from jaxattn.backends.base import NO_GPU, Call, gpu_devices

logger = logging.getLogger("jaxattn")
_logged: set[str] = set()


def choose(call: Call, backend: str = "auto") -> str:
    """The name of the backend that runs ``call``."""
    check_name(call.op, backend)
    if backend != "auto":
        reason = backends.check(backend, call)
        if reason is not None:
            raise ValueError(f"{call.op}: backend {backend!r} cannot take this call: {reason}")
        return backend
    skipped = []
    for name in ranking(call):
        reason = backends.check(name, call)
        if reason is None:
            if skipped and not gpu_devices():   # nothing to fix: the GPU backends cannot run here
                log_once(f"jaxattn auto ({call.op}): running the {name} backend: {NO_GPU}", logging.INFO)
            elif skipped:
                log_once(f"jaxattn auto ({call.op}): using {name!r}; " + "; ".join(skipped))
            return name
        skipped.append(f"{name} skipped ({reason})")
    raise ValueError(f"{call.op}: no backend takes this call: " + "; ".join(skipped))


def check_name(op: str, backend: str) -> None:
    """ValueError unless ``backend`` is "auto" or a backend that implements ``op``; the ops call it
    before any tracing, ``choose`` again on the shapes it gets."""
    if backend != "auto" and backend not in backends.names(op):
        raise ValueError(f"{op}: backend must be one of {('auto',) + backends.names(op)}, got {backend!r}")


def ranking(call: Call) -> list[str]:
    """The backends ``auto`` tries for ``call``, best first: ``rank_order`` with the backends the
    measured table knows in its order (module docstring)."""
    by_rank = rank_order(call)
    measured = choice_table.measured_order(call)
    return by_rank if measured is None else choice_table.reorder(by_rank, measured)


def rank_order(call: Call) -> list[str]:
    """The backends that rank ``call`` (``OpSupport.rank`` not None), lowest rank first, ties in
    registry order."""
    ranked = []
    for order, name in enumerate(backends.names(call.op)):
        rank = backends.REGISTRY[name].ops[call.op].rank(call)
        if rank is not None:
            ranked.append((rank, order, name))
    return [name for _, _, name in sorted(ranked)]


def log_once(message: str, level: int = logging.WARNING) -> None:
    """A record on the ``jaxattn`` logger (a warning by default), the first time this message comes."""
    if message not in _logged:
        _logged.add(message)
        logger.log(level, message)


@dataclasses.dataclass(frozen=True)
class Route:
    """The backends that run one call: ``decode`` serves the leading decodes of a mixed batch
    and ``main`` the rest; with ``decode=None``, ``main`` serves the whole batch."""

    main: str
    decode: str | None = None

    @property
    def label(self) -> str:
        """Its name in a measured choice table: ``"main"``, or ``"decode+main"`` when split."""
        return choice_table.plan_label(self.main, self.decode)

    def __str__(self) -> str:
        return self.main if self.decode is None else f"{self.decode} (decodes) + {self.main} (the rest)"


def route(call: Call, backend: str = "auto") -> Route:
    """The backends that run ``call``, from static information only.

    An explicit backend serves the whole call. ``auto`` takes ``choose``'s backend and, for a
    ``paged_attention`` call, ``auto_route`` decides whether the step's leading decodes go to another
    backend.
    """
    main = choose(call, backend)
    if backend != "auto":
        return Route(main)
    if call.op == "paged_attention":
        return auto_route(call, main)
    if call.op == "mla_prefill" and call.phase != "decode" and call.meta.batch_size > 1:
        # Decodes absorbed read each latent once for all heads; expanded, their whole contexts'
        # K and V of every head would be written and read back (the bulk of a mixed step's work).
        return Route(main, choose(decode_call(call), "auto"))
    return Route(main)


def auto_route(call: Call, main: str) -> Route:
    """The route ``auto`` takes for a ``paged_attention`` call once it chose ``main`` for it:
    ``split_route``'s when there is one and the measured table does not have ``main`` whole
    before it, else ``main`` whole. The nearest entry of this GPU's table decides when it timed both
    (``choice_table.measured_split``); otherwise (no table, no near entry, a table of plain
    backend names) the split is taken: the rule."""
    split = split_route(call, main)
    if split is None or choice_table.measured_split(call, main, split.decode) is False:
        return Route(main)
    return split


def split_route(call: Call, main: str) -> Route | None:
    """The split route ``auto`` weighs against ``main`` whole for a ``paged_attention`` call: in a
    step that is not decode-only, the leading decodes to the backend ``auto`` picks for a
    decode-only step, when that is another backend and the step is a prefill step (``meta.max_q_len``
    None or above ``SPEC_DECODE_MAX_Q_LEN``) or ``main`` does not rank decodes (cudnn); None when
    there is none (a speculative-decode kernel serves its step whole; a call of one sequence, which
    is a decode or a prefill, never both, so a split only adds an empty launch)."""
    if call.phase == "decode" or call.meta.batch_size == 1:
        return None
    decodes = decode_call(call)
    decode = choose(decodes, "auto")
    main_takes_decodes = backends.REGISTRY[main].ops[call.op].rank(decodes) is not None
    split = decode != main and (call.phase == "prefill" or not main_takes_decodes)
    return Route(main, decode) if split else None


def decode_call(call: Call) -> Call:
    """``call``'s leading decodes as a decode-only call: the first ``min(T, B)`` query tokens (decode
    b is token b), ``meta.max_q_len`` 1; an ``mla_prefill`` call's as the ``mla_paged_attention``
    call that serves them absorbed (``q_latent`` ``[., Hq, R]``, ``q_rope`` ``[., Hq, Dr]``)."""
    num_tokens, num_q_heads, head_dim = call.q.shape
    rows = min(num_tokens, call.meta.batch_size)
    meta = dataclasses.replace(call.meta, max_q_len=1)
    if call.op == "mla_prefill":
        def part(width: int) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct((rows, num_q_heads, width), call.q.dtype)

        return dataclasses.replace(call, op="mla_paged_attention", q=part(call.cache.kv_lora_rank),
                                   q_rope=part(call.cache.rope_dim), w_uv=None, meta=meta)
    q = jax.ShapeDtypeStruct((rows, num_q_heads, head_dim), call.q.dtype)
    return dataclasses.replace(call, q=q, meta=meta)
