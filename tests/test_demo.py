"""The demo's engine step: paged generation agrees with a dense, unpaged forward pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import demo


def dense_greedy(cfg: demo.ModelConfig, params: dict, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
    """Greedy generation recomputing the whole sequence each step with jax.nn.dot_product_attention."""
    seqs = jnp.asarray(prompts)
    out = []
    for _ in range(new_tokens):
        length = seqs.shape[1]
        x = params["embed"][seqs]                                          # [B, L, dim]
        positions = jnp.arange(length, dtype=jnp.int32)
        for layer in params["layers"]:
            h = demo.rms_norm(x, layer["norms"][0])
            qkv = (h @ layer["wqkv"]).reshape(*seqs.shape, -1, cfg.head_dim)
            q, k, v = jnp.split(qkv, [cfg.q_heads, cfg.q_heads + cfg.kv_heads], axis=2)
            q = jax.vmap(lambda t: demo.rope(t, positions))(q)
            k = jax.vmap(lambda t: demo.rope(t, positions))(k)
            attn = jax.nn.dot_product_attention(q, k, v, is_causal=True)   # T == S: top-left == bottom-right
            x = x + attn.reshape(*seqs.shape, -1) @ layer["wo"]
            gate, up = jnp.split(demo.rms_norm(x, layer["norms"][1]) @ layer["w_gate_up"], 2, axis=-1)
            x = x + (jax.nn.silu(gate) * up) @ layer["w_down"]
        logits = demo.rms_norm(x[:, -1], params["final_norm"]) @ params["unembed"]
        token = jnp.argmax(logits, -1).astype(jnp.int32)
        out.append(token)
        seqs = jnp.concatenate([seqs, token[:, None]], axis=1)
    return np.asarray(jnp.stack(out, 1))


def test_paged_generation_matches_dense_model():
    cfg = demo.PRESETS["tiny"]
    params = demo.init_params(cfg, jax.random.key(1))
    prompts = np.random.default_rng(3).integers(0, cfg.vocab, size=(3, 21), dtype=np.int32)
    tokens, _ = demo.generate(cfg, params, prompts, new_tokens=6, backend="xla", num_pages=1 + 3 * 2)
    np.testing.assert_array_equal(tokens, dense_greedy(cfg, params, prompts, 6))


def test_demo_runs(capsys):
    demo.main(["--preset", "tiny", "--batch", "2", "--prompt-len", "8", "--new-tokens", "3", "--backend", "xla"])
    out = capsys.readouterr().out
    assert "decode attention backend: xla" in out and "tokens/s" in out
