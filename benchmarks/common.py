"""Shared by the benchmarks: the standard paged problem, error and device helpers, and the writer
of benchmarks/RESULTS.md, one file with a marked section per benchmark."""

from __future__ import annotations

import dataclasses
import glob
import os
import subprocess
import tempfile
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn

# The peers' standard shape (Llama-3-8B attention): bf16, Hq=32, Hkv=8, D=128, pages of 64.
HQ, HKV, D, PAGE = 32, 8, 128, 64
DTYPE = jnp.bfloat16
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


@dataclasses.dataclass
class Inputs:
    q: jax.Array
    cache: jaxattn.KVCache
    meta: jaxattn.AttentionMetadata


def make_inputs(batch: int, q_len: int, kv_len: int, seed: int = 0, *, num_q_heads: int = HQ,
                num_kv_heads: int = HKV) -> Inputs:
    """``batch`` sequences of ``kv_len`` tokens whose last ``q_len`` are this step's queries, in
    a randomly permuted HND pool of random bf16 values (head_dim ``D``, pages of ``PAGE``)."""
    rng = np.random.default_rng(seed)
    pages_per_seq = -(-kv_len // PAGE)
    num_pages = 1 + batch * pages_per_seq
    tables = rng.permutation(np.arange(1, num_pages)).reshape(batch, pages_per_seq).astype(np.int32)
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    shape = (num_pages, num_kv_heads, PAGE, D)
    cache = jaxattn.KVCache(jax.random.normal(k1, shape, DTYPE), jax.random.normal(k2, shape, DTYPE), layout="HND")
    q = jax.random.normal(k3, (batch * q_len, num_q_heads, D), DTYPE)
    meta = jaxattn.AttentionMetadata(
        cu_q_lens=jnp.arange(batch + 1, dtype=jnp.int32) * q_len,
        kv_lens=jnp.full((batch,), kv_len, jnp.int32),
        block_tables=jnp.asarray(tables),
        num_decodes=jnp.int32(batch if q_len == 1 else 0),
        max_q_len=q_len,
    )
    return Inputs(q, cache, meta)


def rel_error(x, ref) -> float:
    x = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref).astype(jnp.float32), np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def device_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return jax.devices()[0].device_kind


def device_event_seconds(fn: Callable[[], object], calls: int) -> dict[str, float]:
    """GPU time per call of ``fn`` by event (kernel or copy) name: the summed durations of the
    events of that name on every GPU's streams (from ``jax.profiler``), over ``calls`` calls,
    divided by ``calls``. XLA traces the kernels of a command buffer one by one while profiling."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                out = fn()
            jax.block_until_ready(out)
        (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        profile = jax.profiler.ProfileData.from_file(path)
    seconds: dict[str, float] = {}
    for plane in profile.planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if "Stream" in line.name:
                    for event in line.events:
                        seconds[event.name] = seconds.get(event.name, 0.0) + event.duration_ns * 1e-9 / calls
    if not seconds:
        raise RuntimeError("device_event_seconds: the profile holds no GPU stream events")
    return seconds


def device_busy_seconds(fn: Callable[[], object], calls: int) -> float:
    """GPU time per call of ``fn`` (summed over the GPUs it runs on): the durations of the kernels
    and copies it runs on the device's streams (``device_event_seconds``).

    Unlike wall time, this does not include the host's launch time or idle gaps, so it measures
    small steps whose host dispatch would otherwise dominate."""
    return sum(device_event_seconds(fn, calls).values())


def write_section(name: str, text: str, *, heading: str, update_results: bool = True) -> str:
    """Puts ``text`` between ``<!-- name:begin/end -->`` markers in RESULTS.md (replacing the
    section, or appending it under ``heading``) and a copy in ``$OUT/<name>_results.md``.
    Returns the section."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    section = f"{begin}\n{text}\n{end}"
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"{name}_results.md"), "w") as f:
            f.write(section + "\n")
    if update_results:
        old = open(RESULTS).read() if os.path.exists(RESULTS) else "# Benchmark results\n"
        if begin in old and end in old:
            new = old[:old.index(begin)] + section + old[old.index(end) + len(end):]
        else:
            new = old.rstrip("\n") + f"\n\n## {heading}\n\n" + section + "\n"
        with open(RESULTS, "w") as f:
            f.write(new)
    return section
