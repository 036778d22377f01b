"""Prometheus metrics, collected from the engine's own objects on each scrape."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from service.engine.engine import Engine


class OutputRouter(Protocol):
    """The router's counters (service/server.py's `OutputRouter`)."""

    completion_tokens: int
    finished_by_reason: dict[str, int]


class EngineCollector:
    """Reads EngineStats and the router's counters; no global metric objects."""

    def __init__(self, engine: "Engine", router: "OutputRouter"):
        self.engine = engine
        self.router = router

    def collect(self):
        s = self.engine.stats()
        gauges = {
            "zerogap_forward_busy_fraction": (
                "Fraction of time the forward ran, over recent back-to-back steps",
                s.forward_busy_fraction,
            ),
            "zerogap_forward_gap_median_seconds": (
                "Median gap between consecutive forwards",
                s.median_forward_gap_s,
            ),
            "zerogap_running_requests": ("Requests being decoded", s.running_requests),
            "zerogap_queued_requests": ("Requests waiting for admission", s.queued_requests),
            "zerogap_kv_pool_tokens": ("KV pool size in tokens", s.kv_pool_total_tokens),
            "zerogap_kv_pool_free_tokens": (
                "Free KV pool rows, counting prefix-cache rows no request uses (evictable)",
                s.kv_pool_free_tokens + s.prefix_cache.evictable_tokens,
            ),
            "zerogap_prefix_cache_tokens": ("KV rows held by the prefix cache", s.prefix_cache.cached_tokens),
            "zerogap_prefix_cache_evictable_tokens": (
                "Prefix-cache rows no running request uses",
                s.prefix_cache.evictable_tokens,
            ),
            "zerogap_prefix_cache_hit_rate": (
                "Prompt tokens served from the prefix cache / prompt tokens",
                s.prefix_cache.hit_rate,
            ),
            "zerogap_prefix_cache_state_snapshots": (
                "Recurrent layers' state snapshots held by the prefix cache (models with such layers)",
                s.prefix_cache.state_snapshots,
            ),
            "zerogap_prefix_cache_state_snapshot_rows": (
                "Rows for recurrent layers' state snapshots (--state-snapshots)",
                s.prefix_cache.state_snapshot_rows,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("zerogap_forward_steps", "Forward passes run", value=s.forward_steps)
        yield CounterMetricFamily(
            "zerogap_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache",
            value=s.prefix_cache.hit_tokens,
        )
        yield CounterMetricFamily(
            "zerogap_prefix_cache_prompt_tokens", "Prompt tokens admitted", value=s.prefix_cache.prompt_tokens
        )
        yield CounterMetricFamily(
            "zerogap_retractions", "Requests retracted under KV memory pressure", value=s.retractions
        )
        yield CounterMetricFamily(
            "zerogap_retraction_sync_points",
            "Retractions that processed the results in flight first",
            value=s.retraction_sync_points,
        )
        yield GaugeMetricFamily(
            "zerogap_new_token_ratio",
            "Share of max_new_tokens admission sets aside per request",
            value=s.new_token_ratio,
        )
        yield CounterMetricFamily(
            "zerogap_completion_tokens", "Output tokens delivered", value=self.router.completion_tokens
        )
        batches = CounterMetricFamily(
            "zerogap_feature_batches",
            "Batches carrying a feature, by what happened: overlapped, fallback (per-batch), normal_loop, "
            "synced (overlapped batches that waited anyway; 0 for a truly full feature)",
            labels=["feature", "how"],
        )
        for row in self.engine.features.matrix():
            for how in ("overlapped", "fallback", "normal_loop", "synced"):
                batches.add_metric([row.feature, how], getattr(row, f"batches_{how}"))
        yield batches
        finished = CounterMetricFamily(
            "zerogap_requests_finished", "Finished requests by reason", labels=["reason"]
        )
        for reason, n in sorted(self.router.finished_by_reason.items()):
            finished.add_metric([reason], n)
        yield finished


def start_metrics_server(port: int, host: str, engine: "Engine", router: "OutputRouter"):
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, router))
    return start_http_server(port, addr=host, registry=registry)
