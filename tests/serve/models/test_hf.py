"""from_pretrained against transformers: tiny random checkpoints written locally by transformers
load into the same logits (dense forward), the same greedy tokens (Engine, paged, chunked
prefill + decodes) and the same logprobs as transformers' own model; unsupported configs are
refused by field."""

from __future__ import annotations

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from tests.conftest import require_parity  # noqa: E402

transformers = require_parity()   # skips this module, naming the [parity] extra, without torch and transformers
import torch  # noqa: E402

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from jaxattn.serve.engine import Engine  # noqa: E402
from jaxattn.serve.models import from_pretrained  # noqa: E402
from jaxattn.serve.models.deepseek import DeepSeek  # noqa: E402
from jaxattn.serve.models.hf import _hf_parameters, llama_config_from_hf  # noqa: E402
from jaxattn.serve.models.llama import (PRESETS, Llama, Llama3RopeScaling, param_shardings,  # noqa: E402
                                        rope_frequencies)
from jaxattn.serve.sampling import SamplingParams  # noqa: E402
from tests.paged_inputs import rel_error  # noqa: E402
from tests.serve.models.hf_checkpoints import CHECKPOINTS, VOCAB, generate, save_checkpoint  # noqa: E402
from tests.serve.models.test_deepseek import _dense_hidden as deepseek_dense_hidden  # noqa: E402
from tests.serve.models.test_llama import dense_hidden  # noqa: E402
from tests.test_sharding import run_on_cpu_devices  # noqa: E402

PROMPT_LENS = (5, 23, 12, 40)
NEW_TOKENS = 32


# the mixtures of experts run in the README's pytest command, not again in Bazel's (marked slow)
@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.slow)
                                        if any(kind in name for kind in ("moe", "mixtral", "deepseek")) else name
                                        for name in CHECKPOINTS])
def checkpoint(request, tmp_path_factory) -> tuple[torch.nn.Module, Llama]:
    """(transformers model, the same checkpoint loaded with from_pretrained) in float32."""
    path = tmp_path_factory.mktemp(request.param)
    return save_checkpoint(request.param, path), from_pretrained(str(path), dtype="float32")


def _prompts() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, size=n).astype(np.int32) for n in PROMPT_LENS]


def test_dense_logits_match_transformers(checkpoint):
    reference, model = checkpoint
    tokens = np.random.default_rng(1).integers(0, VOCAB, size=max(PROMPT_LENS))  # every position, one compile
    with torch.no_grad():
        expected = reference(torch.from_numpy(tokens)[None]).logits[0].numpy()
    dense = deepseek_dense_hidden if isinstance(model, DeepSeek) else dense_hidden
    hidden = dense(*nnx.split(model), jnp.asarray(tokens, jnp.int32))
    assert rel_error(model.logits(hidden), expected) <= 1e-4


def test_engine_greedy_tokens_match_generate(checkpoint):
    reference, model = checkpoint
    # fewer slots than requests, prompts longer than a chunk: chunked prefill beside decodes
    engine = Engine(model, max_seqs=3, max_seq_len=max(PROMPT_LENS) + NEW_TOKENS, page_size=8, max_step_tokens=16,
                    backend="xla")
    requests = [engine.add_request(prompt, NEW_TOKENS) for prompt in _prompts()]
    engine.run()
    for request in requests:
        assert request.output == generate(reference, request.prompt, NEW_TOKENS), request.id


def test_engine_logprobs_match_transformers_log_softmax(checkpoint):
    """An Engine's logprobs (SamplingParams.logprobs) of its greedy tokens and their top 5
    alternatives equal transformers' log_softmax of its logits over the same sequence (float32,
    within 2e-3)."""
    reference, model = checkpoint
    engine = Engine(model, max_seqs=2, max_seq_len=max(PROMPT_LENS) + 8, page_size=8, max_step_tokens=16,
                    backend="xla")
    requests = [engine.add_request(prompt, 8, sampling=SamplingParams(logprobs=5)) for prompt in _prompts()[:2]]
    engine.run()
    for request in requests:
        sequence = torch.from_numpy(np.concatenate([request.prompt, request.output]).astype(np.int64))[None]
        with torch.no_grad():
            logits = reference(sequence).logits[0, request.prompt.size - 1:-1]
        expected = torch.log_softmax(logits.double(), dim=-1).numpy()
        for entry, row, token in zip(request.logprobs, expected, request.output, strict=True):
            assert abs(entry.logprob - row[token]) < 2e-3
            np.testing.assert_allclose([lp for _, lp in entry.top], np.sort(row)[::-1][:5], atol=2e-3)


_QWEN2 = dict(model_type="qwen2", vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
              intermediate_size=16)


