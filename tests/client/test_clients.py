"""The example clients in clients/ (Node.js, Go, C++), each built from proto/ and run against a real server.

Each example prints one line per step (health, generate, delta..., stream-done, json, error, deadline,
image);
the test reads them as they come and checks that tokens arrived as a stream (the request was still
generating when the first delta was printed), that the constrained result parses and validates, and
that the error and the deadline report the right status (and the deadline's request was freed).

Builds are cached under $ZEROGAP_CACHE/clients/LANG-<checkout> (default ~/.cache/zerogap/...),
Node's packages in clients/node/node_modules (gitignored), so reruns only run the examples. A
missing toolchain fails the test under CI (.ci/run installs them) and skips it, naming the
install command, elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest

from service.config import ServerArgs
from service.model_prep import cache_root
from service.server import BackgroundServer
from tests.helpers import PERSON_SCHEMA, kv_idle, need_tools, wait_until

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ROOT / "clients"
BUILD_TIMEOUT_S = 1200  # a first C++ build on 2 busy cores


def build_dir(lang: str) -> Path:
    """A build folder per checkout (CMake ties a build folder to one source folder)."""
    key = hashlib.sha1(str(CLIENTS).encode()).hexdigest()[:10]
    return cache_root() / "clients" / f"{lang}-{key}"


def run(cmd: list[str], cwd: Path) -> None:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def build_node() -> list[str]:
    need_tools(["node", "npm"], "apt-get install nodejs npm")
    here = CLIENTS / "node"
    installed = here / "node_modules" / ".package-lock.json"
    if not installed.exists() or installed.stat().st_mtime < (here / "package-lock.json").stat().st_mtime:
        run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], here)
    return ["node", str(here / "client.js")]


def build_go() -> list[str]:
    need_tools(
        ["go", "protoc", "protoc-gen-go", "protoc-gen-go-grpc"],
        "apt-get install golang-go golang-google-grpc-dev golang-github-golang-protobuf-1-5-dev "
        "protoc-gen-go protoc-gen-go-grpc protobuf-compiler",
    )
    out = build_dir("go")
    run(["sh", str(CLIENTS / "go" / "build.sh"), str(out)], CLIENTS / "go")
    return [str(out / "bin" / "zerogap-example")]


def build_cpp() -> list[str]:
    need_tools(
        ["cmake", "g++", "pkg-config", "protoc", "grpc_cpp_plugin"],
        "apt-get install cmake g++ pkg-config libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev",
    )
    out = build_dir("cpp")
    run(
        ["cmake", "-S", str(CLIENTS / "cpp"), "-B", str(out), "-DCMAKE_BUILD_TYPE=", "-DCMAKE_CXX_FLAGS=-O0"],
        CLIENTS,
    )
    run(["cmake", "--build", str(out), "-j2"], CLIENTS)
    return [str(out / "zerogap-example")]


@pytest.fixture(scope="module")
def server(smol_dir):
    srv = BackgroundServer(
        ServerArgs(model=str(smol_dir), port=0, kv_cache_tokens=4096, max_running_requests=8)
    )
    yield srv
    srv.stop()


def code(name: str) -> str:
    """A status name in one spelling: INVALID_ARGUMENT and Go's InvalidArgument both give invalidargument."""
    return name.replace("_", "").lower()


@pytest.mark.parametrize("build", [build_node, build_go, build_cpp], ids=["node", "go", "cpp"])
def test_example_client(build, server):
    cmd = build()
    proc = subprocess.Popen([*cmd, server.address], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, live_at_first_delta = [], None
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("delta:") and live_at_first_delta is None:
            live_at_first_delta = server.engine.num_live()
        lines.append(line.rstrip("\n"))
    err = proc.stderr.read() if proc.stderr else ""
    assert proc.wait(timeout=300) == 0, "\n".join(lines) + "\n" + err
    steps = {}
    for line in lines:
        key, _, value = line.partition(": ")
        steps.setdefault(key, []).append(value)

    assert steps["health"] == ["SERVING"]
    assert re.search(r"finish=FINISH_REASON_(STOP|LENGTH) tokens=[1-9]", steps["generate"][0])
    assert len(steps["delta"]) > 1 and steps["stream-done"] == ["finish=FINISH_REASON_LENGTH tokens=48"]
    assert live_at_first_delta == 1, "the first delta was printed only after the generation had ended"
    jsonschema.validate(json.loads(steps["json"][0]), PERSON_SCHEMA)
    status, _, message = steps["error"][0].partition(" ")
    assert code(status) == "invalidargument" and "input.text" in message
    assert code(steps["deadline"][0]) == "deadlineexceeded"
    assert wait_until(lambda: kv_idle(server), 20), "the request cut by the deadline kept its KV cache"
    status, _, message = steps["image"][0].partition(" ")  # the part arrived as an image:
    assert code(status) == "failedprecondition" and "text-only" in message  # refused by a text-only model
