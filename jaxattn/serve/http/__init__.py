"""OpenAI-compatible HTTP serving over the Engine (``python -m jaxattn.serve``, whose command line
is ``jaxattn.serve.cli``; needs the ``serve`` extra: fastapi, uvicorn, prometheus-client,
tokenizers, jinja2).

Modules, one concern each: ``protocol`` (request bodies and error bodies), ``text`` (tokenizer,
chat template, incremental detokenization with stop strings), ``loop`` (the engine thread),
``metrics`` (Prometheus), ``app`` (the FastAPI routes), ``logprobs`` (OpenAI's logprobs objects),
``tools`` (tool calling through structured output), ``process`` (starting the server as a
subprocess: a free port, the wait for ``/health``).
"""
