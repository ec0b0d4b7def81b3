"""EasyDeL's eSurge (a JAX serving engine) on a tiny random-weight Llama: the first step towards
issue 37's JAX engine side by side. It checks that eSurge runs here and that its greedy tokens
equal a plain forward's (no KV cache), and prints its tokens/s; it is not a benchmark of record.

    scripts/fetch_esurge_wheels.sh                   # easydel 0.3.0 + what its import reaches
    pip install --no-deps --target /tmp/site_esurge .whl_esurge/*.whl
    PYTHONPATH=/tmp/site_esurge:benchmarks/esurge_stubs:$PWD python3 -m benchmarks.esurge_smoke [--no-check]

What easydel 0.3.0 needs beyond its wheels, found on CPU (jax 0.10.2, flax 0.12.8):
* ``benchmarks/esurge_stubs`` on the path: stand-ins for ``ray`` and ``google.cloud.storage``,
  imported at the top and never used for eSurge (the tokenizer workers import easydel too, hence
  the path, not a ``sys.path`` insert);
* ``ENABLE_DISTRIBUTED_INIT=0`` (else ``eformer.executor`` imports ray) and ``EASYDEL_AUTO=0``
  (else easydel appends GPU XLA flags that jaxlib 0.10.2's XLA aborts on);
* with flax other than the pinned 0.12.3, an identity hash on ``OperationMetadata`` (jit hashes
  the model's graph, whose static attributes hold it);
* on CPU, a cap on the KV pool (``per_device_hbm_budget_bytes`` falls back to 4 GiB there).
Prompts go in as strings of a word-level tokenizer (``t<i>`` is token i), so that token-id
prompts round-trip exactly; on a GPU eSurge runs ejkernel's Triton ``unified_attention``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("ENABLE_DISTRIBUTED_INIT", "0")
os.environ.setdefault("EASYDEL_AUTO", "0")

VOCAB = 256


def tokenizer(directory: str, vocab: int = VOCAB):
    """A word-level tokenizer of ``vocab`` words, ``t<i>`` for token i (the last is EOS, the one
    before it padding), saved to ``directory`` (eSurge's tokenizer workers load it from disk)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", eos_token=f"t{vocab - 1}",
                                   pad_token=f"t{vocab - 2}")
    fast.save_pretrained(directory)
    return PreTrainedTokenizerFast.from_pretrained(directory)


def patch_easydel() -> None:
    """The two workarounds of the module docstring that are code: the flax hash and the CPU KV cap."""
    import flax
    import jax
    if flax.__version__ != "0.12.3":
        from easydel.operations._operation_meta import OperationMetadata
        OperationMetadata.__hash__ = object.__hash__
    if jax.default_backend() == "cpu":
        import easydel.caching.ragged_page.cache as ragged
        import easydel.caching.unified_attention.cache as unified
        ragged.per_device_hbm_budget_bytes = unified.per_device_hbm_budget_bytes = lambda *args, **kwargs: 4 << 20


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.esurge_smoke", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--no-check", action="store_true", help="skip the no-cache reference (one compile per length)")
    args = parser.parse_args()

    import easydel as ed
    import jax
    import jax.numpy as jnp
    import numpy as np
    from easydel.inference import SamplingParams
    from easydel.inference.esurge import eSurge
    from flax import nnx

    patch_easydel()
    cfg = ed.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         eos_token_id=255, pad_token_id=254, bos_token_id=1, kvdtype=jnp.float32)
    model = ed.LlamaForCausalLM(config=cfg, dtype=jnp.float32, param_dtype=jnp.float32, precision=None,
                                rngs=nnx.Rngs(0))
    start = time.perf_counter()
    engine = eSurge(model=model, processor=tokenizer(tempfile.mkdtemp()), dtype=jnp.float32, max_model_len=128,
                    max_num_seqs=4, max_num_batched_tokens=128, page_size=16, hbm_utilization=0.5,
                    enable_prefix_caching=False, reserve_tokens=8, silent_mode=True, esurge_name="jaxattn-smoke")
    print(f"eSurge on {jax.default_backend()}: built and compiled in {time.perf_counter() - start:.1f} s, attention "
          f"{engine.runner.model.config.attn_mechanism}")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 250, size=int(n)).tolist() for n in rng.integers(8, 21, size=args.requests)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, top_k=1, ignore_eos=True)
    texts = [" ".join(f"t{i}" for i in ids) for ids in prompts]
    engine.generate(texts, params, use_tqdm=False)                     # compiles the rest
    start = time.perf_counter()
    outputs = engine.generate(texts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = [list(out.outputs[0].token_ids) for out in outputs]
    print(f"{sum(map(len, generated))} tokens for {len(prompts)} requests in {seconds:.3f} s")
    engine.terminate()
    if args.no_check:
        return
    same = 0
    for ids, tokens in zip(prompts, generated):
        seq = list(ids)
        for _ in range(args.new_tokens):
            with model.mesh:
                seq.append(int(jnp.argmax(model(input_ids=jnp.asarray([seq], jnp.int32)).logits[0, -1])))
        same += seq[len(ids):] == tokens
    print(f"greedy tokens equal a no-cache forward's for {same} of {len(prompts)} requests")
    sys.exit(0 if same == len(prompts) else 1)


if __name__ == "__main__":
    main()
