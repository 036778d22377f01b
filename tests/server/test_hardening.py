"""What a hostile or careless client found (issue 17), each case through gRPC on a real server.

Every case asserts the status the client gets, that other requests are unaffected (their tokens, and
the order in which things complete), and that the KV pool is back to its initial state. No case
asserts a duration: a loaded machine stretches every one of them (durations are the benchmarks').
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from service.config import ServerArgs
from service.server import AddressInUse, BackgroundServer, bind_port, check_address_free
from tests.helpers import free_port, on_each_result, serve_process, wait_until
from zerogap.v1 import generation_pb2 as pb2
from zerogap.v1 import generation_pb2_grpc as pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


def greedy(n: int = 8, **kw) -> pb2.SamplingParams:
    return pb2.SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def kv_idle(srv: BackgroundServer) -> bool:
    e = srv.engine
    return e.num_live() == 0 and e.kv_all_free()  # all free once the prefix cache is flushed


# ---- 1. a taken port -----------------------------------------------------------------------------


def test_second_server_on_a_taken_port_refuses_to_start(tiny_llama_dir):
    first = BackgroundServer(
        ServerArgs(
            dtype="float32", model=str(tiny_llama_dir), port=0, kv_cache_tokens=400, max_running_requests=2
        )
    )
    try:
        port = first.port
        with pytest.raises(AddressInUse, match=f"127.0.0.1:{port}.*in use"):
            BackgroundServer(
                ServerArgs(dtype="float32", model=str(tiny_llama_dir), port=port, kv_cache_tokens=400)
            )
        # The CLI says so and exits non-zero, before loading the model.
        out = subprocess.run(
            [sys.executable, "-m", "service", "serve", "--model", str(tiny_llama_dir), "--port", str(port)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr[-2000:]
        # Every new connection still reaches the first server.
        for _ in range(4):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                r = pb2_grpc.GenerationStub(ch).Generate(
                    pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=[5, 6]), sampling=greedy(2))
                )
                assert len(r.token_ids) == 2
        assert wait_until(lambda: kv_idle(first), 20)
    finally:
        first.stop()


def test_exclusive_bind_refuses_a_port_held_with_so_reuseport():
    """A foreign gRPC server holding the port with gRPC's default SO_REUSEPORT: both our checks refuse."""
    import asyncio

    async def scenario() -> None:
        other = grpc.aio.server()  # default options: SO_REUSEPORT on
        port = other.add_insecure_port("127.0.0.1:0")
        await other.start()
        try:
            with pytest.raises(AddressInUse):
                check_address_free("127.0.0.1", port)
            with pytest.raises(AddressInUse):
                bind_port(grpc.aio.server(options=[("grpc.so_reuseport", 0)]), "127.0.0.1", port)
        finally:
            await other.stop(0)

    asyncio.run(scenario())


# ---- 2. grammar compiles are bounded -------------------------------------------------------------


def slow_schema(tag: str, n: int = 2000) -> str:
    """Compiles for ~20 s in xgrammar (1,000 properties: ~1 s; the cost grows faster than linearly)."""
    return json.dumps(
        {"type": "object", "title": tag, "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}
    )


def constrained(constraint: pb2.Constraint, n: int = 8) -> pb2.GenerateRequest:
    return pb2.GenerateRequest(
        token_ids=pb2.TokenIds(ids=[5, 6, 7]), sampling=greedy(n), constraint=constraint
    )


PLAIN = pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=[5, 6, 7, 8]), sampling=greedy(12, ignore_eos=True))
STOPPED = {
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}  # time or memory bound, whichever first


@pytest.fixture(scope="module")
def grammar_server(tiny_llama_dir):
    # Limits relaxed so that a slow schema reaches the compiler: what is tested here is the stop.
    srv = BackgroundServer(
        ServerArgs(
            dtype="float32",
            model=str(tiny_llama_dir),
            port=0,
            kv_cache_tokens=2000,
            max_running_requests=8,
            grammar_compile_timeout_s=6,
            max_constraint_bytes=1 << 20,
            max_constraint_properties=10_000,
        )
    )
    assert srv.engine.features.features["constrained"].backend.wait_ready(120)
    yield srv
    srv.stop()


def backend_of(srv: BackgroundServer):
    return srv.engine.features.features["constrained"].backend


