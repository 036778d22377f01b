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


def _smg_args(args: list[str]):
    """The gateway's own parser (smg 1.13's `launch` flags; a misspelt flag exits 2) over `args`."""
    launch_router = pytest.importorskip("smg.launch_router", reason="smg: pip install -e '.[test]'")
    assert args[0] == "launch", args
    try:
        return launch_router.parse_router_args(args[1:])
    except SystemExit as e:
        raise AssertionError(f"smg launch refuses {args[1:]} (exit {e.code})") from None


def _restricted(pod: dict) -> None:
    """The "restricted" Pod Security Standard's checks these pods meet (a namespace enforcing it admits them)."""
    sec = pod["securityContext"]
    assert sec["runAsNonRoot"] and sec["seccompProfile"]["type"] == "RuntimeDefault"
    for c in pod["containers"]:
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


def _selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_k8s_wiring() -> None:
    docs = _docs()
    workers = docs["Deployment", "zerogap-worker"]
    pod = workers["spec"]["template"]["spec"]
    labels = workers["spec"]["template"]["metadata"]["labels"]
    assert _selects(workers["spec"]["selector"]["matchLabels"], labels)
    (c,) = pod["containers"]
    port = c["ports"][0]["containerPort"]
    assert c["command"] == ["python", "-m", "service"] and c["args"][:1] == ["serve"]
    assert str(port) in c["args"] and workers["spec"]["replicas"] >= 2
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == port, probe  # grpc.health.v1: NOT_SERVING while draining
    # The KV pool is allocated whole at start, as a share of the cgroup's memory limit: sized
    # explicitly against the limit; threads follow the CPU limit (the cgroup quota).
    limits = c["resources"]["limits"]
    assert {"cpu", "memory"} <= set(limits) and {"--kv-mem-fraction", "--kv-cache-tokens"} & set(c["args"])
    _restricted(pod)
    svc = docs["Service", "zerogap-worker"]
    assert svc["spec"]["clusterIP"] == "None" and _selects(svc["spec"]["selector"], labels)

    smg_deploy = docs["Deployment", "smg"]
    smg = smg_deploy["spec"]["template"]["spec"]
    smg_labels = smg_deploy["spec"]["template"]["metadata"]["labels"]
    assert _selects(smg_deploy["spec"]["selector"]["matchLabels"], smg_labels)
    assert _selects(docs["Service", "smg"]["spec"]["selector"], smg_labels)
    _restricted(smg)
    args = _smg_args(smg["containers"][0]["args"])
    assert args.service_discovery and args.policy == "cache_aware"
    assert _selects(args.selector, labels)  # discovery finds exactly the worker pods
    assert args.service_discovery_port == port
    assert smg["terminationGracePeriodSeconds"] > args.shutdown_grace_period_secs  # streams finish first
    role = docs["Role", "smg-discovery"]
    assert role["rules"][0]["resources"] == ["pods"] and {"list", "watch"} <= set(role["rules"][0]["verbs"])
    binding = docs["RoleBinding", "smg-discovery"]
    assert binding["roleRef"]["kind"] == "Role" and binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == smg["serviceAccountName"]
    assert docs["ServiceAccount", smg["serviceAccountName"]]

    policy = docs["NetworkPolicy", "zerogap-worker"]["spec"]  # only the gateway reaches the workers
    assert _selects(policy["podSelector"]["matchLabels"], labels)
    (rule,) = policy["ingress"]
    assert [_selects(f["podSelector"]["matchLabels"], smg_labels) for f in rule["from"]] == [True]
    assert [p["port"] for p in rule["ports"]] == [c["ports"][0]["name"]]


def test_compose_override_validates_and_routes_to_both_workers() -> None:
    r = subprocess.run(
        [_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE_SMG)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    svc = yaml.safe_load(COMPOSE_SMG.read_text())["services"]
    args = _smg_args(svc["smg"]["command"])
    assert args.worker_urls == ["grpc://worker-a:50051", "grpc://worker-b:50051"]
    assert args.policy == "cache_aware"
    for name in ("worker-a", "worker-b"):
        assert svc[name]["image"] == "zerogap:local" and "healthcheck" in svc[name]
        assert svc["smg"]["depends_on"][name]["condition"] == "service_healthy"
    assert svc["smg"]["build"]["dockerfile"] == "deploy/smg.Dockerfile"
    assert "smg==" in (ROOT / "deploy" / "smg.Dockerfile").read_text()
