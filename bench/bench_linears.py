"""The linears of a decoder step, by row count: oneDNN's packed weights vs the native panels.

A SmolLM2-135M-shaped stack of weights (30 layers x qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536: 120 distinct weights, 107 M parameters, none of them in cache when its turn comes,
as in a forward) run at each row count through `linear.PackedLinear` (oneDNN) and, where this CPU
builds it for the dtype, `linear.PanelLinear` (`csrc/panel_linear.c`). The two are timed in
alternation (A B A B), best median of each. Prints ms per pass, the ratio, and the panels' weight
stream (GB/s) and arithmetic (GFLOP/s). Nothing here asserts a duration.

Usage:
    .venv/bin/python bench/bench_linears.py [--dtype bfloat16] [--threads 1]
        [--rows 1,3,8,16,24,32,64,256] [--repeats 5]
(pin it to cores with `taskset -c 0` for a one-core figure).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.models import cpu_kernels  # noqa: E402
from service.models.cpu_features import cpu_features  # noqa: E402
from service.models.linear import PackedLinear, PanelLinear  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one layer's linears
LAYERS = 30


def best_median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rows", default="1,3,8,16,24,32,64,256")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=g).to(dtype) for _ in range(LAYERS) for o, i in SHAPES]
    onednn = [PackedLinear(w) for w in weights]
    panels = [cpu_kernels.pack_panels(w) for w in weights]
    panel = None if panels[0] is None else [PanelLinear(p, w, None) for p, w in zip(panels, weights)]
    params = sum(w.numel() for w in weights)
    print(f"{cpu_features().describe()}; {args.dtype}, {args.threads} thread(s), {len(weights)} weights, "
          f"{params / 1e6:.0f} M parameters ({params * weights[0].element_size() / 1e6:.0f} MB)")  # fmt: skip
    if panel is None:
        print("no panel kernel for this dtype on this CPU (or no C compiler): oneDNN only")
    print(f"{'rows':>5} {'oneDNN ms':>10} {'panels ms':>10} {'ratio':>6} {'panels GB/s':>12} {'GFLOP/s':>8}")
    with torch.no_grad():
        for m in [int(r) for r in args.rows.split(",")]:
            xs = {i: torch.randn(m, i, generator=g).to(dtype) for _, i in SHAPES}

            def run(layers):
                return lambda: [lin(xs[w.shape[1]]) for lin, w in zip(layers, weights)]

            a = [best_median(run(onednn), args.repeats)]
            b = []
            if panel is not None:
                for _ in range(2):
                    b.append(best_median(run(panel), args.repeats))
                    a.append(best_median(run(onednn), args.repeats))
            ta = min(a)
            if not b:
                print(f"{m:5d} {ta * 1e3:10.1f}")
                continue
            tb = min(b)
            gbs = params * weights[0].element_size() / tb / 1e9
            print(
                f"{m:5d} {ta * 1e3:10.1f} {tb * 1e3:10.1f} {ta / tb:5.2f}x {gbs:12.1f} {2 * m * params / tb / 1e9:8.0f}"
            )


if __name__ == "__main__":
    main()
