"""Kernels written in this repository (Triton), and how they are launched from JAX."""