def compiles_idle(srv: BackgroundServer) -> bool:
    b = backend_of(srv)
    return all(s.job is None for s in b._slots) and not b._queue


def test_slow_compile_is_stopped_and_small_grammars_are_not_starved(grammar_server):
    srv = grammar_server
    with grpc.insecure_channel(srv.address) as ch:
        stub = pb2_grpc.GenerationStub(ch)
        plain_before = stub.Generate(PLAIN).token_ids
        stopped_before = sum(backend_of(srv).stats.stopped.values())
        bigs = [
            stub.Generate.future(constrained(pb2.Constraint(json_schema=slow_schema(t))))
            for t in ("a", "b", "c")
        ]
        assert wait_until(lambda: any(s.job is not None for s in backend_of(srv)._slots), 30)
        # Large compiles are waiting or running: a tiny regex still compiles, plain requests run, and both
        # are answered while the large ones are still compiling (they end only at their deadline).
        small = stub.Generate(constrained(pb2.Constraint(regex="[0-9]{3}")))
        assert len(small.text) == 3 and small.text.isdigit()
        assert stub.Generate(PLAIN).token_ids == plain_before
        assert not any(f.done() for f in bigs), "the small request must not wait for the large compiles"
        for f in bigs:
            with pytest.raises(grpc.RpcError) as e:
                f.result()
            assert e.value.code() in STOPPED and "constraint.json_schema" in e.value.details(), (
                e.value.details()
            )
    # The running compile was killed (not left to run on), the queued ones expired: nothing compiles any more.
    assert sum(backend_of(srv).stats.stopped.values()) > stopped_before
    assert wait_until(lambda: compiles_idle(srv) and kv_idle(srv), 10)


def test_cancelled_request_stops_its_compile(grammar_server):
    srv = grammar_server
    b = backend_of(srv)
    cancelled_before = b.stats.stopped.get("CANCELLED", 0)
    with grpc.insecure_channel(srv.address) as ch:
        stub = pb2_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            # 3 s: the schema is prepared (~0.6 s) and compiling when the client gives up
            stub.Generate(constrained(pb2.Constraint(json_schema=slow_schema("cancel"))), timeout=3.0)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # Nobody waits for it any more: its worker is killed for that reason, not left to its deadline.
        assert wait_until(lambda: b.stats.stopped.get("CANCELLED", 0) == cancelled_before + 1, 20)
        assert wait_until(lambda: compiles_idle(srv) and kv_idle(srv), 20)
        assert len(stub.Generate(constrained(pb2.Constraint(regex="[a-c]{2}"))).text) == 2


