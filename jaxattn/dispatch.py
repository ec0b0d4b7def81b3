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
plans, else a rule (``jaxattn.attention.auto_plan``).

Choices use static information only (shapes, dtypes, options, ``meta.max_q_len``, what is
installed), and each distinct choice that skipped a backend is logged once with the reasons.
"""

from __future__ import annotations

import logging

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
