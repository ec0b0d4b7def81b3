"""Every python block of README.md runs as written: each is extracted from the README and exec'd
unchanged, nothing defined for it beforehand.

- A block whose first line is a comment ``# Continues the "HEADING" block`` continues the last
  python block under that README heading before it (``# Continues the block above``: the python
  block before it) and uses its names: it runs after that block (and what that one continues), in
  the same namespace, as a reader pasting them in order would.
- A block that builds a mesh of N devices (``jax.make_mesh((N,) ...``) runs in a subprocess on N
  CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=N``, ``JAX_PLATFORMS=cpu``), as
  its comment tells a reader to.
- A block that cannot run here is listed in NOT_RUN with the reason (it shows as skipped with it).
- CHECKS adds assertions on what some blocks computed (the step block's out-of-pages contract, the
  sharded step against the unsharded one, ...), run after the block ran as written.
- The ```bash blocks are commands a user runs (installs, the test command itself, GPU launches):
  not run here.
New blocks are picked up as they are: a block needs no entry here to be run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from tests.paged_inputs import ALLCLOSE, rel_error

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
CONTINUES = re.compile(r'# Continues the (?:"([^"]+)" )?block')
MESH = re.compile(r"jax\.make_mesh\(\((\d+),")

# A string only that block contains -> why it is not run as written.
NOT_RUN = {
    '"/path/to/': "reads a local Hugging Face checkpoint at a placeholder path (and would download nothing); "
                  "test_hugging_face_block_on_a_tiny_checkpoint runs it with the path replaced",
    'base_url="http://127.0.0.1:8000/v1"': "talks to the server the bash block before it starts: "
                                           "tests/serve/http/test_app.py::test_readme_http_serving_section runs both",
}


@dataclasses.dataclass(frozen=True)
class Block:
    index: int      # among the README's python blocks
    line: int       # of its ```python fence
    heading: str    # the README heading it is under
    code: str

    @property
    def id(self) -> str:
        return f"L{self.line}-" + re.sub(r"[^a-z0-9]+", "-", self.heading.lower()).strip("-")

    @property
    def continues(self) -> re.Match | None:
        return CONTINUES.match(self.code.lstrip())


@functools.cache
def blocks() -> tuple[Block, ...]:
    """The README's ```python blocks, dedented, in order."""
    found, heading, fence, lines = [], "", None, []
    for number, line in enumerate(README.read_text().splitlines(), 1):
        stripped = line.strip()
        if fence is None and line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif fence is None and stripped == "```python":
            fence, indent, lines = number, len(line) - len(line.lstrip()), []
        elif fence is not None and stripped == "```":
            code = "\n".join(text[indent:] if not text[:indent].strip() else text.lstrip() for text in lines)
            found.append(Block(len(found), fence, heading, code + "\n"))
            fence = None
        elif fence is not None:
            lines.append(line)
    return tuple(found)


def chain(index: int) -> list[Block]:
    """Block ``index`` after the blocks it continues, first to last."""
    out = [blocks()[index]]
    while match := out[0].continues:
        heading = match.group(1)
        before = [b for b in blocks()[:out[0].index] if heading in (None, b.heading)]
        assert before, f"README line {out[0].line}: no python block {heading or 'above'} to continue"
        out.insert(0, before[-1])
    return out


def devices_needed(index: int) -> int:
    return max([1] + [int(n) for block in chain(index) for n in MESH.findall(block.code)])


def not_run_reason(block: Block) -> str | None:
    reasons = [reason for marker, reason in NOT_RUN.items() if marker in block.code]
    return reasons[0] if reasons else None


