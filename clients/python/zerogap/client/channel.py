"""Channel settings: keepalive, message size, retries of UNAVAILABLE with backoff.

Retries use gRPC's own retry policy (a service config on the channel): an RPC
that fails with a retryable code before any response arrived is sent again after
an exponentially growing, jittered backoff. Streams are retried only until their
first message, so a delta is never delivered twice.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SERVICES = ("zerogap.v1.Generation", "grpc.health.v1.Health")


@dataclass(frozen=True)
class RetryPolicy:
    """gRPC retry policy. max_attempts counts the first try; gRPC caps it at 5."""

    max_attempts: int = 4
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    backoff_multiplier: float = 2.0
    codes: Sequence[str] = ("UNAVAILABLE",)

    def __post_init__(self) -> None:
        if not 2 <= self.max_attempts <= 5:
            raise ValueError("max_attempts must be in [2, 5] (gRPC caps it at 5)")
        if self.initial_backoff_s <= 0 or self.max_backoff_s <= 0 or self.backoff_multiplier <= 0:
            raise ValueError("backoffs and multiplier must be > 0")

    def service_config(self) -> str:
        policy = {
            "maxAttempts": self.max_attempts,
            "initialBackoff": f"{self.initial_backoff_s:g}s",
            "maxBackoff": f"{self.max_backoff_s:g}s",
            "backoffMultiplier": self.backoff_multiplier,
            "retryableStatusCodes": list(self.codes),
        }
        return json.dumps(
            {"methodConfig": [{"name": [{"service": s} for s in SERVICES], "retryPolicy": policy}]}
        )


@dataclass(frozen=True)
class ChannelOptions:
    """How the client's channel behaves.

    keepalive_time_s: ping an idle connection this often while calls are open
    (detects dead peers behind NATs and load balancers; the server accepts pings
    every 10 s or more); None disables. retry: None disables retries.
    wait_for_ready: calls wait for a connection (up to their deadline) instead of
    failing fast with UNAVAILABLE while the server is unreachable.
    reconnect_backoff_max_s: the longest wait between two connection attempts to an
    unreachable server (gRPC's default grows to 120 s: a client started before its
    server would stay UNAVAILABLE for minutes after the server came up)."""

    max_message_bytes: int = 64 << 20
    keepalive_time_s: float | None = 30.0
    keepalive_timeout_s: float = 10.0
    retry: RetryPolicy | None = field(default_factory=RetryPolicy)
    wait_for_ready: bool = False
    reconnect_backoff_max_s: float = 5.0
    extra: Sequence[tuple[str, Any]] = ()  # raw gRPC channel arguments, appended last

    def grpc_options(self) -> list[tuple[str, Any]]:
        opts: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.enable_retries", int(self.retry is not None)),
            ("grpc.initial_reconnect_backoff_ms", min(1000, int(self.reconnect_backoff_max_s * 1000))),
            ("grpc.max_reconnect_backoff_ms", int(self.reconnect_backoff_max_s * 1000)),
        ]
        if self.keepalive_time_s is not None:
            opts += [
                ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
                ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ]
        if self.retry is not None:
            opts.append(("grpc.service_config", self.retry.service_config()))
        return opts + list(self.extra)
