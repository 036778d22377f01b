"""The GPU check's feature part: every feature alone and all together, in both loops, measured.

For each workload (one per matrix row, and "all"), on random-init models, the normal and then the
overlap loop run the same requests; each run is timed with the engine's device-timing events on the
forward stream (CUDA events; on CPU the same fields from the host clock, so the code path is
exercised), and on CUDA the overlap run is under `torch.cuda.set_sync_debug_mode("warn")`. From the
matrix counters (the run's share: after minus before), each feature is then *measured*:

    full         its overlap-loop batches launched without a fallback and none waited anyway
    sync point   some waited anyway (`batches_synced`: a mask late at sampling), went through a
                 sync-point fallback, or the run made host syncs; sync points at an event the feature
                 declares (`Feature.sync_event`: retraction's drain at a KV shortage) are counted
                 apart (`event_syncs`) and shown with "full"
    none         its batches ran the normal way (per-batch fallback of a "none" feature)
    unused       no batch carried it (the workload failed to exercise it)

and compared with its declaration: a measurement worse than the declaration, or tokens that differ
between the loops, contradicts it. `service/matrix.py --measured` renders the verdicts.

Workloads (sizes: SCALES; `quick` is what the CPU test runs):
  logprobs         top-5 on every row, input logprobs on half of them
  constrained      JSON-schema, regex and EBNF constraints on half the rows
  chunked_prefill  chunked prefill + mixed batches: long prompts arrive while the streams decode
  prefix_cache     two turns: a shared system prefix, then each conversation continued
  retraction       a KV pool that forces several retractions (optimistic admission, low ratio)
  multimodal       LLaVA images on a quarter of the rows
  all              everything at once (on the LLaVA model)
Each feature runs alone: the prefix cache and chunked prefill are off except where they are measured.
"""

from __future__ import annotations

import random
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

IMAGE_TOKEN_NAME = "<image>"
WORKLOAD_NAMES = (
    "logprobs",
    "constrained",
    "chunked_prefill",
    "prefix_cache",
    "retraction",
    "multimodal",
    "all",
)
RANK = {"full": 0, "sync point": 1, "none": 2}
SCHEMA = (
    '{"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, '
    '"age": {"type": "integer"}}, "required": ["name", "age"]}'
)
CONSTRAINTS = (
    dict(kind="json_schema", text=SCHEMA),
    dict(kind="regex", text=r"[a-z]{2,8}( [0-9]{1,3})?"),
    dict(kind="ebnf", text='root ::= "yes" | "no" | "maybe " [0-9]+'),
)


@dataclass(frozen=True)
class Scale:
    """Workload sizes: `streams` concurrent requests of `prompt_len` + `tokens` new tokens."""

    streams: int
    tokens: int
    prompt_len: int
    long_prompts: int  # chunked prefill: prompts arriving while the streams decode
    long_len: int
    chunk: int  # --chunked-prefill-size
    system_len: int  # prefix cache: the shared system prompt
    turn_len: int  # prefix cache: each conversation's next user turn
    warmup: bool  # run the workload once before the measured run (compiles, graphs, grammars)


SCALES = {
    # the GPU run: 64 streams decode on the 135M shape
    "full": Scale(64, 64, 32, 8, 1024, 256, 256, 24, True),
    # --quick (the CPU test): tiny everything; the warm-up too (its path runs, cold starts stay out)
    "quick": Scale(4, 4, 8, 2, 40, 16, 24, 6, True),
}


@dataclass
class Item:
    """One request: its prompt (a `continues` wave: appended to the previous turn), sampling, payloads."""

    prompt: list[int]
    max_new_tokens: int
    features: dict[str, Any] = field(default_factory=dict)


@dataclass
class Wave:
    """Requests submitted together. `when`: "start" (with the previous wave), "decoding" (once every
    request of the previous wave streamed a token), "finished" (once every earlier wave finished).
    `continues`: each prompt follows that earlier wave's prompt + output (multi-turn)."""

    items: list[Item]
    when: str = "start"
    continues: int | None = None


@dataclass
class Workload:
    name: str
    features: tuple[str, ...]  # the matrix rows it measures
    model: str  # "text" or "llava"
    args: dict[str, Any]  # ServerArgs overrides
    waves: list[Wave]


# ---- workloads ---------------------------------------------------------------------------------
def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 49000) for _ in range(n)]