def run_chain(index: int) -> None:
    """Runs block ``index`` as written after the blocks it continues, in one namespace, then the
    CHECKS for it. Called in this process or in a subprocess with more devices."""
    namespace: dict = {"__name__": "__readme__"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for block in chain(index):
            exec(compile(block.code, f"README.md:{block.line}", "exec"), namespace)
    for marker, check in CHECKS.items():
        if marker in blocks()[index].code:
            check(namespace, printed.getvalue())


@pytest.mark.parametrize("index", [b.index for b in blocks()], ids=[b.id for b in blocks()])
def test_block_runs_as_written(index):
    block = blocks()[index]
    if reason := not_run_reason(block):
        pytest.skip(f"README line {block.line} not run: {reason}")
    num_devices = devices_needed(index)
    if num_devices > 1:
        from tests.test_sharding import run_on_cpu_devices

        run_on_cpu_devices(num_devices, f"from tests.test_readme import run_chain; run_chain({index})")
    else:
        run_chain(index)


def test_markers_each_name_one_block():
    for marker in (*NOT_RUN, *CHECKS):
        where = [b.line for b in blocks() if marker in b.code]
        assert len(where) == 1, f"{marker!r} should be in exactly one README python block, found at lines {where}"


def test_shell_blocks_are_not_python():
    """The README's ```bash blocks are commands (not run here); a python block must be fenced as
    python to be run."""
    for block in re.findall(r"^ *```(?:bash|sh)\n(.*?)^ *```", README.read_text(), flags=re.S | re.M):
        assert "import jax" not in block and "import jaxattn" not in block, block


# ------------------------------------------------------------------------------- checks on blocks

def _packed(rng, lens, heads, head_dim, dtype=jnp.float32):
    return jnp.asarray(rng.normal(size=(sum(lens), heads, head_dim)), dtype)


def check_step_out_of_pages(namespace: dict, printed: str) -> None:
    """The step block keeps the out-of-pages contract: a refused request writes nothing, its rows
    are zero and flagged, and the other sequences are unaffected."""
    step = namespace["step"]
    rng = np.random.default_rng()
    cache = jaxattn.KVCache.create(num_pages=4, page_size=16, num_kv_heads=2, head_dim=16, dtype=jnp.float32)
    table = jaxattn.PageTable.create(num_pages=4, max_seqs=4, max_pages_per_seq=4, page_size=16)

    # Prefill: sequence 0 takes two pages, sequence 1 the last free one.
    lens = [30, 10]
    kv = _packed(rng, lens, 2, 16)
    out, ok, valid, cache, table = step(_packed(rng, lens, 4, 16), kv, -kv, cache, table,
                                        jnp.asarray([0, 1], jnp.int32), jnp.asarray(lens, jnp.int32))
    assert np.asarray(ok).all() and np.asarray(valid).all() and int(table.num_free) == 0

    # Decodes of 0 and 1 around a new request (sequence 2) that finds no free page.
    seq_ids, q_lens = jnp.asarray([0, 2, 1], jnp.int32), jnp.asarray([1, 5, 1], jnp.int32)
    q, kv = _packed(rng, [7], 4, 16), _packed(rng, [7], 2, 16)
    out, ok, valid, new_cache, new_table = step(q, kv, -kv, cache, table, seq_ids, q_lens)
    np.testing.assert_array_equal(ok, [True, False, True])
    np.testing.assert_array_equal(valid, [True, False, True])
    assert not np.asarray(out[1:6]).any(), "the refused request's rows are zeros"
    assert int(new_table.seq_lens[2]) == 0 and int(new_table.num_free) == 0

    # Only the two decodes' slots changed (sequence 0 at position 30, sequence 1 at 10).
    written = np.zeros((4, 16), bool)
    for seq, pos in ((0, 30), (1, 10)):
        written[int(table.block_tables[seq, pos // 16]), pos % 16] = True
    for before, after in ((cache.k_pages, new_cache.k_pages), (cache.v_pages, new_cache.v_pages)):
        before, after = np.asarray(before), np.asarray(after)       # HND: [pages, Hkv, page, D]
        changed = (before != after).any(axis=(1, 3))
        np.testing.assert_array_equal(changed, written)

    # The decodes' rows are what they are without the refused request in the batch (another batch
    # shape, so float32 sums in another order: equal within float32, not bit for bit).
    alone = step(q[jnp.asarray([0, 6])], kv[jnp.asarray([0, 6])], -kv[jnp.asarray([0, 6])], cache, table,
                 jnp.asarray([0, 1], jnp.int32), jnp.asarray([1, 1], jnp.int32))[0]
    np.testing.assert_allclose(out[jnp.asarray([0, 6])], alone, **ALLCLOSE[jnp.dtype(jnp.float32)])


def check_sharded_step(namespace: dict, printed: str) -> None:
    """(2 CPU devices.) The sharded step: output sharded like q, every request granted and valid,
    and the output of the same step unsharded on a fresh cache and table."""
    from jax.sharding import PartitionSpec as P

    from jaxattn.kv_cache import pool_sharding

    out, cache = namespace["out"], namespace["cache"]
    assert out.sharding.spec == P(None, "tp", None), out.sharding
    pools = pool_sharding(namespace["mesh"], "tp", "HND")
    assert cache.k_pages.sharding.is_equivalent_to(pools, 4), cache.k_pages.sharding
    assert np.asarray(namespace["ok"]).all() and np.asarray(namespace["valid"]).all()
    fresh_cache = jaxattn.KVCache.create(num_pages=1024, page_size=16, num_kv_heads=8, head_dim=128,
                                         dtype=jnp.bfloat16, layout="HND")
    fresh_table = jaxattn.PageTable.create(num_pages=1024, max_seqs=64, max_pages_per_seq=256, page_size=16)
    unsharded = (jnp.asarray(jax.device_get(namespace[name])) for name in ("q", "k", "v"))
    expected = namespace["step"](*unsharded, fresh_cache, fresh_table, namespace["seq_ids"], namespace["q_lens"])[0]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                               **ALLCLOSE[jnp.dtype(jnp.bfloat16)])


def check_engine_on_a_mesh(namespace: dict, printed: str) -> None:
    """(2 CPU devices.) The sharded model's engine generated the request's tokens."""
    request = namespace["request"]
    assert len(request.output) == 4 and str(request.output) in printed


def check_mla(namespace: dict, printed: str) -> None:
    """The MLA block's two forms (absorbed decode, expanded prefill) give the same attention."""
    from jaxattn.mla import absorb_query, project_values

    ns = namespace
    out = ns["out"]
    assert out.shape == ns["q_nope"].shape[:2] + (ns["w_uv"].shape[-1],), out.shape
    absorbed = project_values(jaxattn.mla_paged_attention(absorb_query(ns["q_nope"], ns["w_uk"]), ns["q_rope"],
                                                          ns["cache"], ns["meta"], scale=ns["scale"]), ns["w_uv"])
    assert rel_error(out, np.asarray(absorbed, np.float32)) < 2e-2       # bf16
    np.testing.assert_array_equal(np.asarray(ns["out_whole"], np.float32), np.asarray(out, np.float32))


def check_engine(namespace: dict, printed: str) -> None:
    request = namespace["request"]
    assert len(request.output) == 32 and str(request.output) in printed


def check_sampling_and_streaming(namespace: dict, printed: str) -> None:
    assert {line.split()[0] for line in printed.splitlines()} == {"0", "1"}, printed
    assert not namespace["engine"].has_work


# A string only that block contains -> the check run after it.
CHECKS = {
    "def step(": check_step_out_of_pages,
    "pool_sharding(mesh": check_sharded_step,
    "shard_model(": check_engine_on_a_mesh,
    "jaxattn.MLACache.create(": check_mla,
    "prompt_token_ids = [": check_engine,
    "engine.stream()": check_sampling_and_streaming,
}


# ------------------------------------------------------------------ the block listed in NOT_RUN

def test_hugging_face_block_on_a_tiny_checkpoint(tmp_path, capsys):
    """The Hugging Face block with its placeholder path replaced by a tiny checkpoint (with a
    tokenizer.json) that transformers writes."""
    from tests.conftest import require_parity

    require_parity()
    from tests.serve.models.hf_checkpoints import save_checkpoint, save_tokenizer

    save_checkpoint("llama", tmp_path)
    save_tokenizer(tmp_path)
    (block,) = [b for b in blocks() if "from_pretrained(path" in b.code]
    placeholder = '"/path/to/Llama-3.1-8B-Instruct"'
    assert block.code.count(placeholder) == 1
    namespace: dict = {}
    exec(block.code.replace(placeholder, repr(str(tmp_path))), namespace)
    request, tokenizer = namespace["request"], namespace["tokenizer"]
    assert len(request.output) == 64
    assert capsys.readouterr().out == tokenizer.decode(request.output) + "\n"
