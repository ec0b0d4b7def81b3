"""Reference models that use jaxattn (``llama``, ``deepseek``: the shared layers in ``layers``, the
protocol the engine serves in ``base``), and loading Hugging Face checkpoints into them."""

from jaxattn.serve.models.base import PagedModel
from jaxattn.serve.models.hf import from_pretrained

__all__ = ["PagedModel", "from_pretrained"]
