"""Prometheus metrics of a server, in a registry of its own (several apps in one process do not collide)."""

from __future__ import annotations

from typing import Any

from fastdit.serve import require
from fastdit.serve.worker import JobResult

__all__ = ["Metrics"]

# Latencies from a tiny model on a CPU (tens of milliseconds) to a large one on a GPU (minutes).
_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """Request counts by endpoint and status, latency histograms, queue depth, images and cache steps.

    ``fastdit_cache_hit_ratio`` is cached steps over all transformer steps since the server started.
    """

    def __init__(self) -> None:
        prometheus = require("prometheus_client")
        self._prometheus = prometheus
        self.registry = prometheus.CollectorRegistry()
        options: dict[str, Any] = {"registry": self.registry}
        self.requests = prometheus.Counter(
            "fastdit_requests", "HTTP requests by endpoint and status code.", ["endpoint", "status"], **options
        )
        self.latency = prometheus.Histogram(
            "fastdit_request_seconds", "HTTP request latency by endpoint.", ["endpoint"], buckets=_BUCKETS, **options
        )
        self.run_seconds = prometheus.Histogram(
            "fastdit_pipeline_seconds", "Seconds each job spent in the pipeline.", buckets=_BUCKETS, **options
        )
        self.queue_depth = prometheus.Gauge("fastdit_queue_depth", "Requests waiting or running.", **options)
        self.images = prometheus.Counter("fastdit_images", "Images generated.", **options)
        self.dropped = prometheus.Counter(
            "fastdit_dropped_requests", "Queued requests dropped because their client disconnected.", **options
        )
        self.cache_steps = prometheus.Counter(
            "fastdit_cache_steps", "Transformer steps by outcome (cached or computed).", ["outcome"], **options
        )
        self._steps = [0, 0]  # cached, all
        self.cache_hit_ratio = prometheus.Gauge(
            "fastdit_cache_hit_ratio", "Cached transformer steps over all steps since start.", **options
        )
        self.cache_hit_ratio.set_function(lambda: self._steps[0] / self._steps[1] if self._steps[1] else 0.0)

    def observe(self, endpoint: str, status: int, seconds: float) -> None:
        """Count one HTTP request."""
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        self.latency.labels(endpoint=endpoint).observe(seconds)

    def record_run(self, result: JobResult) -> None:
        """Count one finished job."""
        self.run_seconds.observe(result.run_s)
        self.images.inc(len(result.outputs))
        steps, cached = result.cache.get("steps", 0), result.cache.get("cached_steps", 0)
        self.cache_steps.labels(outcome="cached").inc(cached)
        self.cache_steps.labels(outcome="computed").inc(steps - cached)
        self._steps[0] += cached
        self._steps[1] += steps

    def render(self) -> tuple[bytes, str]:
        """The text exposition format and its content type."""
        return self._prometheus.generate_latest(self.registry), self._prometheus.CONTENT_TYPE_LATEST
