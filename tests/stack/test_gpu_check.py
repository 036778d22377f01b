"""bench/gpu_check.py runs end to end on CPU (tiny shapes, kernels in the Triton interpreter): a
tiny Llama and a tiny Qwen3-MoE through both loops, the attention and fused-MoE kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_on_cpu(smol_dir, tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            "--device",
            "cpu",
            "--quick",
            "--tokenizer",
            str(smol_dir),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["ok"] and res["info"]["interpret"]
    assert res["kernels"] and all(r["ok"] and r["store_ok"] for r in res["kernels"])
    assert any(r["case"].startswith("moe ") for r in res["kernels"])
    assert [loop["model"] for loop in res["loops"]] == ["tiny", "tiny-moe"]
    for loop in res["loops"]:
        assert loop["identical_tokens"]
        for r in (loop["normal"], loop["overlap"]):
            assert r["decode_pairs"] > 0 and r["median_decode_forward_ms"] > 0
