"""jaxattn: paged attention for JAX on NVIDIA GPUs, usable inside ``jax.jit``."""

from jaxattn.attention import paged_attention
from jaxattn.attention_plan import AttentionPlan, plan
from jaxattn.kv_cache import KVCache, MLACache, SlotMapping
from jaxattn.metadata import AttentionMetadata
from jaxattn.mla import mla_paged_attention, mla_prefill
from jaxattn.page_table import PageTable

__version__ = "0.1.0"

__all__ = ["AttentionMetadata", "AttentionPlan", "KVCache", "MLACache", "PageTable", "SlotMapping",
           "mla_paged_attention", "mla_prefill", "paged_attention", "plan", "__version__"]