def _picture(i: int) -> bytes:
    import io

    from PIL import Image, ImageDraw

    img = Image.new("RGB", (48 + 8 * (i % 4), 40 + 4 * (i % 3)), (i * 37 % 256, 90, 180))
    ImageDraw.Draw(img).ellipse((5, 5, 30, 25), fill=(250, i * 53 % 256, 10))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _logprobs(i: int) -> dict[str, Any]:
    return dict(return_logprob=True, top_logprobs_num=5, logprob_start_len=0 if i % 2 == 0 else -1)


def _images(i: int) -> Any:
    from features.multimodal import ImageInputs

    return ImageInputs((_picture(i),))


def streams(s: Scale, rng: random.Random, payload: Callable[[int], dict[str, Any]]) -> list[Item]:
    return [Item(_prompt(rng, s.prompt_len), s.tokens, payload(i)) for i in range(s.streams)]


def kv_for_retraction(s: Scale) -> int:
    """A pool about half the streams' whole demand: several retractions, every request still fits."""
    return max(s.streams * (s.prompt_len + s.tokens) // 2, 2 * (s.prompt_len + s.tokens) + 8)


def workloads(s: Scale) -> list[Workload]:
    rng = random.Random(7)
    plain = dict(disable_prefix_cache=True, chunked_prefill_size=0)
    chunked = dict(chunked_prefill_size=s.chunk, enable_mixed_chunk=True)
    retract = dict(
        kv_cache_tokens=kv_for_retraction(s),
        admission_policy="optimistic",
        init_new_token_ratio=0.1,
        min_new_token_ratio=0.05,
    )

    def long_wave() -> Wave:
        items = [Item(_prompt(rng, s.long_len), max(2, s.tokens // 4)) for _ in range(s.long_prompts)]
        return Wave(items, when="decoding")

    def two_turns(payload: Callable[[int], dict[str, Any]]) -> list[Wave]:
        system = _prompt(rng, s.system_len)
        first = [Item(system + _prompt(rng, s.prompt_len), s.tokens, payload(i)) for i in range(s.streams)]
        second = [Item(_prompt(rng, s.turn_len), s.tokens, payload(i)) for i in range(s.streams)]
        return [Wave(first), Wave(second, when="finished", continues=0)]

    def everything(i: int) -> dict[str, Any]:
        f: dict[str, Any] = {}
        if i % 4 == 0:
            f["logprobs"] = _logprobs(i // 4)
        if i % 2 == 1:
            f["constrained"] = CONSTRAINTS[i // 2 % 3]
        if i % 4 == 2:
            f["multimodal"] = _images(i)
        return f

    all_waves = two_turns(everything)
    all_waves.insert(1, long_wave())  # long prompts arrive while the first turn decodes
    return [
        Workload(
            "logprobs",
            ("logprobs",),
            "text",
            plain,
            [Wave(streams(s, rng, lambda i: {"logprobs": _logprobs(i)}))],
        ),
        Workload(
            "constrained",
            ("constrained",),
            "text",
            plain,
            [Wave(streams(s, rng, lambda i: {"constrained": CONSTRAINTS[i // 2 % 3]} if i % 2 else {}))],
        ),
        Workload(
            "chunked_prefill",
            ("chunked_prefill",),
            "text",
            dict(disable_prefix_cache=True, **chunked),
            [Wave(streams(s, rng, lambda i: {})), long_wave()],
        ),
        Workload(
            "prefix_cache", ("prefix_cache",), "text", dict(chunked_prefill_size=0), two_turns(lambda i: {})
        ),
        Workload(
            "retraction",
            ("retraction",),
            "text",
            dict(plain, **retract),
            [Wave(streams(s, rng, lambda i: {}))],
        ),
        Workload(
            "multimodal",
            ("multimodal",),
            "llava",
            plain,
            [Wave(streams(s, rng, lambda i: {"multimodal": _images(i)} if i % 4 == 0 else {}))],
        ),
        Workload(
            "all",
            ("logprobs", "constrained", "chunked_prefill", "prefix_cache", "retraction", "multimodal"),
            "llava",
            dict(chunked, **retract, kv_cache_tokens_scale=2),
            all_waves,
        ),
    ]


# ---- models --------------------------------------------------------------------------------------
def make_llava_dir(text_shape: dict[str, Any], tokenizer_dir: Path, out: Path, dtype: str) -> Path:
    """A random-init LLaVA (a small CLIP tower, 16 image tokens per 32x32 image) over a Llama of
    `text_shape`, SmolLM2's tokenizer plus "<image>", saved with its image processor."""
    import torch
    import transformers
    from transformers import (
        AutoTokenizer,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    # the PIL-only processor where this transformers has it (no torchvision needed), else the classic one
    processor = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor

    out.mkdir(parents=True, exist_ok=True)
    image_token = 49152
    torch.manual_seed(0)
    vision = CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        projection_dim=64,
    )
    text = LlamaConfig(
        vocab_size=image_token + 1,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        eos_token_id=2,
        bos_token_id=1,
        tie_word_embeddings=True,
        **text_shape,
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=True,
        image_seq_length=16,
    )
    model = LlavaForConditionalGeneration(cfg).to(getattr(torch, dtype))
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, out / f)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN_NAME]})
    assert tok.convert_tokens_to_ids(IMAGE_TOKEN_NAME) == image_token
    tok.save_pretrained(out)
    processor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(out)
    return out


# ---- one run ------------------------------------------------------------------------------------
def run_waves(client: Any, waves: list[Wave], tag: str, image_token: int) -> list[dict]:
    """Submit the waves as they say; every request's tokens, finish and error, in submission order."""
    from service.core.request import SamplingParams

    engine = client.engine
    submitted: list[list[tuple[str, list[int]]]] = []  # (rid, prompt) of each wave's requests
    outputs: dict[str, list[Any]] = {}  # finished requests' deltas

    def finish(rids: list[str]) -> None:
        for r in rids:
            if r not in outputs:
                outputs[r] = client.wait(r, timeout=600)

    for w, wave in enumerate(waves):
        if wave.when == "finished":
            finish([r for sub in submitted for r, _ in sub])
        elif wave.when == "decoding" and submitted:
            client.wait_streaming([r for r, _ in submitted[-1]], timeout=600)
        reqs, these = [], []
        for i, item in enumerate(wave.items):
            prompt = list(item.prompt)
            if wave.continues is not None:
                rid, before = submitted[wave.continues][i]
                prompt = before + [t for o in outputs[rid] for t in o.token_ids] + prompt
            elif "multimodal" in item.features:  # a continued turn has its images' placeholders already
                prompt = [image_token] * len(item.features["multimodal"].images) + prompt
            params = SamplingParams(temperature=0, max_new_tokens=item.max_new_tokens, ignore_eos=True)
            rid = f"{tag}-{w}-{i}"
            payloads = {k: v for k, v in item.features.items() if k in engine.features.features}
            reqs.append(engine.build_request(rid, prompt, params, payloads))
            these.append((rid, prompt))
        engine.submit_all(reqs)
        submitted.append(these)
    done = [r for sub in submitted for r, _ in sub]
    finish(done)
    rows = []
    for rid in done:
        outs = outputs[rid]
        rows.append(
            dict(
                tokens=[t for o in outs for t in o.token_ids],
                finish=outs[-1].finish_reason.value if outs[-1].finish_reason is not None else None,
                error=outs[-1].error,
                cached_tokens=max(o.cached_tokens for o in outs),
            )
        )
    return rows


def _counters(engine: Any) -> dict[str, dict[str, int]]:
    return {
        r.feature: dict(
            overlapped=r.batches_overlapped,
            fallback=r.batches_fallback,
            normal_loop=r.batches_normal_loop,
            synced=r.batches_synced,
            event_syncs=r.counters.get("event_syncs", 0),
        )
        for r in engine.features.matrix()
    }


def _minus(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {f: {k: v - before.get(f, {}).get(k, 0) for k, v in c.items()} for f, c in after.items()}


def run_workload(
    w: Workload,
    model_dir: Path,
    overlap: bool,
    device_name: str,
    dtype: str,
    s: Scale,
    cuda_graph: bool,
    sync_debug: Callable[[list], Any] | None,
) -> dict:
    """Build an engine for the workload, warm it up (GPU), then one measured run."""
    from service.config import ServerArgs
    from service.engine.engine import SyncClient
    from service.engine.modules import builtin_features

    args = dict(w.args)
    kv_scale = args.pop("kv_cache_tokens_scale", 1)
    longest = max(s.long_len, s.system_len + 2 * (s.prompt_len + s.tokens) + s.turn_len) + 32  # + images
    n_req = sum(len(wave.items) for wave in w.waves)
    ample = n_req * (longest + s.tokens) + 64
    kv = args.pop("kv_cache_tokens", ample) * kv_scale
    sa = ServerArgs(
        model=str(model_dir),
        device=device_name,
        dtype=dtype,
        load_format="dummy" if w.model == "text" else "auto",
        loop="overlap" if overlap else "normal",
        max_running_requests=s.streams + s.long_prompts,
        max_queued_requests=4 * n_req,
        kv_cache_tokens=kv,
        context_length=longest + s.tokens + 8,
        max_prefill_tokens=max(4096, s.streams * (s.prompt_len + s.system_len)),
        disable_cuda_graph=not cuda_graph,
        adapt_cpu_team=False,  # a fixed team: both loops see the same CPU
        disabled_features=[f.name for f in builtin_features() if f.name not in w.features],  # alone
        **args,
    )
    client = SyncClient(sa, model_dir)
    engine = client.engine
    image_token = int(getattr(engine.hf_config, "image_token_id", -1) or -1)
    try:
        if s.warmup:
            run_waves(client, w.waves, "warmup", image_token)
            engine.flush_prefix_cache()  # the measured run's hits come from its own turns
            admission = engine.scheduler.admission  # and it starts from the configured admission ratio
            admission.ratio = admission.config.init_ratio  # (the warm-up's retractions backed it off)
        before = _counters(engine)
        stats0 = engine.stats()
        graphs = engine.worker.graphs
        replays0 = graphs.replays if graphs is not None else 0
        engine.timeline.device_timing = True
        engine.timeline.clear_device_spans()
        log: list = []
        t0 = time.perf_counter()
        if sync_debug is not None and overlap:
            with sync_debug(log):
                rows = run_waves(client, w.waves, "run", image_token)
        else:
            rows = run_waves(client, w.waves, "run", image_token)
        wall = time.perf_counter() - t0
        engine.timeline.device_timing = False
        every = engine.timeline.device_forward_stats()
        decode = engine.timeline.device_forward_stats("decode")
        busy, host_gap = engine.timeline.forward_stats()
        stats = engine.stats()
        counters = _minus(_counters(engine), before)
        replays = graphs.replays - replays0 if graphs is not None else None
        kv_free = engine.kv_all_free()
    finally:
        client.close()
    generated = sum(len(r["tokens"]) for r in rows)
    return dict(
        loop="overlap" if overlap else "normal",
        wall_s=wall,
        tokens_per_s=generated / wall if wall else 0.0,
        generated_tokens=generated,
        forward_pairs=every.pairs,
        median_gap_ms=every.median_gap_ms,
        median_forward_ms=every.median_forward_ms,
        device_busy_fraction=every.busy_fraction,
        decode_pairs=decode.pairs,
        median_decode_gap_ms=decode.median_gap_ms,
        host_busy_fraction=busy,
        host_median_gap_ms=host_gap * 1e3,
        decode_graph_replays=replays,  # None: no CUDA graphs (CPU, --no-cuda-graph); vs decode steps
        decode_steps=sum(1 for m, *_ in engine.timeline.device_spans if m == "decode"),
        host_syncs=len(log) if sync_debug is not None and overlap else None,
        first_syncs=log[:3],
        counters={f: counters[f] for f in counters if any(counters[f].values())},
        retractions=stats.retractions - stats0.retractions,
        retraction_sync_points=stats.retraction_sync_points - stats0.retraction_sync_points,
        prefix_cache_hit_tokens=stats.prefix_cache.hit_tokens - stats0.prefix_cache.hit_tokens,
        errors=[r["error"] for r in rows if r["error"]][:3],
        kv_all_free=kv_free,
        outputs=[r["tokens"] for r in rows],
    )


def first_difference(pairs: list[tuple[list[int], list[int]]]) -> dict | None:
    """The first request whose tokens differ between the loops, and where they part."""
    for i, (a, b) in enumerate(pairs):
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return dict(request=i, at=at, normal=a[at : at + 4], overlap=b[at : at + 4])
    return None


def measure(
    declared: str,
    c: dict[str, int],
    host_syncs: int | None,
    identical: bool,
    identical_requests: str = "",
    sync_event: str = "",
) -> dict[str, Any]:
    """One feature's verdict from its overlap run's counters (see the module's docstring);
    `identical_requests`: "n/m" requests whose tokens are the same in both loops; `sync_event`: the
    event the feature declares a sync point at (its drains there are counted apart, `event_syncs`)."""
    events = c.get("event_syncs", 0)
    if c.get("fallback", 0) and declared == "none":
        got = "none"
    elif c.get("fallback", 0) or c.get("synced", 0) or host_syncs or (events and not sync_event):
        got = "sync point"
    elif c.get("overlapped", 0):
        got = "full"
    else:
        got = "unused"
    launched = c.get("overlapped", 0) + c.get("fallback", 0)
    contradicts = not identical or got == "unused" or RANK.get(got, 0) > RANK.get(declared, 0)
    return dict(
        declared=declared,
        measured=got,
        batches=launched,
        synced=c.get("synced", 0) + (c.get("fallback", 0) if got == "sync point" else 0),
        event_syncs=events,
        sync_event=sync_event,
        host_syncs=host_syncs,
        identical_tokens=identical,
        identical_requests=identical_requests,
        contradicts=contradicts,
    )


def check_features(
    text_dir: Path,
    llava_dir: Path | None,
    device_name: str,
    dtype: str,
    quick: bool,
    cuda_graph: bool,
    sync_debug: Callable[[list], Any] | None,
    only: list[str] | None = None,
) -> dict:
    """Every workload in both loops; per-feature verdicts for the matrix."""
    from service.engine.modules import builtin_features

    declared = {f.name: f.support.value for f in builtin_features()}
    sync_events = {f.name: f.sync_event for f in builtin_features()}
    s = SCALES["quick" if quick else "full"]
    rows: list[dict] = []
    verdicts: dict[str, dict] = {}
    for w in workloads(s):
        if only and w.name not in only:
            continue
        missing = [f for f in w.features if f not in declared]  # e.g. no xgrammar on this machine
        if missing and w.name in missing:
            verdicts[w.name] = dict(declared="?", measured="unavailable", contradicts=False)
            rows.append(dict(workload=w.name, ok=True, skipped=f"{w.name} is not installed here"))
            print(f"  {w.name:<16} skipped: not installed here", flush=True)
            continue
        w = Workload(w.name, tuple(f for f in w.features if f in declared), w.model, w.args, w.waves)
        model_dir = llava_dir if w.model == "llava" else text_dir
        t0 = time.perf_counter()
        try:
            if model_dir is None:
                raise RuntimeError("no LLaVA model was built")
            res = {
                o: run_workload(w, model_dir, o, device_name, dtype, s, cuda_graph, sync_debug)
                for o in (False, True)
            }
        except Exception:
            rows.append(dict(workload=w.name, identical_tokens=False, error=traceback.format_exc()))
            print(f"  {w.name} FAILED:\n{rows[-1]['error']}", flush=True)
            continue
        normal, overlap = res[False], res[True]
        pairs = list(zip(normal.pop("outputs"), overlap.pop("outputs")))
        same = [a == b for a, b in pairs]
        identical = all(same)
        gap_ratio = overlap["median_gap_ms"] / normal["median_gap_ms"] if normal["median_gap_ms"] else None
        speedup = overlap["tokens_per_s"] / normal["tokens_per_s"] if normal["tokens_per_s"] else None
        ok = identical and not normal["errors"] and not overlap["errors"]
        ok = ok and normal["kv_all_free"] and overlap["kv_all_free"]
        row = dict(
            workload=w.name,
            features=list(w.features),
            model=w.model,
            requests=sum(len(wave.items) for wave in w.waves),
            identical_tokens=identical,
            identical_requests=f"{sum(same)}/{len(same)}",
            first_difference=first_difference(pairs),
            ok=ok,
            gap_ratio=gap_ratio,
            speedup=speedup,
            normal=normal,
            overlap=overlap,
            elapsed_s=time.perf_counter() - t0,
        )
        row["verdicts"] = {
            f: measure(
                declared.get(f, "full"),
                overlap["counters"].get(f, {}),
                overlap["host_syncs"],
                identical,
                row["identical_requests"],
                sync_events.get(f, ""),
            )
            for f in w.features
        }
        rows.append(row)
        if w.name in w.features:
            verdicts[w.name] = dict(
                row["verdicts"][w.name],
                gap_normal_ms=normal["median_gap_ms"],
                gap_overlap_ms=overlap["median_gap_ms"],
                gap_ratio=gap_ratio,
                speedup=speedup,
            )
        print(
            f"  {w.name:<16} normal {normal['tokens_per_s']:8.0f} tok/s gap {normal['median_gap_ms']:.3f} ms | "
            f"overlap {overlap['tokens_per_s']:8.0f} tok/s gap {overlap['median_gap_ms']:.3f} ms "
            f"busy {overlap['device_busy_fraction']:.0%} | x{speedup or 0:.2f}  identical: {identical}  "
            + ", ".join(
                f"{f}: {v['measured']}{' (CONTRADICTS)' if v['contradicts'] else ''}"
                for f, v in row["verdicts"].items()
            )
            + f"  [{row['elapsed_s']:.0f}s]",
            flush=True,
        )
    return dict(workloads=rows, verdicts=verdicts, scale=vars(s))
