"""The server's Prometheus metrics (``GET /metrics``), in a registry of their own."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_TPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                 0.5, 1.0, 2.5)


class Metrics:
    """Requests running (generating) and waiting (accepted, no token yet: queued or in prefill),
    prompt and generated tokens, finished requests by finish reason, time to first token and time
    per output token, preemptions, prompt tokens found in the prefix cache and tokens computed
    (``Engine.stats``), and the KV cache's pages (``Engine.page_usage``): in use (held by live
    sequences), free, and cached (holding a cached prompt prefix, held by live sequences or not:
    reusable, and evictable when no one holds them)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests_running = Gauge("jaxattn_requests_running", "Requests generating tokens", registry=r)
        self.requests_waiting = Gauge("jaxattn_requests_waiting", "Requests accepted that have no token yet "
                                      "(queued or in prefill)", registry=r)
        self.prompt_tokens = Counter("jaxattn_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("jaxattn_generation_tokens", "Tokens generated", registry=r)
        self.requests_finished = Counter("jaxattn_requests_finished", "Requests ended, by finish reason "
                                         "(stop, length, abort: client gone or server stopping, error)",
                                         ["finish_reason"], registry=r)
        self.ttft = Histogram("jaxattn_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("jaxattn_time_per_output_token_seconds", "(last token - first token) / "
                              "(tokens - 1), per request of 2 or more tokens", buckets=_TPOT_BUCKETS, registry=r)
        # mirrors of Engine.stats
        self._engine_counters = {
            "preemptions": Counter("jaxattn_preemptions", "Requests preempted when the KV cache was full "
                                   "(recomputed later)", registry=r),
            "cached_tokens": Counter("jaxattn_prompt_tokens_cached", "Prompt tokens found in the prefix cache",
                                     registry=r),
            "computed_tokens": Counter("jaxattn_computed_tokens", "Tokens the engine's steps computed (prefill, "
                                       "decodes, recomputation after preemption)", registry=r),
        }
        self._engine_seen = dict.fromkeys(self._engine_counters, 0)
        self.kv_pages_in_use = Gauge("jaxattn_kv_pages_in_use", "KV cache pages held by live sequences", registry=r)
        self.kv_pages_free = Gauge("jaxattn_kv_pages_free", "KV cache pages free", registry=r)
        self.kv_pages_cached = Gauge("jaxattn_kv_pages_cached", "KV cache pages holding a cached prompt prefix "
                                     "(held by live sequences or not)", registry=r)

    def observe_state(self, state) -> None:
        """The gauges of ``state`` (an ``EngineState``), and the counters that mirror ``Engine.stats``
        advanced to its counts."""
        self.requests_waiting.set(state.waiting)
        self.requests_running.set(state.running)
        self.kv_pages_in_use.set(state.pages.in_use)
        self.kv_pages_free.set(state.pages.free)
        self.kv_pages_cached.set(state.pages.cached)
        for name, counter in self._engine_counters.items():
            count = state.stats.get(name, 0)
            if count > self._engine_seen[name]:
                counter.inc(count - self._engine_seen[name])
                self._engine_seen[name] = count

    def render(self) -> bytes:
        """The Prometheus text format."""
        return generate_latest(self.registry)