@pytest.mark.parametrize("field, value", [
    ("model_type", "gpt2"),
    ("hidden_act", "gelu"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
    ("use_sliding_window", True),
    ("mlp_bias", True),
])
def test_unsupported_config_fields_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        llama_config_from_hf({**_QWEN2, field: value}, "float32")


@pytest.mark.parametrize("changes, field", [
    (dict(decoder_sparse_step=2), "decoder_sparse_step"),
    (dict(mlp_only_layers=[0]), "mlp_only_layers"),
    (dict(num_experts=None), "num_experts"),
])
def test_unsupported_mixture_of_experts_fields_are_named(changes, field):
    moe = {**_QWEN2, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    assert llama_config_from_hf(moe, "float32").num_experts == 4
    with pytest.raises(ValueError, match=field):
        llama_config_from_hf({**moe, **changes}, "float32")


def test_deepseek_configs(tmp_path):
    """DeepSeek-V2-Lite's own config.json fields parse (YaRN, greedy routing, 64 experts, 2 shared,
    a dense first layer); V2 with norm_topk_prob, another scoring or rope type, and quantization
    methods other than fp8 are refused by field."""
    from jaxattn.serve.models.hf import deepseek_config_from_hf

    lite = dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, n_routed_experts=64,
                n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1,
                kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False, scoring_func="softmax",
                routed_scaling_factor=1.0, max_position_embeddings=163840, rope_theta=10000,
                rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32,
                                  beta_slow=1, mscale=0.707, mscale_all_dim=0.707))
    cfg = deepseek_config_from_hf(lite, "bfloat16")
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_hidden_dim, cfg.shared_expert_dim,
            cfg.first_k_dense_replace) == (64, 6, 1408, 2816, 1)
    assert cfg.rope_scaling.factor == 40 and cfg.rope_scaling.attention_factor == pytest.approx(1.0)
    for changes, field in ((dict(norm_topk_prob=True), "norm_topk_prob"),
                           (dict(scoring_func="sigmoid"), "scoring_func"),
                           (dict(topk_method="noaux_tc"), "topk_method"),
                           (dict(moe_layer_freq=2), "moe_layer_freq"),
                           (dict(v_head_dim=0), "v_head_dim"),
                           (dict(q_lora_rank="1536"), "q_lora_rank"),
                           (dict(rope_scaling=dict(type="dynamic", factor=2.0)), "rope_scaling")):
        with pytest.raises(ValueError, match=field):
            deepseek_config_from_hf({**lite, **changes}, "bfloat16")
    with pytest.raises(ValueError, match=r"lacks the fields \['kv_lora_rank'\]"):
        deepseek_config_from_hf({k: v for k, v in lite.items() if k != "kv_lora_rank"}, "bfloat16")
    (tmp_path / "config.json").write_text(json.dumps({**lite, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ValueError, match="quantization_config.quant_method='awq'"):
        from_pretrained(str(tmp_path))


def test_attention_bias_outside_qwen2_is_refused():
    with pytest.raises(ValueError, match="attention_bias"):
        llama_config_from_hf({**_QWEN2, "model_type": "llama", "attention_bias": True}, "float32")


_QWEN2_MOE = dict(_QWEN2, model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=6,
                  shared_expert_intermediate_size=8, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])


def check_from_pretrained_on_mesh(path: str, expert_parallel: bool = False) -> None:
    """(On 2 CPU devices.) A checkpoint loaded onto a mesh holds the one-device load's values, each
    tensor placed as ``shard_model`` places it (a Qwen2-MoE's experts whole per device with
    ``expert_parallel``)."""
    hf = _QWEN2_MOE if expert_parallel else _QWEN2
    cfg = llama_config_from_hf(hf, "float32")
    rng = np.random.default_rng(0)
    abstract = nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0)))
    tensors = {}
    for name, t in _hf_parameters(abstract, hf["model_type"]).items():
        shape = t.variable.shape if t.expert is None else t.variable.shape[1:]
        tensors[name] = rng.normal(size=shape[::-1] if t.transposed else shape).astype(np.float32)
    path = _write_checkpoint(pathlib.Path(path), tensors, hf)
    mesh = jax.make_mesh((jax.device_count(),), ("tp",))
    expected, sharded = from_pretrained(path), from_pretrained(path, mesh=mesh, expert_parallel=expert_parallel)
    for (name, sharding), (_, weight), (_, value) in zip(nnx.to_flat_state(param_shardings(sharded, mesh)),
                                                         nnx.to_flat_state(nnx.state(sharded)),
                                                         nnx.to_flat_state(nnx.state(expected))):
        assert weight.get_value().sharding == sharding.get_value(), name
        np.testing.assert_array_equal(weight.get_value(), value.get_value(), err_msg=str(name))
    assert sharded.layers[0].attn.q_proj.bias.get_value().sharding.spec == P("tp")
    if expert_parallel:
        assert sharded.layers[0].mlp.gate_proj.get_value().sharding.spec == P("tp", None, None)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_from_pretrained_on_a_mesh(tmp_path, expert_parallel):
    run_on_cpu_devices(2, f"from tests.serve.models.test_hf import check_from_pretrained_on_mesh; "
                          f"check_from_pretrained_on_mesh({str(tmp_path)!r}, {expert_parallel})")
    with pytest.raises(ValueError, match="expert_parallel splits the experts over a mesh"):
        from_pretrained(str(tmp_path), expert_parallel=True)


