"""Shared CPUs: the server's speed quiet and beside a CPU hog on each core, per thread set-up.

Users run servers in containers with CPU quotas and beside noisy neighbours. OpenMP teams that
spin-wait on, or outnumber, the cores they actually get collapse there: every parallel region
waits for its slowest member, and a member whose core runs a hog waits for its next time slice.
This bench starts the server once per set-up (``--setups``), runs a single stream and a
16-stream load quiet, then again with one busy-looping process per granted CPU, and reports each
set-up's slowdown (hog / quiet time per token).

Set-ups: ``default`` (the engine's own choice: one thread per granted CPU, its team shrinking
while the cores are contended), ``static`` (the same threads, never shrinking:
``--no-adapt-cpu-team``), ``passive`` (static, with ``OMP_WAIT_POLICY=PASSIVE``: workers sleep at
once instead of spinning), ``one-thread`` (``--num-threads 1``).

``docker-cpus=N`` runs the server of a built image (``--image``, default ``zerogap:local``; this
checkout's code mounted over the image's) under ``docker run --cpus N``, the hogs on the host.

Usage:
    .venv/bin/python bench/bench_contention.py [--setups default,static,passive,one-thread,docker-cpus=1.5]
        [--tokens 32] [--dtype auto] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_serving import ServerProcess, build_prompts, free_port, make_request, one_stream  # noqa: E402

from service.model_prep import prepare_default_model  # noqa: E402
from zerogap.client import AsyncClient  # noqa: E402

SETUPS: dict[str, tuple[list[str], dict[str, str]]] = {  # server flags, environment
    "default": ([], {}),
    "static": (["--no-adapt-cpu-team"], {}),
    "passive": (["--no-adapt-cpu-team"], {"OMP_WAIT_POLICY": "PASSIVE"}),
    "one-thread": (["--num-threads", "1"], {}),
}


def _hog() -> None:
    while True:
        pass


class Hogs:
    """One busy-looping process per CPU of this process's affinity mask, pinned to it."""

    def __init__(self) -> None:
        self.procs: list[mp.Process] = []

    def __enter__(self) -> "Hogs":
        for cpu in sorted(os.sched_getaffinity(0)):
            p = mp.Process(target=_hog, daemon=True)
            p.start()
            os.sched_setaffinity(p.pid, {cpu})
            self.procs.append(p)
        time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
            p.join()


@dataclass
class Phase:
    streams: int
    tokens: int
    wall_s: float

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.wall_s


async def _load(address: str, streams: int, requests: int, tokens: int) -> Phase:
    prompts = build_prompts(requests)
    async with AsyncClient(address, timeout=None) as client:
        sem = asyncio.Semaphore(streams)
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(one_stream(client, make_request(p, tokens, True), sem) for p in prompts)
        )
        return Phase(streams, sum(r[2] for r in results), time.perf_counter() - t0)


class DockerServer:
    """The image's server in a container limited to `cpus` CPUs, published on a loopback port."""

    def __init__(self, image: str, cpus: str, dtype: str, timeout_s: float = 300.0):
        self.port = free_port()
        mounts = [arg for d in ("service", "features") for arg in ("-v", f"{ROOT / d}:/app/{d}:ro")]
        self.cid = subprocess.run(
            [
                "docker",
                "run",
                "-d",
                "--rm",
                "--cpus",
                cpus,
                "-p",
                f"127.0.0.1:{self.port}:50051",
                *mounts,
                image,
                "python",
                "-m",
                "service",
                "serve",
                "--host",
                "0.0.0.0",
                "--port",
                "50051",
                "--dtype",
                dtype,
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        deadline = time.monotonic() + timeout_s
        while "listening" not in self.logs():
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the container's server did not come up")
            time.sleep(0.5)

    def logs(self) -> str:
        r = subprocess.run(["docker", "logs", self.cid], capture_output=True, text=True)
        return r.stdout + r.stderr

    def stop(self) -> None:
        subprocess.run(["docker", "stop", "-t", "10", self.cid], capture_output=True)


def run_setup(name: str, args: argparse.Namespace) -> dict:
    if name.startswith("docker-cpus="):
        flags, env = ["docker", "run", "--cpus", name.split("=", 1)[1]], {}
        server = DockerServer(args.image, name.split("=", 1)[1], args.dtype)
        read_log = server.logs
    else:
        flags, env = SETUPS[name]
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "service",
            "serve",
            "--model",
            args.model,
            "--port",
            str(port),
            "--dtype",
            args.dtype,
            *flags,
        ]
        server = ServerProcess(cmd, port, env=env)
        read_log = lambda: Path(server.log.name).read_text(errors="replace")  # noqa: E731
    address = f"127.0.0.1:{server.port}"
    out: dict = {"setup": name, "flags": flags, "env": env}
    try:
        asyncio.run(_load(address, 2, 2, 8))  # warm-up
        for label, hogged in (("quiet", False), ("hog", True)):
            with Hogs() if hogged else contextlib.nullcontext():
                single = asyncio.run(_load(address, 1, 2, args.tokens))
                many = asyncio.run(_load(address, 16, 16, args.tokens))
            out[label] = {"single_tok_s": single.tok_per_s, "16_streams_tok_s": many.tok_per_s}
            print(
                f"[contention] {name:10s} {label:5s}: single {single.tok_per_s:6.1f} tok/s, "
                f"16 streams {many.tok_per_s:6.1f} tok/s",
                file=sys.stderr,
                flush=True,
            )
        log = read_log()
        out["engine_cpu_line"] = next(
            (ln.split("CPU: ", 1)[1] for ln in log.splitlines() if "CPU: " in ln), ""
        )
    finally:
        server.stop()
    out["slowdown"] = {k: out["quiet"][k] / out["hog"][k] for k in out["quiet"]}
    return out


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--model", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--image", default="zerogap:local", help="for docker-cpus=N set-ups")
    args = p.parse_args(argv)
    args.model = str(args.model or prepare_default_model())
    report = {
        "cpu": cpu_model(),
        "cpus": len(os.sched_getaffinity(0)),
        "loadavg_at_start": os.getloadavg()[0],
        "setups": [run_setup(s.strip(), args) for s in args.setups.split(",") if s.strip()],
    }
    print(f"\n{report['cpu']}, {report['cpus']} CPUs; slowdown = quiet tok/s / tok/s beside one hog per CPU")
    print(
        f"{'setup':12s} {'single quiet':>12s} {'single hog':>10s} {'x':>6s} {'16s quiet':>10s} {'16s hog':>8s} {'x':>6s}"
    )
    for r in report["setups"]:
        q, h, s = r["quiet"], r["hog"], r["slowdown"]
        print(
            f"{r['setup']:12s} {q['single_tok_s']:12.1f} {h['single_tok_s']:10.1f} {s['single_tok_s']:6.2f} "
            f"{q['16_streams_tok_s']:10.1f} {h['16_streams_tok_s']:8.1f} {s['16_streams_tok_s']:6.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
