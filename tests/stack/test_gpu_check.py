"""bench/gpu_check.py runs end to end on CPU (tiny shapes, kernels in the Triton interpreter): a
tiny Llama and a tiny Qwen3-MoE through both loops, the attention and fused-MoE kernels; and the
matrix renders what its feature part measured (`python -m service matrix --measured`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.engine.modules import builtin_features
from service.matrix import Measured, main, matrix_table, measured_cell

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ("logprobs", "constrained", "chunked_prefill", "prefix_cache", "retraction", "multimodal", "all")


def test_gpu_check_runs_on_cpu(smol_dir, tmp_path, capsys):
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

    # 4. every feature alone and all together, both loops, measured from the matrix counters
    feats = res["features"]
    rows = {w["workload"]: w for w in feats["workloads"]}
    assert tuple(rows) == WORKLOADS
    for w in rows.values():
        assert w["ok"] and w["identical_tokens"] and w["first_difference"] is None, w
        for r in (w["normal"], w["overlap"]):
            assert (
                r["forward_pairs"] > 0 and r["median_forward_ms"] > 0 and 0 < r["device_busy_fraction"] <= 1
            )
            assert r["host_syncs"] is None and r["kv_all_free"]  # syncs are counted on CUDA only
        assert w["gap_ratio"] is not None and w["speedup"] > 0
    assert set(rows["all"]["verdicts"]) == {f.name for f in builtin_features()}
    assert rows["retraction"]["overlap"]["retractions"] > 0
    assert rows["prefix_cache"]["overlap"]["prefix_cache_hit_tokens"] > 0
    assert rows["chunked_prefill"]["overlap"]["counters"]["chunked_prefill"]["overlapped"] > 0
    verdicts = feats["verdicts"]
    assert set(verdicts) == set(WORKLOADS) - {"all"}
    assert all(
        v["measured"] in ("full", "sync point", "none") and v["batches"] > 0 for v in verdicts.values()
    )
    # Retraction's drain of the batches in flight is its declared sync event, counted apart: its
    # batches overlap.
    r = verdicts["retraction"]
    assert r["measured"] == "full" and r["event_syncs"] > 0 and r["sync_event"] == "retraction event"
    assert not r["contradicts"]
    assert verdicts["logprobs"]["measured"] == "full" and not verdicts["logprobs"]["contradicts"]

    # the matrix with the measured column, from the JSON as written
    assert main(["--measured", str(out)]) == 0
    table = capsys.readouterr().out.strip().splitlines()
    assert feats["setup"] == "tiny, float32, quick"
    assert table[0].endswith(f"| measured on {feats['device']} (tiny, float32, quick; gap overlap/normal) |")
    body = {line.split(" | ")[0].lstrip("| "): line for line in table[2:]}
    assert set(body) == {f.name for f in builtin_features()}
    assert all(line.count(" | ") == 3 for line in body.values())
    assert " sync points, one per retraction event)" in body["retraction"]
    assert body["retraction"].startswith("| retraction | full; sync point at each retraction event |")
    assert "host syncs n/a" in body["logprobs"] and "gap " in body["logprobs"]


def test_measured_cells_show_contradictions():
    """Unit: how a verdict reads in the column (no run)."""
    full = dict(declared="full", measured="full", batches=12, synced=0, host_syncs=0, identical_tokens=True)
    assert measured_cell(dict(full, gap_overlap_ms=0.007, gap_normal_ms=1.3, speedup=1.5)) == (
        "full (12 batches), gap 0.007/1.300 ms, 1.50x, 0 host syncs"
    )
    events = dict(full, event_syncs=4, sync_event="retraction event")
    assert measured_cell(events).startswith("full (12 batches; 4 sync points, one per retraction event)")
    synced = dict(full, measured="sync point", synced=3, contradicts=True)
    assert measured_cell(synced).startswith("**contradicts 'full'**: sync point (3 of 12 batches waited)")
    differ = measured_cell(dict(full, identical_tokens=False, contradicts=True))
    assert "**tokens differ between the loops**" in differ
    counted = measured_cell(dict(full, identical_tokens=False, identical_requests="41/72", contradicts=True))
    assert "**tokens differ between the loops** (41 of 72 requests identical)" in counted
    assert "all together: sync point" in measured_cell(full, dict(synced))
    m = Measured.from_check(dict(features=dict(device="NVIDIA H200", verdicts={"logprobs": full})))
    table = matrix_table(m)
    assert "| measured on NVIDIA H200 (gap overlap/normal) |" in table.splitlines()[0]
    assert "| not measured |" in table  # the features its run did not cover
    with pytest.raises(ValueError, match="no feature measurements"):
        Measured.from_check(dict(kernels=[]))