def test_without_safetensors_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'jaxattn\[hf\]'"):
        from_pretrained(str(tmp_path))


def test_missing_config_fields_are_named():
    with pytest.raises(ValueError, match="intermediate_size"):
        llama_config_from_hf({k: v for k, v in _QWEN2.items() if k != "intermediate_size"}, "float32")


@pytest.mark.parametrize("changes, field", [
    (dict(hidden_size="64"), "hidden_size"),
    (dict(num_attention_heads=0), "num_attention_heads"),
    (dict(vocab_size=2**31), "vocab_size"),
    (dict(num_key_value_heads=True), "num_key_value_heads"),
    (dict(head_dim=2.5), "head_dim"),
    (dict(rms_norm_eps="1e-6"), "rms_norm_eps"),
    (dict(rope_theta=-1.0), "rope_theta"),
    (dict(rope_theta=float("nan")), "rope_theta"),
    (dict(rope_scaling=[1, 2]), "rope_scaling"),
    (dict(rope_scaling=dict(rope_type="llama3", factor="x", low_freq_factor=1.0, high_freq_factor=4.0)),
     "rope_scaling.factor"),
    (dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings="8192")), "rope_scaling.original_max_position_embeddings"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings"),
])
def test_malformed_config_fields_are_named(changes, field):
    """Sizes that are not ints in int32's range, numbers that are not finite and positive, and a
    rope field that is not an object: a ValueError naming the field, not a TypeError (or a
    ZeroDivisionError) from deep inside."""
    with pytest.raises(ValueError, match=f"config.json field {field}="):
        llama_config_from_hf({**_QWEN2, **changes}, "float32")


@pytest.mark.parametrize("content, dtype, match", [
    (b"{not json", None, "config.json is not a JSON file"),
    (b'{"model_type": "\xff"}', None, "config.json is not a JSON file"),
    (b"[1, 2]", None, "config.json holds a JSON list, not an object"),
    (json.dumps({**_QWEN2, "torch_dtype": "int8"}).encode(), None, "config.json field torch_dtype='int8'"),
    (json.dumps({**_QWEN2, "torch_dtype": "no_such_dtype"}).encode(), None, "field torch_dtype='no_such_dtype'"),
    (json.dumps(_QWEN2).encode(), "float8_e4m3fn", "dtype='float8_e4m3fn' is not supported"),
])
def test_malformed_config_files_are_named(tmp_path, content, dtype, match):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ValueError, match=match):
        from_pretrained(str(tmp_path), dtype=dtype)


def test_the_dtype_argument_comes_before_the_config():
    from jaxattn.serve.models.hf import _model_dtype

    config = {**_QWEN2, "torch_dtype": "float32"}
    assert _model_dtype(config, np.dtype("float16")) == "float16"
    assert _model_dtype(config, None) == "float32" and _model_dtype(_QWEN2, None) == "bfloat16"


def _write_checkpoint(path, tensors: dict[str, np.ndarray], config: dict = _QWEN2) -> str:
    from safetensors.numpy import save_file

    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


def test_bad_tensors_are_named(tmp_path):
    embed = np.zeros((_QWEN2["vocab_size"], _QWEN2["hidden_size"]), np.float32)
    with pytest.raises(ValueError, match="tensors missing .*model.norm.weight"):
        from_pretrained(_write_checkpoint(tmp_path, {"model.embed_tokens.weight": embed}))
    with pytest.raises(ValueError, match="'model.embed_tokens.weight' .* has shape \\(8, 4\\), expected \\(8, 8\\)"):
        from_pretrained(_write_checkpoint(tmp_path, {"model.embed_tokens.weight": embed[:, :4]}))
    with pytest.raises(ValueError, match="unexpected tensor 'model.extra'"):
        from_pretrained(_write_checkpoint(tmp_path, {"model.extra": embed}))


# Llama-3.1-8B's config.json as transformers 4 wrote it (rope_theta and rope_scaling at the top level)
_LLAMA31_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
                   rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192))


def test_llama31_config_and_rope_frequencies_match_transformers():
    cfg = llama_config_from_hf(_LLAMA31_8B, "bfloat16")
    assert cfg == PRESETS["llama3-8b"].replace(rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 8192))
    hf_config = transformers.LlamaConfig(**{k: v for k, v in _LLAMA31_8B.items() if k != "model_type"})
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    # transformers computes in float32 (a few ulps off, depending on the CPU's pow), we in float64
    np.testing.assert_allclose(rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), expected.numpy(),
                               rtol=1e-5)