def _descendants(pid: int) -> set[int]:
    """Every live process below pid (Linux /proc)."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                parents[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - out
        out |= frontier
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_sigterm_exits_within_grace_with_a_compile_in_progress(tiny_llama_dir):
    port, grace = free_port(), 4
    proc = serve_process(
        tiny_llama_dir,
        port,
        "--kv-cache-tokens",
        "2000",
        "--grace-period-s",
        str(grace),
        "--grammar-compile-timeout-s",
        "300",
        "--max-constraint-bytes",
        str(1 << 20),
        "--max-constraint-properties",
        "10000",
        "--grammar-worker-max-rss-mb",
        "16384",
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb2_grpc.GenerationStub(ch)
            stub.Generate(
                constrained(pb2.Constraint(regex="[0-9]{2}")), timeout=120
            )  # the compile workers run
            big = stub.Generate.future(constrained(pb2.Constraint(json_schema=slow_schema("sigterm"))))
            time.sleep(1.0)  # compiling now (it would take minutes)
            workers = _descendants(proc.pid)
            assert workers, "compile workers are child processes"
            proc.send_signal(signal.SIGTERM)
            # It exits cleanly, long before the 300 s compile could have ended (a hang guard, not a timing).
            assert proc.wait(timeout=120) == 0
            with pytest.raises(grpc.RpcError) as e:
                big.result()
            assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert wait_until(lambda: not any(_alive(p) for p in workers), 10), (
            "no compile worker outlives the server"
        )
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()


# ---- 3. the client's fault gets INVALID_ARGUMENT, found before admission ----------------------------


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    srv = BackgroundServer(
        ServerArgs(
            dtype="float32", model=str(tiny_llama_dir), port=0, kv_cache_tokens=4000, max_running_requests=8
        )
    )
    assert backend_of(srv).wait_ready(120)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as ch:
        yield pb2_grpc.GenerationStub(ch)


def nested_schema(depth: int) -> str:
    """An object schema nested `depth` objects deep (built as text: json.dumps would recurse too deep)."""
    head = '{"type": "object", "required": ["a"], "properties": {"a": '
    return head * depth + '{"type": "integer"}' + "}}" * depth


@pytest.mark.parametrize(
    "constraint, says",
    [
        (pb2.Constraint(json_schema=nested_schema(500)), "constraint.json_schema: nesting depth"),
        # 100 KB: under the size cap (8 MiB: sizes are guarded by the compile's deadline and memory),
        # refused for its depth, cheaply
        (pb2.Constraint(json_schema="[" * 100_000), "constraint.json_schema: nesting depth"),
        (pb2.Constraint(json_schema="[" * 10_000), "constraint.json_schema: nesting depth"),
        (pb2.Constraint(regex="(" * 5000 + "a" + ")" * 5000), "constraint.regex: nesting depth"),
        (pb2.Constraint(ebnf="root ::= root"), "constraint.ebnf: the grammar accepts no output"),
        (pb2.Constraint(regex=r"[^\s\S]"), "constraint.regex: the grammar accepts no output"),
    ],
)
def test_bad_grammars_are_invalid_argument_before_admission(server, stub, caplog, constraint, says):
    plain_before = stub.Generate(PLAIN).token_ids
    other = stub.Generate.future(PLAIN)
    with caplog.at_level("ERROR"):
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(constrained(constraint))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(says), (
        e.value.details()
    )
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], (
        "no traceback for the client's fault"
    )
    assert other.result().token_ids == plain_before
    assert wait_until(lambda: kv_idle(server), 10)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grammar_dead_end_fails_that_request_only(server, stub, temperature):
    """After "ab" nothing may follow (`x` matches nothing): a dead end, found while generating."""
    plain_before = stub.Generate(PLAIN).token_ids
    other = stub.Generate.future(PLAIN)
    req = constrained(pb2.Constraint(ebnf='root ::= "ab" x\nx ::= x'), n=16)
    req.sampling.temperature, req.sampling.seed = temperature, 7
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(req)
    assert (
        e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "allows no continuation" in e.value.details()
    ), e.value.details()
    assert other.result().token_ids == plain_before
    assert wait_until(lambda: kv_idle(server), 10)


@pytest.mark.parametrize("method", ["Generate", "GenerateStream", "Tokenize", "GetServerInfo"])
def test_undecodable_request_body_is_invalid_argument(server, stub, method):
    with grpc.insecure_channel(server.address) as ch:
        call = (ch.unary_stream if method == "GenerateStream" else ch.unary_unary)(
            f"/zerogap.v1.Generation/{method}"
        )
        with pytest.raises(grpc.RpcError) as e:
            out = call(b"\xff\xff\xff\xff")
            list(out) if method == "GenerateStream" else out
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cannot be decoded" in e.value.details(), (
        e.value.details()
    )
    assert stub.Generate(PLAIN).token_ids  # the server serves on


# ---- 4. input handling never stalls other RPCs ----------------------------------------------------


def _answered_during(stub, call) -> int:
    """How many GetServerInfo calls, made back to back on another thread, were answered after `call`
    started and before it returned (one answered at most if `call` held up the server's event loop)."""
    import threading

    answered: list[bool] = []  # per answer: did `call` run at the time
    running, done = threading.Event(), threading.Event()

    def poll():
        while not done.is_set():
            stub.GetServerInfo(pb2.GetServerInfoRequest())
            answered.append(running.is_set())

    th = threading.Thread(target=poll)
    th.start()
    assert wait_until(lambda: answered, 30)
    running.set()
    try:
        call()
    finally:
        running.clear()
        done.set()
        th.join()
    return sum(answered)


@pytest.mark.parametrize("size, says", [(5 << 20, "bytes cannot fit"), (60_000, "tokens in its first")])
def test_oversized_text_is_refused_cheaply(server, stub, size, says):
    text = ("lorem ipsum dolor sit amet " * (size // 27 + 1))[:size]
    for req in (
        pb2.GenerateRequest(text=text, sampling=greedy(4)),
        pb2.GenerateRequest(
            chat=pb2.ChatInput(messages=[pb2.ChatMessage(role="user", content=text)]), sampling=greedy(4)
        ),
    ):
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(req)
        assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE and says in e.value.details(), e.value.details()
    assert wait_until(lambda: kv_idle(server), 10)


def test_tokenizing_a_large_text_does_not_stall_other_rpcs(server, stub, hf_tokenizer):
    text = "The quick brown fox jumps over the lazy dog. " * 40_000  # 1.8 MB: seconds of tokenizing
    resp = None

    def tokenize():
        nonlocal resp
        resp = stub.Tokenize(pb2.TokenizeRequest(text=text[:2000]))  # warm
        resp = stub.Tokenize(pb2.TokenizeRequest(text=text))

    during = _answered_during(stub, tokenize)
    assert list(resp.token_ids) == hf_tokenizer.encode(text)
    # Others are served while it tokenizes (seconds of work): many calls are answered in the meantime.
    assert during >= 5, during


# ---- 5. admission does not stop at the first request that does not fit ------------------------------


class Streamed:
    """A GenerateStream consumed on a thread, recording when its first and last messages came."""

    def __init__(self, stub, req: pb2.GenerateRequest):
        import threading

        self.first = self.last = None
        self.tokens: list[int] = []
        self.error: grpc.RpcError | None = None
        self._thread = threading.Thread(target=self._run, args=(stub, req))
        self._thread.start()

    def _run(self, stub, req) -> None:
        try:
            for msg in stub.GenerateStream(req):
                self.first = self.first or time.monotonic()
                self.tokens += msg.token_ids
            self.last = time.monotonic()
        except grpc.RpcError as e:
            self.error = e

    def join(self) -> "Streamed":
        self._thread.join(timeout=300)
        return self


def long_request(n: int, prompt: int = 10) -> pb2.GenerateRequest:
    return pb2.GenerateRequest(
        token_ids=pb2.TokenIds(ids=list(range(5, 5 + prompt))), sampling=greedy(n, ignore_eos=True)
    )


@pytest.fixture(scope="module")
def kv_server(tiny_llama_dir):
    # Reserve admission: requests wait for their whole budget (optimistic admission would run them all).
    srv = BackgroundServer(
        ServerArgs(
            dtype="float32",
            model=str(tiny_llama_dir),
            port=0,
            kv_cache_tokens=1000,
            max_running_requests=8,
            max_skip_ahead=2,
            admission_policy="reserve",
        )
    )
    yield srv
    srv.stop()


def test_small_request_gets_in_past_one_waiting_for_kv(kv_server):
    srv = kv_server
    with grpc.insecure_channel(srv.address) as ch:
        stub = pb2_grpc.GenerationStub(ch)
        small_req = pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=[5, 6, 7, 8]), sampling=greedy(8))
        small_alone = stub.Generate(small_req).token_ids
        # Two long requests hold 2 x 410 of 1000 KV tokens; a third waits for 410 that are not free.
        longs = [Streamed(stub, long_request(400)) for _ in range(2)]
        assert wait_until(lambda: all(s.first for s in longs), 60)
        waiting = Streamed(stub, long_request(400))
        assert wait_until(lambda: srv.engine.stats().queued_requests == 1, 10)
        small = stub.Generate(small_req, timeout=60)  # needs 12: fits beside them
        assert small.token_ids == small_alone
        assert not waiting.first and not all(s.last for s in longs), "the small one went ahead of them"
        for s in [*longs, waiting]:
            assert s.join().error is None and len(s.tokens) == 400
    assert wait_until(lambda: kv_idle(srv), 10)


def test_skip_ahead_is_bounded_so_a_big_request_is_not_starved(kv_server):
    srv = kv_server  # max_skip_ahead=2
    with grpc.insecure_channel(srv.address) as ch:
        stub = pb2_grpc.GenerationStub(ch)
        longs = [Streamed(stub, long_request(400)) for _ in range(2)]
        assert wait_until(lambda: all(s.first for s in longs), 60)
        big = Streamed(stub, long_request(400))
        assert wait_until(lambda: srv.engine.stats().queued_requests == 1, 10)
        smalls = []
        for i in range(5):  # 50 KV tokens each: three would fit beside the longs at any time
            req = long_request(40)
            req.request_id = f"small-{i}"
            smalls.append(s := Streamed(stub, req))
            # in the scheduler (waiting or admitted) before the next one is sent: their order is known
            assert wait_until(lambda: req.request_id in srv.engine.scheduler.reqs or s.first or s.last, 10)
        for s in [*longs, big, *smalls]:
            assert s.join().error is None
        # Two smalls passed the big one while the longs ran; the others waited behind it, so they started
        # only once a long request ended and the big one got its room (the same step or later).
        freed = min(s.last for s in longs)
        assert all(s.first < freed for s in smalls[:2]), (freed, [s.first for s in smalls])
        assert all(s.first >= freed - 0.05 for s in smalls[2:]), (freed, [s.first for s in smalls])
        assert big.first >= freed - 0.05
    assert wait_until(lambda: kv_idle(srv), 10)


# ---- 6. mixed prompt lengths in one prefill (the fix is the lead's, in the attention backend) ---------


def _prefill_together(srv: BackgroundServer, stub, reqs: list[pb2.GenerateRequest]) -> tuple[float, list]:
    """Send reqs so that they land in one prefill batch (the scheduler is held while they queue);
    returns (seconds until all finished, responses)."""
    import threading

    hold, held = threading.Event(), threading.Event()
    sched = srv.engine.scheduler
    try:  # the hook holds the scheduler thread on a result
        with on_each_result(sched, lambda req: (held.set(), hold.wait(10))):
            blocker = stub.Generate.future(long_request(2, prompt=2))
            assert held.wait(30)
            futures = [stub.Generate.future(r) for r in reqs]
            assert wait_until(lambda: sched.inbox.qsize() == len(reqs), 10)
    finally:
        start = time.perf_counter()
        hold.set()
    out = [f.result() for f in futures]
    took = time.perf_counter() - start
    blocker.result()
    return took, out


MIXED_LONG = long_request(1, prompt=480)
MIXED_SHORT = [
    pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=[9 + i]), sampling=greedy(1)) for i in range(16)
]


