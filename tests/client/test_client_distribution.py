"""The Python client stands alone: its own distribution (clients/python), fresh stubs, no torch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "clients" / "python"
# What the client may need at run time: grpcio, protobuf, and the standard health service's stubs.
CLIENT_DEPS = {"grpcio", "protobuf", "grpcio-health-checking"}


def _name(requirement: str) -> str:
    for sep in ";<>=![ ~":
        requirement = requirement.split(sep)[0]
    return requirement.strip().lower().replace("_", "-")


def _runtime_closure(names: set[str]) -> set[str]:
    """The installed distributions these need at run time (no extras), transitively."""
    from importlib import metadata

    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [_name(r) for r in metadata.distribution(name).requires or [] if "extra ==" not in r]
    return seen


def _load_generator():
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate_stubs", CLIENT / "generate_stubs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_stubs_are_generated_from_the_current_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    gen = _load_generator()
    fresh = gen.generate(tmp_path)
    for name in gen.STUBS:
        assert (fresh / name).read_text() == (CLIENT / "zerogap" / "v1" / name).read_text(), (
            f"zerogap/v1/{name} is stale: run `make stubs` (python clients/python/generate_stubs.py)"
        )


def test_client_wheel_installs_into_a_fresh_venv_and_imports_no_torch(tmp_path):
    """Build the wheel, install it into a venv that has no torch, with only what it requires beside
    it (grpcio, protobuf, the health stubs and theirs, linked from this interpreter: the check needs
    no network), and use it."""
    src, wheels = tmp_path / "src", tmp_path / "wheels"
    shutil.copytree(
        CLIENT, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )  # builds leave files
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("zerogap_client-*.whl")
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        requires = [
            line.split(":", 1)[1].strip()
            for line in z.read(meta).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]
        packages = {n.split("/")[0] for n in z.namelist() if not n.split("/")[0].endswith(".dist-info")}
    assert {_name(r) for r in requires} == CLIENT_DEPS
    assert packages == {"zerogap"}

    venv = tmp_path / "cv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--target",
            str(site),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr
    from importlib import metadata

    needed = _runtime_closure(CLIENT_DEPS)
    assert "torch" not in needed
    for name in needed:
        dist = metadata.distribution(name)
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops - {"__pycache__"}:
            src = Path(str(dist.locate_file(top)))
            if src.exists() and not (site / top).exists():
                (site / top).symlink_to(src)
    probe = (
        "import sys, importlib.util\n"
        "import zerogap.client as c\n"
        "from zerogap.v1 import generation_pb2\n"
        "assert importlib.util.find_spec('torch') is None, 'torch is importable in the client venv'\n"
        "assert not any(m.split('.')[0] in ('torch', 'service', 'features') for m in sys.modules)\n"
        "print(c.__file__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    out = subprocess.run(
        [str(py), "-I", "-c", probe], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(site))
