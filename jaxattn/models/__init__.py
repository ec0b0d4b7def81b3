"""Reference models that use jaxattn, and loading Hugging Face checkpoints into them."""

from jaxattn.models.hf import from_pretrained

__all__ = ["from_pretrained"]
