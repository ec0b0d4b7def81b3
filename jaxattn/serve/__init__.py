"""The serving side of jaxattn: a continuous-batching engine, its reference models and an
OpenAI-compatible HTTP server, built on the op library (``jaxattn``: paged attention, MLA, the
page table and KV caches, the backends and their chooser, head sharding).

It builds on the library and never the other way: no module of ``jaxattn`` outside
``jaxattn.serve`` imports it (tests/test_layout.py checks). Importing ``jaxattn.serve`` and its
engine needs only the base install; the HTTP server needs the ``serve`` extra.

Modules, one concern each:

- ``engine``: the ``Engine``, the host loop (admission, the scheduler, steps launched ahead of
  their tokens).
- ``step``: the engine's jitted device step, its shape buckets, the packing of a schedule into
  its operands and the ``StepRunner`` that holds the device state.
- ``scheduler``: requests, the host page pool, admission and preemption, which tokens each step
  computes.
- ``sampling``: next-token sampling inside the step (temperature, top-k, top-p, seeds, logprobs).
- ``prefix_cache``: the chained page keys of automatic prefix caching.
- ``speculative``: speculative decoding (n-gram, oracle and draft-model drafts, verification).
- ``structured_output``: tokens held to a grammar (JSON schema, regex, choices, Lark) via llguidance.
- ``models``: the reference models (Llama, DeepSeek), their layers, tensor and expert
  parallelism, FP8 quantization and loading Hugging Face checkpoints.
- ``demo``: ``python -m jaxattn.serve.demo``, continuous-batching greedy generation.
- ``cli_args``: command-line argument types shared by the demo and the server.
- ``http``: the OpenAI-compatible HTTP server (``python -m jaxattn.serve``, started by ``cli``;
  needs the ``serve`` extra: fastapi, uvicorn, prometheus-client, tokenizers, jinja2, llguidance).
"""
