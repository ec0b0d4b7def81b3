"""Reference models that use jaxattn."""
