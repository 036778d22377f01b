"""What the engine is granted (CPUs: affinity mask, cgroup quota; memory: the machine's, or its
cgroup's limit) and the forward's adaptive OpenMP team on contended cores. Which threads may run
parallel CPU work at all: service/core/omp.py."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("zerogap.engine")


@dataclass(frozen=True)
class CpuGrant:
    """The CPUs this process may actually use: its affinity mask and its cgroup's CPU quota."""

    affinity: int  # CPUs in the affinity mask
    quota: (
        float | None
    )  # the cgroup's quota in CPUs (cpu.max / cfs_quota_us over the period); None: unlimited
    online: int  # CPUs the machine has

    @property
    def threads(self) -> int:
        """Worker threads for CPU ops: one per granted CPU, never more (a pod limited to 2 CPUs on a 64-core
        node gets 2: with more, OpenMP teams outnumber their time slices and each parallel region waits for
        a preempted member)."""
        n = self.affinity
        if self.quota is not None:
            n = min(n, max(1, math.ceil(self.quota - 0.05)))  # 1.5 CPUs: 2 threads; 2.02: 2
        return max(1, n)

    def describe(self) -> str:
        quota = "no cgroup CPU quota" if self.quota is None else f"cgroup quota {self.quota:g} CPUs"
        return f"{self.threads} threads ({self.affinity} of {self.online} CPUs in the affinity mask, {quota})"


