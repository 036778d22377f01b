"""The SMG deployment files, checked offline: deploy/k8s/ against the Kubernetes schemas
(kubernetes-validate, schemas bundled), deploy/compose.smg.yml against the Compose Specification,
and the wiring between them (labels, ports, probes, discovery, RBAC)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
COMPOSE_SMG = ROOT / "deploy" / "compose.smg.yml"


def _tool(name: str) -> str:
    exe = Path(sys.executable).parent / name
    if not exe.exists():
        pytest.skip(f"{name} not installed next to {sys.executable} (pip install -e '.[test]')")
    return str(exe)


def _docs() -> dict[tuple[str, str], dict]:
    return {
        (d["kind"], d["metadata"]["name"]): d for f in K8S for d in yaml.safe_load_all(f.read_text()) if d
    }


def test_k8s_manifests_validate_against_the_kubernetes_schemas() -> None:
    assert K8S
    r = subprocess.run(
        [_tool("kubernetes-validate"), "--strict", "--quiet", *map(str, K8S)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_k8s_wiring() -> None:
    docs = _docs()
    workers = docs["Deployment", "zerogap-worker"]
    labels = workers["spec"]["template"]["metadata"]["labels"]
    (c,) = workers["spec"]["template"]["spec"]["containers"]
    port = c["ports"][0]["containerPort"]
    assert c["command"] == ["python", "-m", "service"] and c["args"][:1] == ["serve"]
    assert str(port) in c["args"] and workers["spec"]["replicas"] >= 2
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == port, probe  # grpc.health.v1: NOT_SERVING while draining
    svc = docs["Service", "zerogap-worker"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == labels
    smg = docs["Deployment", "smg"]["spec"]["template"]["spec"]
    args = smg["containers"][0]["args"]
    assert "--service-discovery" in args and "--policy=cache_aware" in args
    selector = args[args.index("--selector") + 1 :]
    assert {f"{k}={v}" for k, v in labels.items()} <= set(selector)
    assert f"--service-discovery-port={port}" in args
    role = docs["Role", "smg-discovery"]["rules"][0]
    assert role["resources"] == ["pods"] and {"list", "watch"} <= set(role["verbs"])
    binding = docs["RoleBinding", "smg-discovery"]
    assert binding["subjects"][0]["name"] == smg["serviceAccountName"] == "smg"


def test_compose_override_validates_and_routes_to_both_workers() -> None:
    r = subprocess.run(
        [_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE_SMG)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    svc = yaml.safe_load(COMPOSE_SMG.read_text())["services"]
    cmd = svc["smg"]["command"]
    urls = cmd[cmd.index("--worker-urls") + 1 :][:2]
    assert urls == ["grpc://worker-a:50051", "grpc://worker-b:50051"]
    for name in ("worker-a", "worker-b"):
        assert svc[name]["image"] == "zerogap:local" and "healthcheck" in svc[name]
        assert svc["smg"]["depends_on"][name]["condition"] == "service_healthy"
    assert svc["smg"]["build"]["dockerfile"] == "deploy/smg.Dockerfile"
    assert "smg==" in (ROOT / "deploy" / "smg.Dockerfile").read_text()
