"""Tiny random Hugging Face checkpoints written locally by transformers (``save_pretrained``), for
the parity tests (tests/serve/models/test_hf.py) and the demo's (tests/serve/test_demo.py). Import it after
``pytest.importorskip("transformers")``."""

from __future__ import annotations

import pathlib

import torch
import transformers

VOCAB = 128
_SHAPES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256)
_LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=16)  # short, so that the scaled band covers test positions
_MLA = dict(num_key_value_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_experts_per_tok=2,
            moe_intermediate_size=32, first_k_dense_replace=1)
# DeepSeek's YaRN, a short original context (its ramp covers the dimensions; factor: 256 / 16), attention_factor != 1
_YARN = dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=16, beta_fast=32, beta_slow=1, mscale=1.0,
             mscale_all_dim=0.8)
# name: (transformers config class, its arguments beyond _SHAPES, save_pretrained arguments)
CHECKPOINTS = {
    "llama": ("LlamaConfig", {}, {}),
    "llama3-rope-sharded": ("LlamaConfig", dict(rope_scaling=_LLAMA3_ROPE, rope_theta=500000.0),
                            dict(max_shard_size="50KB")),
    "mistral-sliding-window": ("MistralConfig", dict(sliding_window=8, head_dim=32), {}),
    "qwen2-tied": ("Qwen2Config", dict(tie_word_embeddings=True), {}),
    "qwen3": ("Qwen3Config", dict(head_dim=16, num_hidden_layers=3), {}),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2), {}),
    "qwen2-moe-shared-expert": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                                       shared_expert_intermediate_size=80, norm_topk_prob=False), {}),
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                                         norm_topk_prob=True), dict(max_shard_size="50KB")),
    # MLA (interleaved RoPE in the checkpoint), a dense first layer, then experts
    "deepseek-v2-lite-moe": ("DeepseekV2Config", dict(q_lora_rank=None, kv_lora_rank=32, **_MLA, topk_method="greedy",
                                                      n_routed_experts=8, n_shared_experts=2), {}),
    "deepseek-v3-grouped-yarn": ("DeepseekV3Config", dict(q_lora_rank=48, kv_lora_rank=32, **_MLA, n_routed_experts=8,
                                                          n_shared_experts=1, n_group=4, topk_group=2,
                                                          routed_scaling_factor=2.5, rope_scaling=_YARN),
                                 dict(max_shard_size="50KB")),
}
# The tokenizer of save_tokenizer: word i of a text is token id i of this vocabulary.
WORDS = [f"w{i}" for i in range(VOCAB)]


def save_checkpoint(name: str, path: pathlib.Path, **overrides) -> torch.nn.Module:
    """Writes checkpoint ``name`` of CHECKPOINTS (float32, seeded; ``overrides``: config arguments)
    into ``path``; returns the transformers model it holds (eval mode)."""
    config_class, changes, save = CHECKPOINTS[name]
    config = getattr(transformers, config_class)(**{**_SHAPES, **changes, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True, **save)
    return model


def generate(reference: torch.nn.Module, prompt, new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (ints): exactly ``new_tokens`` tokens."""
    prompt = torch.as_tensor(prompt, dtype=torch.int64)[None]
    reference.generation_config.eos_token_id = None  # no early stop, as the engine
    with torch.no_grad():
        out = reference.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                 max_new_tokens=new_tokens, pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


def save_tokenizer(path: pathlib.Path) -> None:
    """Writes ``path/tokenizer.json``: a word-level tokenizer over WORDS, split at whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token=WORDS[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