def _read_quota(d: Path, v2: bool) -> float | None:
    """The quota set in cgroup folder d, in CPUs; None if none is set (or readable) there."""
    try:
        if v2:  # cpu.max: "<quota|max> <period>"
            quota, period = (d / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota_us = int((d / "cpu.cfs_quota_us").read_text())  # v1: -1 when unlimited
        return quota_us / int((d / "cpu.cfs_period_us").read_text()) if quota_us > 0 else None
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _read_memory_limit(d: Path, v2: bool) -> float | None:
    """The memory limit set in cgroup folder d, in bytes; None if none is set (or readable) there."""
    try:
        text = (d / ("memory.max" if v2 else "memory.limit_in_bytes")).read_text().strip()
        if text == "max":
            return None
        limit = int(text)  # v1 writes "no limit" as a page-rounded 2^63 - 1
        return None if limit <= 0 or limit >= 1 << 62 else float(limit)
    except (OSError, ValueError):
        return None


def _cgroup_limit(
    root: Path, proc_cgroup: str, controller: str, read: Callable[[Path, bool], float | None]
) -> float | None:
    """The tightest limit `read` finds on the path from this process's cgroup up to the root (v2 or
    v1, where `controller` names the v1 hierarchy)."""
    limits: list[float] = []
    for line in proc_cgroup.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        v2 = hier == "0" and not controllers
        if v2:
            base = root
        elif controller in controllers.split(","):
            names = (controllers, controller, ",".join(reversed(controllers.split(","))))
            base = next((root / d for d in names if (root / d).is_dir()), root / controller)
        else:
            continue
        parts = [p for p in path.strip("/").split("/") if p]
        # In a container the cgroup namespace's root is its own cgroup: its files lie at the base.
        for depth in range(len(parts), -1, -1):
            limit = read(base.joinpath(*parts[:depth]), v2)
            if limit is not None:
                limits.append(limit)
    return min(limits) if limits else None


def _cgroup_quota(root: Path, proc_cgroup: str) -> float | None:
    """The tightest CPU quota on the path from this process's cgroup up to the root (v2 or v1)."""
    return _cgroup_limit(root, proc_cgroup, "cpu", _read_quota)


def _proc_cgroup(proc_cgroup: Path) -> str:
    try:
        return proc_cgroup.read_text()
    except OSError:
        return ""


def granted_memory_bytes(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> int:
    """The memory this process may use: the machine's, or its cgroup's limit where that is less (a pod
    limited to 4 GiB on a 128 GiB node has 4 GiB: shares of it are what fit)."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        physical = 8 << 30
    limit = _cgroup_limit(root, _proc_cgroup(proc_cgroup), "memory", _read_memory_limit)
    return physical if limit is None else min(physical, int(limit))


def cpu_grant(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> CpuGrant:
    """What this process is granted (read now: a container's limits are fixed while it runs)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 1
    quota = _cgroup_quota(root, _proc_cgroup(proc_cgroup))
    return CpuGrant(affinity=affinity, quota=quota, online=os.cpu_count() or affinity)


class AdaptiveTeam:
    """The forward's OpenMP team size: the full team, or one thread while the granted CPUs are so
    contended that one thread does the work faster, as measured.

    A parallel region ends when its slowest member does. With a CPU hog on a core (a noisy neighbour,
    another container, a throttled quota) the member there waits for its next time slice and the
    forward waits with it, in every one of its hundreds of regions; a team of one waits for nothing
    but its own slice. The signal is the team's CPU share: the process's CPU time over the forwards'
    wall time per team thread (~1 quiet with busy steps, as workers spin between regions). When it
    falls below `SHARE_LOW`, a probe runs `PROBE_STEPS` decode steps on one thread and keeps one
    thread if they took at most `MARGIN` of the full team's recent steps at the same batch size
    (by powers of two). On one thread, probes at the full size run every `probe_s` (doubling while
    they lose, up to `PROBE_MAX_S`) and soon when the decode batch grows into a size class not
    yet measured, so the full team comes back when the cores are free again. Prefill and mixed
    steps are not compared (their time says nothing about a decode step's), and while a probe
    runs they run on the team it would return to. Called on the thread that runs the forwards
    (omp_set_num_threads is per thread).
    """

    PROBE_STEPS = 6
    PROBE_FIRST_S, PROBE_MAX_S = 5.0, 60.0
    MARGIN = 0.85
    SHARE_LOW, SHARE_WINDOW_S = 0.6, 0.5
    EMA = 0.3  # weight of a new step in a size class's recent step time
    NEW_CLASS_SPACING_S = 1.0

    def __init__(
        self,
        threads: int,
        clock: Callable[[], float] = time.perf_counter,
        cpu_clock: Callable[[], float] = time.process_time,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ):
        self.full = self.size = max(1, threads)
        self._clock, self._cpu_clock, self._set_threads = clock, cpu_clock, set_threads
        self._t0 = self._c0 = 0.0
        self._wall = self._cpu = 0.0  # forward wall and process CPU time since the last share reading
        self._recent: dict[int, float] = {}  # batch size class -> recent decode step time at this size
        self._probe: list[tuple[int, float]] = []  # (size class, step time) of the probe's decode steps
        self._probing_from: int | None = None  # the size a probe returns to if it loses
        self._probe_size = self.full  # the size a probe's decode steps run at
        self._want_probe = False  # the share fell: probe one thread when next_probe comes
        self._new_class = False  # on one thread, a decode batch of a size class not measured: probe soon
        self._probe_s = self.PROBE_FIRST_S
        self._next_probe = self._last_probe = clock()  # no periodic / share probe before next_probe
        self.last_share: float | None = None
        self.changes = 0  # team size changes, probes included

    def forward_started(self, decode: bool) -> None:
        """decode: this forward is a decode step (a probe starts at one, and times only them)."""
        now = self._clock()
        if self._probing_from is not None:
            # Other forwards run on the team the probe returns to: a long prompt's chunks, or prompts
            # that finish at their first token, once ran on the probe's one thread until a decode came.
            want = self._probe_size if decode else self._probing_from
            if self.size != want:
                self._resize(want)
        elif self.full > 1 and decode:
            due = now >= self._next_probe and (self._want_probe or (self.size == 1 and bool(self._recent)))
            if due or (self._new_class and now >= self._last_probe + self.NEW_CLASS_SPACING_S):
                log.debug(
                    "forward team probe: %d -> %d threads (CPU share %.0f%%, new size class: %s)",
                    self.size,
                    self.full if self.size == 1 else 1,
                    100 * (self.last_share or 0),
                    self._new_class,
                )
                self._want_probe = self._new_class = False
                self._probing_from = self.size
                self._probe_size = self.full if self.size == 1 else 1
                self._resize(self._probe_size)
        self._t0, self._c0 = now, self._cpu_clock()

    def forward_ended(self, decode_batch: int | None) -> None:
        """decode_batch: the batch size of a decode step; None for other forwards."""
        dt = self._clock() - self._t0
        self._wall += dt
        self._cpu += self._cpu_clock() - self._c0
        if self._wall >= self.SHARE_WINDOW_S:
            self.last_share = self._cpu / (self._wall * self.size)
            self._wall = self._cpu = 0.0
            if self.size == self.full > 1 and self.last_share < self.SHARE_LOW:
                self._want_probe = True  # contended, perhaps: is one thread faster?
        if decode_batch is None:
            return
        key = decode_batch.bit_length()
        if self._probing_from is not None:
            self._probe.append((key, dt))
            if len(self._probe) >= self.PROBE_STEPS:
                self._end_probe()
            return
        if self.size == 1 and key not in self._recent:
            self._new_class = True  # a batch size not measured yet: the full team may be faster there
        old = self._recent.get(key)
        self._recent[key] = dt if old is None else (1 - self.EMA) * old + self.EMA * dt

    def _end_probe(self) -> None:
        probe, before = self._probe, self._probing_from
        self._probe, self._probing_from = [], None
        pairs = [(t, self._recent[k]) for k, t in probe if k in self._recent]
        ratio = sum(t for t, _ in pairs) / sum(r for _, r in pairs) if pairs else 1.0
        now = self._clock()
        if ratio < self.MARGIN:  # the probe's size wins
            log.info(
                "forward team %d -> %d threads: its decode steps took %.0f%% of the time (CPU share %.0f%%)",
                before,
                self.size,
                100 * ratio,
                100 * (self.last_share or 0),
            )
            self._recent = {}
            for k, t in probe:
                self._recent.setdefault(k, t)
            self._probe_s = self.PROBE_FIRST_S
        else:
            log.debug(
                "forward team stays at %d threads: %d threads' decode steps took %.0f%% of the time",
                before,
                self.size,
                100 * ratio,
            )
            self._resize(before)
            self._probe_s = min(2 * self._probe_s, self.PROBE_MAX_S)
        self._want_probe = self._new_class = False
        self._last_probe, self._next_probe = now, now + self._probe_s

    def _resize(self, n: int) -> None:
        self._set_threads(n)
        self.size = n
        self._wall = self._cpu = 0.0
        self.changes += 1