def test_mixed_prompt_lengths_give_the_same_tokens(server, stub):
    alone = [stub.Generate(r).token_ids for r in [MIXED_LONG, *MIXED_SHORT]]
    _, mixed = _prefill_together(server, stub, [MIXED_LONG, *MIXED_SHORT])
    assert [m.token_ids for m in mixed] == alone
    assert wait_until(lambda: kv_idle(server), 10)


class AttentionWork:
    """Query-key pairs (times query heads) that attention computed, over every path the torch backend
    takes: the per-request flash call, SDPA (decode without the kernel), the native paged and extend
    kernels."""

    def __init__(self, monkeypatch):
        from service.models import attention, cpu_kernels

        self.pairs = 0
        sdpa, cpu_sdpa, kernel, extend = (
            attention.F.scaled_dot_product_attention,
            attention.sdpa,
            cpu_kernels.PagedAttention.__call__,
            cpu_kernels.ExtendAttention.__call__,
        )

        def counted_sdpa(q, k, v, *args, **kwargs):
            self.pairs += q.shape[:-1].numel() * k.shape[-2]
            return sdpa(q, k, v, *args, **kwargs)

        def counted_cpu_sdpa(q, k, v, *args, **kwargs):  # q [H, n, D], k [H, L, D]
            self.pairs += q.shape[0] * q.shape[1] * k.shape[1]
            return cpu_sdpa(q, k, v, *args, **kwargs)

        def counted_kernel(call, q, *args, **kwargs):
            self.pairs += q.shape[1] * int((call._keep[2] + 1).sum())  # each query row: its position + 1 keys
            return kernel(call, q, *args, **kwargs)

        def counted_extend(call, q, *args, **kwargs):  # new row i of n over kv length L: L - n + i + 1 keys
            self.pairs += q.shape[1] * sum(n * (length - n) + n * (n + 1) // 2 for *_, n, length in call.rows)
            return extend(call, q, *args, **kwargs)

        monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counted_sdpa)
        monkeypatch.setattr(attention, "sdpa", counted_cpu_sdpa)
        monkeypatch.setattr(cpu_kernels.PagedAttention, "__call__", counted_kernel)
        monkeypatch.setattr(cpu_kernels.ExtendAttention, "__call__", counted_extend)


