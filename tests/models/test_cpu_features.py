"""Every CPU path checks what it needs (service/models/cpu_features.py, service/engine/cpu_threads.py).

The CPU-specific tests run once more with AVX-512 forced off (ZEROGAP_CPU_ISA=avx2, torch's and
oneDNN's own caps too) and once without AVX-512 BF16/AMX, so an AVX2-only machine's paths (plain
bf16 linears, the portable kernel variant, `--dtype auto` -> float32) are covered on any machine.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from service.config import ServerArgs, resolve_dtype
from service.core.request import SamplingParams
from service.engine.cpu_threads import CpuGrant, _cgroup_quota, cpu_grant, granted_memory_bytes
from service.engine.engine import SyncClient, collect
from service.models import cpu_features as cf
from service.models.linear import packed_twin

ROOT = Path(__file__).resolve().parents[2]
ZEN4 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
SPR = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8", "avx512_fp16"}
AVX2_ENV = {"ZEROGAP_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def features(flags: set[str], cap: str = "native", onednn: str = "") -> cf.CpuFeatures:
    return cf.CpuFeatures(model="test", flags=cf._capped(set(flags), cap), cap=cap, onednn_cap=onednn)


def test_caps_remove_what_they_name():
    spr, zen3 = features(SPR), features({"avx2", "fma"})
    assert spr.native_bf16 and spr.onednn_packs_bf16 and spr.amx_bf16
    assert not zen3.native_bf16 and not zen3.onednn_packs_bf16 and zen3.avx2
    as_zen3 = features(SPR, "avx2")
    assert not as_zen3.avx512 and not as_zen3.native_bf16 and not as_zen3.onednn_packs_bf16
    assert as_zen3.compile_flags() == ["-march=native", "-mno-avx512f"]
    as_icelake = features(SPR, "avx512")
    assert as_icelake.avx512 and not as_icelake.avx512_bf16 and not as_icelake.amx_bf16
    assert as_icelake.onednn_packs_bf16 and not as_icelake.native_bf16
    assert "-mno-avx512bf16" in as_icelake.compile_flags()
    assert not features(SPR, onednn="AVX2").onednn_packs_bf16  # oneDNN capped below AVX512_CORE
    assert features(SPR, onednn="AVX512_CORE").onednn_packs_bf16
    # bf16 prefill attention only where oneDNN may use AMX (else it rounds past the tolerance)
    assert features(SPR).onednn_amx_bf16 and features(SPR, onednn="AVX10_1_512_AMX").onednn_amx_bf16
    assert not features(SPR, onednn="AVX512_CORE_BF16").onednn_amx_bf16
    assert not features(SPR, "avx512").onednn_amx_bf16 and not features(ZEN4).onednn_amx_bf16
    assert features(
        {"avx2", "fma", "avx_ne_convert"}
    ).onednn_packs_bf16  # Intel client CPUs with AVX-NE-CONVERT
    with pytest.raises(ValueError, match="ZEROGAP_CPU_ISA='sse9'"):
        cf.parse_cap("sse9")


def test_this_machine_is_described_by_its_flags_and_caps():
    cpu = cf.cpu_features()
    assert cpu.cap in cf.ISA_CAPS and cpu.model in cpu.describe()
    if cpu.cap == "avx2":
        assert not cpu.avx512 and "-mno-avx512f" in cpu.compile_flags()
    assert resolve_dtype("auto") == (torch.bfloat16 if cpu.native_bf16 else torch.float32)


def test_bf16_linears_pack_only_where_onednn_can():
    """oneDNN raises on bf16 packing without AVX-512 BW/VL/DQ (a Zen 3): the layer then stays plain."""
    w = torch.randn(48, 32).bfloat16()
    packed = packed_twin(w)
    assert (packed is not None) == cf.cpu_features().onednn_packs_bf16


# ---- the CPUs actually granted -------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_the_tightest_on_the_path(tmp_path):
    _write(tmp_path / "cpu.max", "max 100000\n")
    _write(tmp_path / "kubepods" / "cpu.max", "400000 100000\n")
    _write(tmp_path / "kubepods" / "pod1" / "cpu.max", "150000 100000\n")
    _write(tmp_path / "kubepods" / "pod1" / "c1" / "cpu.max", "max 100000\n")
    assert _cgroup_quota(tmp_path, "0::/kubepods/pod1/c1\n") == 1.5
    assert _cgroup_quota(tmp_path, "0::/\n") is None
    # In a container's own cgroup namespace the path is "/" and its limit lies at the root.
    _write(tmp_path / "ns" / "cpu.max", "200000 100000\n")
    assert _cgroup_quota(tmp_path / "ns", "0::/\n") == 2.0


def test_cgroup_v1_quota(tmp_path):
    _write(tmp_path / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "50000\n")
    _write(tmp_path / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    _write(tmp_path / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    _write(tmp_path / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    text = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n"
    assert _cgroup_quota(tmp_path, text) == 0.5
    assert _cgroup_quota(tmp_path, "3:cpu,cpuacct:/\n") is None


def test_memory_granted_is_the_cgroup_limit_where_less_than_the_machine(tmp_path):
    """A pod limited to 1 GiB sizes its KV share from 1 GiB, not from the node's memory (the pool is
    zero-filled at start: sized from the node, it outgrows the limit and the pod is OOM-killed)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    proc = tmp_path / "self_cgroup"
    v2 = tmp_path / "v2"
    _write(v2 / "memory.max", "max\n")
    _write(v2 / "kubepods" / "memory.max", "8589934592\n")
    _write(v2 / "kubepods" / "pod1" / "memory.max", "1073741824\n")
    _write(v2 / "kubepods" / "pod1" / "c1" / "memory.max", "max\n")
    _write(proc, "0::/kubepods/pod1/c1\n")
    assert granted_memory_bytes(v2, proc) == min(physical, 1 << 30)
    _write(proc, "0::/\n")
    assert granted_memory_bytes(v2, proc) == physical  # no limit on the path: the machine's
    v1 = tmp_path / "v1"  # "no limit" in v1 is a page-rounded 2^63 - 1
    _write(v1 / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")
    _write(v1 / "memory" / "docker" / "abc" / "memory.limit_in_bytes", "536870912\n")
    _write(proc, "5:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    assert granted_memory_bytes(v1, proc) == min(physical, 512 << 20)
    _write(proc, "5:memory:/\n")
    assert granted_memory_bytes(v1, proc) == physical
    assert granted_memory_bytes(tmp_path / "none", tmp_path / "missing") == physical


def test_threads_follow_the_grant():
    assert CpuGrant(affinity=64, quota=2.0, online=64).threads == 2  # a 2-CPU pod on a 64-core node
    assert CpuGrant(affinity=64, quota=1.5, online=64).threads == 2
    assert CpuGrant(affinity=64, quota=0.5, online=64).threads == 1
    assert CpuGrant(affinity=3, quota=None, online=64).threads == 3  # taskset / cpuset
    assert CpuGrant(affinity=2, quota=8.0, online=2).threads == 2
    assert "2 threads" in CpuGrant(affinity=64, quota=2.0, online=64).describe()
    real = cpu_grant()
    assert 1 <= real.threads <= real.online


def test_engine_says_what_it_runs_on(tiny_llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger="zerogap"):
        client = SyncClient(
            ServerArgs(dtype="float32", kv_cache_tokens=256, max_running_requests=2), tiny_llama_dir
        )
    try:
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU: "))
        assert cf.cpu_features().describe() in line and "threads" in line
        assert torch.get_num_threads() == cpu_grant().threads
    finally:
        client.close()


def test_bfloat16_runs_where_it_is_emulated_and_says_so(tiny_llama_dir, caplog):
    """`--dtype bfloat16` serves on any x86-64 CPU: here with the CPU's bf16 support as it is; the
    same on a CPU without it is run by the AVX-512-off pass below."""
    with caplog.at_level(logging.WARNING, logger="zerogap"):
        client = SyncClient(
            ServerArgs(dtype="bfloat16", kv_cache_tokens=256, max_running_requests=2), tiny_llama_dir
        )
    try:
        ids = collect(
            client.generate(
                [list(range(5, 15))], SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
            )[0]
        )[0]
        assert len(ids) == 6
        emulated = any("runs emulated" in r.getMessage() for r in caplog.records)
        assert emulated == (not cf.cpu_features().native_bf16)
    finally:
        client.close()


# ---- the CPU-specific tests once more, as an AVX2-only machine runs them -------------------------

CAPPED_PASS = [
    "tests/models/test_cpu_features.py",
    "tests/models/test_cpu_speed_paths.py",
    "tests/engine/test_extend_rows.py",
    "tests/models/test_moe.py::test_native_bf16_experts_equal_the_dense_reference",
    "tests/models/test_moe.py::test_native_bf16_experts_give_a_token_the_same_bits_alone_or_in_a_batch",
    "tests/models/test_moe.py::test_long_prompts_take_the_torch_matmuls",
    "tests/features/test_multimodal.py::test_bfloat16_engine_serves_images",
    "tests/models/test_hybrid_models.py::test_native_recurrent_kernels_equal_their_step_forms",
    "tests/models/test_hybrid_models.py::test_native_recurrent_kernels_give_a_request_the_same_bits_in_any_chunk_and_any_batch",
]
CAPS = {  # ZEROGAP_CPU_ISA -> the environment that makes torch and oneDNN see the same CPU
    "avx2": AVX2_ENV,  # a Zen 3 or an Intel client CPU: no AVX-512 of any kind
    "avx512": {
        "ZEROGAP_CPU_ISA": "avx512",
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
    },
}


# The caps at or below this CPU: an AVX2-only machine has no AVX-512 pass to make (its own run is the
# AVX-512-less one), so that pass is not collected there rather than skipped.
CAPS_HERE = sorted(cap for cap in CAPS if cap == "avx2" or cf.cpu_features().avx512)


@pytest.mark.parametrize("cap", CAPS_HERE)
def test_cpu_paths_pass_with_extensions_forced_off(cap):
    """The CPU-specific tests once more, as a CPU without AVX-512 (avx2) or without BF16/AMX (avx512)
    runs them: plain bf16 linears or oneDNN's emulated bf16, the kernels' other variants, auto -> fp32."""
    if os.environ.get("ZEROGAP_CPU_ISA"):
        pytest.skip("this is a capped pass itself")
    env = {**os.environ, **CAPS[cap]}  # the kernels' cache key holds their flags: a build of their own
    r = subprocess.run(
        # without the suite's --durations listing, so the tail kept below holds a failure's traceback
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-x",
            "-o",
            "addopts=",
            "-rfE",
            *CAPPED_PASS,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    tail = r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout.splitlines()[-1] and " failed" not in r.stdout.splitlines()[-1], tail


class FakeCpus:
    """Clocks a test advances: a forward of `tokens` takes what the team's size costs per token on
    quiet or contended CPUs, and the process gets that share of the team's threads meanwhile."""

    COST = {(False, 2): 1.0e-3, (False, 1): 1.8e-3, (True, 2): 6.0e-3, (True, 1): 2.2e-3}  # s per token
    SHARE = {(False, 2): 0.97, (False, 1): 0.99, (True, 2): 0.35, (True, 1): 0.5}

    def __init__(self):
        self.wall = self.cpu = 0.0
        self.contended = False
        self.sizes: list[int] = []
        self.steps: list[tuple[bool, int]] = []  # (decode, team size) per forward

    def forward(self, team, tokens: int, decode: bool) -> None:
        team.forward_started(decode)
        self.steps.append((decode, team.size))
        key = (self.contended, team.size)
        dt = self.COST[key] * tokens * (1 if decode else 0.2)  # a prefill token costs far less
        self.wall += dt
        self.cpu += dt * self.SHARE[key] * team.size
        team.forward_ended(tokens if decode else None)

    def run(self, team, seconds: float) -> None:
        """Decode steps at a few batch sizes, a prefill now and then (which a fair measure ignores)."""
        end, i = self.wall + seconds, 0
        while self.wall < end:
            i += 1
            self.forward(team, 200 if i % 7 == 0 else 8 + (i // 50) % 3, decode=i % 7 != 0)


def make_team(threads: int = 2):
    from service.engine.cpu_threads import AdaptiveTeam

    cpus = FakeCpus()
    team = AdaptiveTeam(
        threads, clock=lambda: cpus.wall, cpu_clock=lambda: cpus.cpu, set_threads=cpus.sizes.append
    )
    return team, cpus


def test_team_stays_full_on_quiet_cpus_without_probing():
    team, cpus = make_team()
    cpus.run(team, 300)
    assert team.size == 2 and team.last_share == pytest.approx(0.97) and cpus.sizes == []


def test_a_low_share_alone_does_not_shrink_the_team():
    """Small steps leave the workers asleep between regions (a low share, quiet CPUs): the probes find
    one thread no faster, stay full, and come ever more rarely."""
    team, cpus = make_team()
    cpus.SHARE = {**FakeCpus.SHARE, (False, 2): 0.5}
    cpus.run(team, 300)
    assert team.size == 2 and 4 <= cpus.sizes.count(1) <= 9, cpus.sizes  # after 5, 10, 20, 40, 60, 60... s


def test_team_shrinks_under_contention_and_grows_back():
    team, cpus = make_team()
    cpus.run(team, 20)
    cpus.contended = True  # a hog on each core
    cpus.run(team, 3)  # the low CPU share starts a probe at once: one thread is cheaper per token
    assert team.size == 1
    cpus.run(team, 120)
    assert team.size == 1  # the probes at the full size keep losing
    cpus.contended = False
    cpus.run(team, 70)  # the next probe (at most 60 s away) finds the full team cheaper again
    assert team.size == 2


def test_a_new_batch_size_class_on_one_thread_probes_the_full_team_at_once():
    team, cpus = make_team()
    cpus.contended = True
    cpus.run(team, 10)
    assert team.size == 1
    cpus.contended = False
    start = len(cpus.sizes)
    for _ in range(40):
        cpus.forward(team, 40, decode=True)  # a batch of 40: not measured at this size yet
    assert team.size == 2 and cpus.sizes[start:] == [2], cpus.sizes


def test_prefills_during_a_probe_run_on_the_team_it_returns_to():
    """A probe times decode steps on one thread; prefills that come meanwhile (a long prompt's
    chunks, prompts that finish at their first token) once ran on that one thread until a decode
    step came: on a quiet 2-core Xeon a 1,265-token prompt in 256-token chunks took 0.8 s, not 0.54."""
    team, cpus = make_team()
    cpus.SHARE = {**FakeCpus.SHARE, (False, 2): 0.5}  # a low share on quiet CPUs: a probe starts
    for _ in range(100_000):
        if cpus.sizes:
            break
        cpus.forward(team, 8, decode=True)
    assert cpus.sizes == [1] and cpus.steps[-1] == (True, 1)  # the probe's first decode step
    start = len(cpus.steps)
    for _ in range(20):
        cpus.forward(team, 256, decode=False)
    assert cpus.steps[start:] == [(False, 2)] * 20
    for _ in range(team.PROBE_STEPS):
        cpus.forward(team, 8, decode=True)  # the probe's other decode steps at one thread: it loses
    assert [size for _, size in cpus.steps[start + 20 :]] == [1] * (team.PROBE_STEPS - 1) + [2]


def test_a_single_thread_team_never_changes():
    team, cpus = make_team(1)
    cpus.contended = True
    cpus.run(team, 60)
    assert team.size == 1 and cpus.sizes == []


@pytest.mark.adaptive_team
def test_engine_results_do_not_change_when_the_team_changes_size(tiny_llama_dir, monkeypatch):
    """A team forced to change size at every probe gives the fp32 greedy tokens of a fixed team."""
    from service.engine.cpu_threads import AdaptiveTeam

    prompts = [[5 + i * 7 + j for j in range(2 + 9 * i)] for i in range(5)]
    greedy = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    fixed = SyncClient(
        ServerArgs(dtype="float32", kv_cache_tokens=1024, max_running_requests=8, adapt_cpu_team=False),
        tiny_llama_dir,
    )
    try:
        want = [collect(o)[0] for o in fixed.generate(prompts, greedy)]
    finally:
        fixed.close()
    for name, value in (
        ("SHARE_LOW", 2.0),
        ("MARGIN", 100.0),
        ("PROBE_FIRST_S", 0.0),
        ("PROBE_MAX_S", 0.0),
        ("SHARE_WINDOW_S", 0.0),
        ("PROBE_STEPS", 2),
    ):
        monkeypatch.setattr(AdaptiveTeam, name, value)  # every probe wins: the size flips every few steps
    flipping = SyncClient(
        ServerArgs(dtype="float32", kv_cache_tokens=1024, max_running_requests=8), tiny_llama_dir
    )
    try:
        got = [collect(o)[0] for o in flipping.generate(prompts, greedy)]
        team = flipping.engine.worker.cpu_team
    finally:
        flipping.close()
    assert got == want
    if torch.get_num_threads() > 1:
        assert team is not None and team.changes >= 4


@pytest.mark.adaptive_team
def test_engine_sizes_its_team_whatever_another_thread_left_torch_at(tiny_llama_dir):
    """torch's process-wide thread count is what a new thread (the engine's set-up and forward threads)
    starts with; another thread's torch.set_num_threads(1) (an earlier engine's adaptive team) once left
    a new engine with a team of one that never adapted. The engine sets the count it found."""
    want = cpu_grant().threads
    if want < 2:
        pytest.skip("needs two granted CPUs")
    seen: list[int] = []
    setter = threading.Thread(target=lambda: (torch.set_num_threads(1), seen.append(torch.get_num_threads())))
    setter.start()
    setter.join()
    assert seen == [1]
    client = SyncClient(
        ServerArgs(dtype="float32", kv_cache_tokens=256, max_running_requests=2), tiny_llama_dir
    )
    try:
        assert client.engine.cpu_threads == want
        assert client.engine.worker.cpu_team is not None and client.engine.worker.cpu_team.full == want
        fresh: list[int] = []
        probe = threading.Thread(
            target=lambda: (torch.zeros(2).add_(1), fresh.append(torch.get_num_threads()))
        )
        probe.start()
        probe.join()
        assert fresh == [want]
    finally:
        client.close()
