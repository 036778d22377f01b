"""Server configuration: one dataclass, filled from the command line."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

import torch

from service.models.cpu_features import cpu_features


@dataclass
class ServerArgs:
    """Everything the engine and the gRPC server are configured with."""

    model: str | None = None  # a local Hugging Face directory; None = the default SmolLM2
    host: str = "127.0.0.1"
    port: int = 50051
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bf16 on CUDA and on CPUs with native bf16 matmuls)
    device: str = "auto"  # cpu | cuda | cuda:N | auto (CUDA when available)
    load_format: str = "auto"  # auto: safetensors weights; dummy: random weights (benchmarks)
    max_running_requests: int = 64
    max_queued_requests: int = 1024
    kv_cache_tokens: int | None = None  # None: derived from kv_mem_fraction
    kv_mem_fraction: float = 0.05  # of the memory granted (host, or cgroup limit; CUDA: free GPU memory), when kv_cache_tokens is None
    context_length: int | None = None  # None: the model's max_position_embeddings
    max_prefill_tokens: int = 4096  # tokens per prefill batch
    chunked_prefill_size: int = (
        256  # prompt tokens per step, prompts split across steps; 0 = off (measured: README)
    )
    enable_mixed_chunk: bool = True  # the prefill chunk and the running decodes in one batch
    loop: str = "auto"  # auto | overlap | normal (auto: see default_loop)
    disable_overlap: bool = False  # = loop "normal"
    overlap_policy: str = "per-batch"  # per-batch | global | strict
    disabled_features: list[str] = field(default_factory=list)
    attention_backend: str = "auto"  # torch | triton | auto (triton on CUDA, torch on CPU)
    disable_cuda_graph: bool = False  # CUDA + triton: decode runs as captured CUDA graphs unless set
    cuda_graph_max_bs: int | None = None  # None: max_running_requests
    num_threads: int | None = (
        None  # torch intra-op threads for the forward; None = one per CPU granted (affinity, cgroup quota)
    )
    adapt_cpu_team: bool = True  # shrink the forward's OpenMP team to one thread while the CPUs are contended
    pace_launches: bool = True  # CPU, overlap loop: form the next batch shortly before the running step ends
    trace_file: str | None = None
    log_level: str = "info"  # debug | info | warning | error
    metrics_port: int | None = None  # Prometheus endpoint; None = off
    grace_period_s: float = 30.0  # SIGTERM: time for in-flight requests
    sampling_defaults: str = (
        "model"  # model: generation_config.json's sampling values for unset fields | none
    )
    future_map_size: int | None = None  # None: 3 x max_running_requests + 1
    max_skip_ahead: int = 32  # requests admitted past one waiting for KV, at most (then it gets the room)
    disable_prefix_cache: bool = (
        False  # no reuse of cached prompt prefixes (= --disable-feature prefix_cache)
    )
    # recurrent layers' state snapshots the prefix cache may keep; None: as many as half of the KV
    # share left after the running requests' states holds, at least 8, at most max_running_requests
    # (0: no prefix cache for such models)
    state_snapshots: int | None = None
    grammar_compile_timeout_s: float = 30.0
    tls_cert: str | None = None  # PEM server certificate (chain); with tls_key: serve TLS only
    tls_key: str | None = None
    tls_client_ca: str | None = None  # PEM CA bundle: require and verify client certificates (mTLS)
    auth_token_file: str | None = None  # bearer tokens, one per line (also $ZEROGAP_AUTH_TOKENS)
    auth_open: str = (
        "health"  # services reachable without a token: comma list of health, reflection ("" = none)
    )
    max_message_bytes: int = 16 << 20  # one gRPC request message (RESOURCE_EXHAUSTED beyond)
    max_request_id_bytes: int = 256
    max_stop_strings: int = 16
    max_stop_string_bytes: int = 256
    max_stop_token_ids: int = 64
    grammar_workers: int = 2  # compile worker processes
    grammar_worker_max_rss_mb: int = 2048  # a compile growing its worker past this is stopped
    max_constraint_bytes: int = (
        8 << 20
    )  # schema / regex / EBNF text (compiles are bounded by deadline and memory)
    max_constraint_depth: int = 64  # bracket / parenthesis nesting
    max_constraint_properties: int = 2048  # properties of one JSON-schema object
    constraint_mode: str = "lenient"  # strict | lenient: JSON-schema keywords the grammar cannot enforce
    max_image_bytes: int = 10 << 20  # one image's encoded bytes (INVALID_ARGUMENT beyond)
    max_image_pixels: int = 25_000_000  # one image's width x height, read from its header before decoding
    max_images_per_request: int = 8
    image_workers: int = 2  # threads decoding and preprocessing images (the vision tower has its own)
    image_encoder_cache_mb: int = 256  # image embeddings kept by content hash (LRU)
    # Retraction (features/retraction.py)
    admission_policy: str = "optimistic"  # optimistic | reserve (reserve: prompt + max_new_tokens set aside)
    init_new_token_ratio: float = 0.7  # optimistic: share of max_new_tokens set aside at admission, at first
    min_new_token_ratio: float = 0.1  # ... decaying to this
    new_token_ratio_decay_steps: int = 600  # decode steps from the initial ratio to the minimum
    max_retractions: int = 3  # per request; then it is re-admitted with its whole budget reserved

    def use_overlap(self, device_type: str) -> bool:
        """Whether the engine on this device runs the overlap loop (`--loop`, `--disable-overlap`)."""
        if self.disable_overlap:
            return False
        loop = default_loop(device_type) if self.loop == "auto" else self.loop
        if loop not in ("overlap", "normal"):
            raise ValueError(f"unknown loop {self.loop!r} (auto, overlap, normal)")
        return loop == "overlap"


def default_loop(device_type: str) -> str:
    """What `--loop auto` runs, as measured (README "Serving", docs/benchmarks.md):
    overlap on CUDA (1.4-1.8x the normal loop on an H200: the device idles while Python
    schedules); normal on CPU, where the forward already uses every core, so the scheduler and
    gRPC threads running beside it slow it about as much as overlapping saves (through gRPC on a
    2-core Sapphire Rapids, overlap/normal across six runs: 0.74x-1.19x at 64 streams,
    0.75x-1.02x on one stream). Re-measured on a 2-core AMX Xeon once the scheduler thread's second
    OpenMP team was gone (service/core/omp.py): overlap/normal 1.03x on a 64-stream burst, 1.08x on
    one stream, but the realistic load's TTFT p50 1.11x worse at 1 request/s and 1.33x worse at 3/s
    (a new prompt waits for the step already formed), so CPU stays on the normal loop."""
    return "overlap" if device_type == "cuda" else "normal"


def cpu_has_native_bf16() -> bool:
    """AMX tiles or AVX-512 BF16 (under the ZEROGAP_CPU_ISA cap): bf16 matmuls run natively (else
    they are emulated and ~5x slower than fp32)."""
    return cpu_features().native_bf16


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """The torch dtype for --dtype; `auto` picks the fast one on this machine."""
    if name == "auto":
        if device != "cpu":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unknown dtype {name!r} (auto, float32, bfloat16, float16)")
    return getattr(torch, name)


def build_arg_parser() -> argparse.ArgumentParser:
    """The `serve` sub-command's options, one per ServerArgs field."""
    d = ServerArgs()
    p = argparse.ArgumentParser(prog="python -m service serve", description="Serve a causal LM over gRPC.")
    p.add_argument(
        "--model",
        default=d.model,
        help="local HF model directory (default: SmolLM2-135M-Instruct, prepared on first use)",
    )
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default=d.dtype,
        help="auto: bfloat16 on CUDA and on CPUs with AMX or AVX-512 BF16 (native bf16 matmuls), else float32",
    )
    p.add_argument("--device", default=d.device, help="cpu, cuda[:N] or auto (CUDA when available)")
    p.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        default=d.load_format,
        help="dummy: random weights from the model's config (benchmarks; no weight files needed)",
    )
    p.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=d.max_queued_requests,
        help="a full queue answers RESOURCE_EXHAUSTED",
    )
    p.add_argument("--kv-cache-tokens", type=int, default=d.kv_cache_tokens, help="KV pool size in tokens")
    p.add_argument(
        "--kv-mem-fraction",
        type=float,
        default=d.kv_mem_fraction,
        help="KV pool size as a fraction of the memory granted (the host's, or its cgroup's limit in a container), "
        "or of free GPU memory on CUDA (when --kv-cache-tokens is not given)",
    )
    p.add_argument("--context-length", type=int, default=d.context_length)
    p.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens)
    p.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=d.chunked_prefill_size,
        help="tokens per step for prefill: longer prompts are split across steps (0 = off; README: Chunked prefill)",
    )
    p.add_argument(
        "--enable-mixed-chunk",
        action=argparse.BooleanOptionalAction,
        default=d.enable_mixed_chunk,
        help="run the prefill chunk and the running decodes in one batch (needs --chunked-prefill-size; "
        "on by default, --no-enable-mixed-chunk turns it off)",
    )
    p.add_argument(
        "--loop",
        choices=["auto", "overlap", "normal"],
        default=d.loop,
        help="scheduler loop; auto picks the faster one on this machine (README: Scheduler loops)",
    )
    p.add_argument(
        "--disable-overlap", action="store_true", help="the normal (serial) loop: same as --loop normal"
    )
    p.add_argument(
        "--overlap-policy",
        choices=["per-batch", "global", "strict"],
        default=d.overlap_policy,
        help="per-batch: batches with a feature that cannot overlap run the normal way; global: such a feature "
        "enabled turns overlap off for all; strict: refuse to start when an enabled feature cannot overlap",
    )
    p.add_argument(
        "--disable-feature",
        dest="disabled_features",
        action="append",
        default=[],
        metavar="NAME",
        help="switch a feature module off (repeatable); `python -m service matrix` lists them",
    )
    p.add_argument(
        "--attention-backend",
        choices=["auto", "torch", "torch-sdpa", "triton"],
        default=d.attention_backend,
        help="auto: triton on CUDA, torch on CPU; torch: native paged CPU kernels where built (else SDPA); "
        "torch-sdpa: SDPA over gathered KV only; triton: Triton paged kernels",
    )
    p.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="CUDA: run decode eagerly instead of as captured CUDA graphs (graphs need --attention-backend triton)",
    )
    p.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=d.cuda_graph_max_bs,
        help="largest decode batch captured as a CUDA graph (default: --max-running-requests)",
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=d.num_threads,
        help="torch intra-op threads for the forward pass (default: one per CPU granted: affinity mask, cgroup quota)",
    )
    p.add_argument(
        "--adapt-cpu-team",
        action=argparse.BooleanOptionalAction,
        default=d.adapt_cpu_team,
        help="while other processes contend for the granted CPUs, run the forward on one thread (CPU)",
    )
    p.add_argument(
        "--pace-launches",
        action=argparse.BooleanOptionalAction,
        default=d.pace_launches,
        help="overlap loop on CPU: form the next batch shortly before the running step ends, so that "
        "requests arriving meanwhile join it (else at once, a step later for them)",
    )
    p.add_argument(
        "--log-level",
        default=d.log_level,
        choices=["debug", "info", "warning", "error"],
        help="server log level (debug: also the CPU team's probes and their outcomes)",
    )
    p.add_argument(
        "--trace-file",
        default=d.trace_file,
        help="write a Chrome trace (Perfetto) of the scheduler and forward threads here",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=d.metrics_port,
        help="serve Prometheus metrics over HTTP on this port",
    )
    p.add_argument("--grace-period-s", type=float, default=d.grace_period_s)
    p.add_argument("--future-map-size", type=int, default=d.future_map_size)
    p.add_argument(
        "--max-skip-ahead",
        type=int,
        default=d.max_skip_ahead,
        help="smaller requests admitted past one that waits for KV, at most (bounds how long a big one waits)",
    )
    p.add_argument(
        "--disable-prefix-cache",
        action="store_true",
        help="do not reuse the KV of cached prompt prefixes (same as --disable-feature prefix_cache)",
    )
    p.add_argument(
        "--state-snapshots",
        type=int,
        default=d.state_snapshots,
        help="models with recurrent layers (Qwen3.5, Mamba, ...): snapshots of those layers' states the prefix "
        "cache keeps, each a request slot's worth (default: half of the KV share left after the running requests' "
        "states, at least 8, at most --max-running-requests; 0 = no prefix cache for such models)",
    )
    p.add_argument(
        "--grammar-compile-timeout-s",
        type=float,
        default=d.grammar_compile_timeout_s,
        help="a grammar not compiled this long after its first request is stopped (DEADLINE_EXCEEDED)",
    )
    p.add_argument(
        "--tls-cert",
        default=d.tls_cert,
        help="PEM server certificate (chain); serve TLS only (with --tls-key)",
    )
    p.add_argument("--tls-key", default=d.tls_key, help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-client-ca",
        default=d.tls_client_ca,
        help="PEM CA bundle: require client certificates signed by it (mutual TLS)",
    )
    p.add_argument(
        "--auth-token-file",
        default=d.auth_token_file,
        help="bearer tokens, one per line ('#' comments); also $ZEROGAP_AUTH_TOKENS (comma-separated). "
        "Any token set: every call needs 'authorization: Bearer <token>' (else UNAUTHENTICATED)",
    )
    p.add_argument(
        "--auth-open",
        default=d.auth_open,
        help="services that stay open without a token: comma list of health, reflection ('' = none)",
    )
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=d.max_message_bytes,
        help="largest request message (gRPC answers RESOURCE_EXHAUSTED beyond)",
    )
    p.add_argument(
        "--max-request-id-bytes", type=int, default=d.max_request_id_bytes, help="INVALID_ARGUMENT beyond"
    )
    p.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings, help="INVALID_ARGUMENT beyond")
    p.add_argument(
        "--max-stop-string-bytes", type=int, default=d.max_stop_string_bytes, help="INVALID_ARGUMENT beyond"
    )
    p.add_argument(
        "--max-stop-token-ids", type=int, default=d.max_stop_token_ids, help="INVALID_ARGUMENT beyond"
    )
    p.add_argument(
        "--grammar-workers",
        type=int,
        default=d.grammar_workers,
        help="grammar compile worker processes; at most N-1 run large grammars, so small ones never starve",
    )
    p.add_argument(
        "--grammar-worker-max-rss-mb",
        type=int,
        default=d.grammar_worker_max_rss_mb,
        help="a compile whose worker grows past this is stopped (RESOURCE_EXHAUSTED)",
    )
    p.add_argument(
        "--max-constraint-bytes",
        type=int,
        default=d.max_constraint_bytes,
        help="largest schema / regex / EBNF text (INVALID_ARGUMENT beyond)",
    )
    p.add_argument(
        "--max-constraint-depth",
        type=int,
        default=d.max_constraint_depth,
        help="deepest bracket (JSON) / parenthesis (regex, EBNF) nesting (INVALID_ARGUMENT beyond)",
    )
    p.add_argument(
        "--max-constraint-properties",
        type=int,
        default=d.max_constraint_properties,
        help="most properties in one JSON-schema object (INVALID_ARGUMENT beyond)",
    )
    p.add_argument(
        "--sampling-defaults",
        choices=["model", "none"],
        default=d.sampling_defaults,
        help="model: a request's unset temperature, top_p, top_k, min_p, repetition_penalty and "
        "max_new_tokens take the model's generation_config.json values (as vLLM and SGLang do); "
        "none: the built-in defaults (temperature 1, no truncation, 128 tokens)",
    )
    p.add_argument(
        "--constraint-mode",
        choices=["strict", "lenient"],
        default=d.constraint_mode,
        help="default for requests that leave constraint.mode unset: strict refuses a JSON schema with "
        "keywords the grammar cannot enforce (naming them); lenient relaxes them and reports them",
    )
    p.add_argument(
        "--max-image-bytes",
        type=int,
        default=d.max_image_bytes,
        help="largest encoded image (INVALID_ARGUMENT naming the image beyond)",
    )
    p.add_argument(
        "--max-image-pixels",
        type=int,
        default=d.max_image_pixels,
        help="most pixels (width x height) in one image, checked before decoding (INVALID_ARGUMENT beyond)",
    )
    p.add_argument(
        "--max-images-per-request", type=int, default=d.max_images_per_request, help="INVALID_ARGUMENT beyond"
    )
    p.add_argument(
        "--image-workers",
        type=int,
        default=d.image_workers,
        help="threads that decode and preprocess images (off the scheduler thread)",
    )
    p.add_argument(
        "--image-encoder-cache-mb",
        type=int,
        default=d.image_encoder_cache_mb,
        help="image embeddings kept by content hash, so a repeated image is not encoded again (LRU)",
    )
    p.add_argument(
        "--admission-policy",
        choices=["optimistic", "reserve"],
        default=d.admission_policy,
        help="optimistic: admit on an estimate of the tokens requests will generate and retract requests "
        "when the KV pool runs short; reserve: set aside prompt + max_new_tokens per request",
    )
    p.add_argument(
        "--init-new-token-ratio",
        type=float,
        default=d.init_new_token_ratio,
        help="optimistic admission: share of max_new_tokens set aside per request at first",
    )
    p.add_argument(
        "--min-new-token-ratio",
        type=float,
        default=d.min_new_token_ratio,
        help="optimistic admission: the share decays to this over steps without retraction",
    )
    p.add_argument("--new-token-ratio-decay-steps", type=int, default=d.new_token_ratio_decay_steps)
    p.add_argument(
        "--max-retractions",
        type=int,
        default=d.max_retractions,
        help="a request retracted this often is re-admitted with its whole budget reserved (never retracted again)",
    )
    return p


def parse_server_args(argv: list[str] | None = None) -> ServerArgs:
    ns = build_arg_parser().parse_args(argv)
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    return ServerArgs(**{k: v for k, v in vars(ns).items() if k in names})