def test_mixed_prompt_lengths_cost_about_their_tokens(server, stub, monkeypatch):
    """One 480-token prompt with 16 one-token prompts once cost 10x the long prompt alone: the batch was
    padded to its longest row. The attention work done (query-key pairs) is what their tokens need."""
    work = AttentionWork(monkeypatch)
    alone_req, mixed_req = long_request(1, prompt=480), long_request(1, prompt=480)
    mixed_req.token_ids.ids[:] = [600 + i for i in range(480)]  # another prompt: no prefix-cache hit
    work.pairs = 0
    _prefill_together(server, stub, [alone_req])
    alone = work.pairs
    work.pairs = 0
    _prefill_together(server, stub, [mixed_req, *MIXED_SHORT])
    mixed = work.pairs
    assert alone > 0 and mixed < 1.1 * alone, (mixed, alone)  # padded to the longest: ~17x
    assert wait_until(lambda: kv_idle(server), 10)


# ---- 7. input limits, compact JSON ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, code, says",
    [
        (
            dict(request_id="x" * (1 << 20)),
            "INVALID_ARGUMENT",
            "request_id: 1048576 bytes exceed the limit of 256 (--max-request-id-bytes)",
        ),
        (
            dict(sampling=greedy(4, stop=["a"] * 17)),
            "INVALID_ARGUMENT",
            "sampling.stop: 17 strings exceed the limit of 16",
        ),
        (
            dict(sampling=greedy(4, stop=["a" * 257])),
            "INVALID_ARGUMENT",
            "sampling.stop: a string of 257 bytes exceed the limit of 256",
        ),
        (
            dict(sampling=greedy(4, stop_token_ids=list(range(65)))),
            "INVALID_ARGUMENT",
            "sampling.stop_token_ids: 65 ids exceed",
        ),
        (
            dict(constraint=pb2.Constraint(regex="a" * ((8 << 20) + 1))),
            "INVALID_ARGUMENT",
            "constraint.regex: 8388609 bytes exceed the limit of 8388608",
        ),
        (dict(text="x" * (17 << 20)), "RESOURCE_EXHAUSTED", "message larger than max"),
    ],
)
def test_input_limits_refused_with_the_right_status(server, stub, kw, code, says):
    req = pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=[5, 6]), sampling=greedy(4))
    req.MergeFrom(pb2.GenerateRequest(**kw))
    for call in (stub.Generate, lambda r: list(stub.GenerateStream(r))):
        with pytest.raises(grpc.RpcError) as e:
            call(req)
        assert e.value.code() == getattr(grpc.StatusCode, code) and says in e.value.details(), (
            e.value.details()
        )
    ok = stub.Generate(
        pb2.GenerateRequest(
            request_id="r" * 256,
            token_ids=pb2.TokenIds(ids=[5, 6]),
            sampling=greedy(4, stop=["a" * 256] * 16, stop_token_ids=list(range(3, 67))),
        )
    )
    assert ok.request_id == "r" * 256
    assert wait_until(lambda: kv_idle(server), 10)


def _whitespace_outside_strings(text: str) -> bool:
    in_str = escaped = False
    for c in text:
        if in_str:
            in_str, escaped = (escaped or c != '"'), (not escaped and c == "\\")
        elif c == '"':
            in_str = True
        elif c in " \t\r\n":
            return True
    return False


@pytest.mark.parametrize(
    "constraint",
    [
        pb2.Constraint(
            json_schema=json.dumps(
                {
                    "type": "object",
                    "properties": {
                        "a": {
                            "type": "object",
                            "properties": {
                                "b": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                                "c": {"type": "string", "maxLength": 6},
                            },
                        }
                    },
                    "required": ["a"],
                }
            )
        ),
        pb2.Constraint(json_object=True),
    ],
)
def test_constrained_json_is_compact(stub, constraint):
    """No free whitespace between JSON tokens, whatever the sampler picks (a random model at temperature 1)."""
    for seed in range(6):
        req = constrained(constraint, n=48)
        req.sampling.temperature, req.sampling.seed = 1.0, seed
        text = stub.Generate(req).text
        assert text[:1] in ("{", "[") and not _whitespace_outside_strings(text), text
