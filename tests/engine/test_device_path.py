"""The device path on CPU: no host syncs in the forward, streams/events wired, the
Triton backend inside the engine, device options.

The same code runs on CUDA (bench/gpu_check.py checks it there, with
torch.cuda.set_sync_debug_mode); here the CPU no-op streams and events go through it.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from service.config import ServerArgs, parse_server_args
from service.core.device import Device, resolve_device
from service.core.request import SamplingParams
from service.engine.engine import SyncClient, collect
from service.models.backends import resolve_attention_backend
from tests.helpers import before_each_forward, need_triton

T = torch.Tensor
# Host reads of device values, and ops whose output size depends on device data.
SYNCING = {
    T.item,
    T.tolist,
    T.cpu,
    T.numpy,
    T.__bool__,
    T.__int__,
    T.__float__,
    T.__index__,
    torch.nonzero,
    T.nonzero,
    torch.argwhere,
    torch.masked_select,
    T.masked_select,
    torch.multinomial,
    T.multinomial,
    torch.unique,
    T.unique,
    torch.bincount,
}


def _has_tensor_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) for i in items)


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostSyncDetector(TorchFunctionMode):
    """Records every call that would make the host wait for the device on CUDA."""

    def __init__(self, found: list[str]):
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if func in SYNCING:
            self.found.append(name)
        elif func in (T.__getitem__, T.__setitem__) and _has_bool_index(args[1]):
            self.found.append(f"{name} with a boolean mask")
        elif func is T.__setitem__ and _has_tensor_index(args[1]) and not isinstance(args[2], torch.Tensor):
            self.found.append(
                "__setitem__ of a host scalar at tensor indices"
            )  # the scalar is copied to the device
        elif func is torch.where and len(args) + len(kwargs) == 1:
            self.found.append("torch.where(cond)")
        elif func in (torch.repeat_interleave, T.repeat_interleave) and "output_size" not in kwargs:
            self.found.append("repeat_interleave without output_size")
        return func(*args, **kwargs)


def watch_forward(client: SyncClient, found: list[str]) -> None:
    """Run every step (resolve, model, features, sampler, FutureMap, copies) under the detector."""
    worker = client.engine.worker
    inner = worker.step

    def step(*a, **kw):
        with HostSyncDetector(found):
            return inner(*a, **kw)

    worker.step = step


MIXED = [
    SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True),
    SamplingParams(
        temperature=0.8,
        top_k=20,
        top_p=0.9,
        min_p=0.05,
        seed=3,
        max_new_tokens=6,
        ignore_eos=True,
        repetition_penalty=1.2,
        frequency_penalty=0.2,
        presence_penalty=0.1,
    ),
    SamplingParams(temperature=0.7, seed=5, min_new_tokens=3, max_new_tokens=5),
]


@pytest.mark.parametrize("mode", ["normal", "overlap"])
def test_forward_path_has_no_host_sync(tiny_llama_dir, mode):
    found: list[str] = []
    c = SyncClient(
        ServerArgs(dtype="float32", loop=mode, kv_cache_tokens=1000, max_running_requests=8), tiny_llama_dir
    )
    watch_forward(c, found)
    try:
        prompts = [[5, 6, 7, 8 + i] for i in range(6)]
        params = [MIXED[i % 3] for i in range(6)]
        feats = [
            {
                "logprobs": {
                    "return_logprob": True,
                    "top_logprobs_num": 3,
                    "token_ids_logprob": [5, 9],
                    "logprob_start_len": 1,
                }
            }
            if i % 2
            else None
            for i in range(6)
        ]
        outs = c.generate(prompts, params, feats)
        assert all(collect(o)[2].error is None for o in outs)
    finally:
        c.close()
    assert found == [], f"host syncs in the forward path: {sorted(set(found))}"


def test_detector_sees_the_forward_thread(tiny_llama_dir):
    """The wrapping reaches the forward thread: a sync planted in a forward hook is caught."""
    found: list[str] = []
    c = SyncClient(ServerArgs(dtype="float32", kv_cache_tokens=500, max_running_requests=4), tiny_llama_dir)
    watch_forward(c, found)
    try:
        with before_each_forward(c.engine.worker, lambda fb: fb.positions.max().item()):
            c.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True))
    finally:
        c.close()
    assert found and set(found) == {"item"}


def test_detector_catches_syncs():
    found: list[str] = []
    x = torch.arange(6)
    with HostSyncDetector(found):
        x.item() if x.numel() == 1 else x[0].item()
        x[x > 2] = 0
        bool(x.any())
        torch.multinomial(torch.ones(4), 1)
        x[torch.tensor([1])] = 5
        x[torch.tensor([1])] = torch.tensor(5)  # a device value: fine
    assert found == [
        "item",
        "__setitem__ with a boolean mask",
        "__bool__",
        "multinomial",
        "__setitem__ of a host scalar at tensor indices",
    ]


class SpyStream(torch.cpu.Stream):
    def __init__(self) -> None:
        super().__init__()
        self.waited: list = []

    def wait_event(self, event) -> None:
        self.waited.append(event)


@pytest.mark.parametrize("mode", ["normal", "overlap"])
def test_forward_waits_on_each_batch_ready_event(tiny_llama_dir, mode):
    """Every step's stream waits on its batch's `ready` event; results carry copy_done."""
    c = SyncClient(
        ServerArgs(dtype="float32", loop=mode, kv_cache_tokens=1000, max_running_requests=8), tiny_llama_dir
    )
    spy = c.engine.worker.stream = SpyStream()
    seen: list = []
    inner = c.engine.worker.step

    def step(fb, *a, **kw):
        result = inner(fb, *a, **kw)
        seen.append((fb.ready, result.copy_done))
        return result

    c.engine.worker.step = step
    try:
        c.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    finally:
        c.close()
    assert len(seen) >= 4
    assert spy.waited == [ready for ready, _ in seen]
    assert all(ready is not None and done is not None for ready, done in seen)


def test_submit_all_admits_requests_together(tiny_llama_dir):
    c = SyncClient(ServerArgs(dtype="float32", kv_cache_tokens=1000, max_running_requests=8), tiny_llama_dir)
    sizes: list[tuple[str, int]] = []
    try:
        with before_each_forward(c.engine.worker, lambda fb: sizes.append((fb.mode.value, fb.batch_size))):
            e = c.engine
            reqs = [
                e.build_request(
                    f"r{i}", [5, 6, 7 + i], SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
                )
                for i in range(6)
            ]
            e.submit_all(reqs)
            for r in reqs:
                c.wait(r.rid)
    finally:
        c.close()
    assert sizes[0] == ("extend", 6) and all(s == ("decode", 6) for s in sizes[1:])


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_triton_backend_engine_matches_torch(kind, tiny_llama_dir, tiny_mistral_dir):
    """The whole engine with the Triton kernels (interpreted on CPU): the same greedy
    tokens as the torch backend, in both loops (Mistral: sliding window of 8)."""
    need_triton()
    model = tiny_llama_dir if kind == "llama" else tiny_mistral_dir
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15][: 3 + 4 * i] for i in range(3)]
    sp = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    results = {}
    for backend, overlap in (("torch", False), ("triton", False), ("triton", True)):
        c = SyncClient(
            ServerArgs(
                dtype="float32",
                attention_backend=backend,
                loop="overlap" if overlap else "normal",
                kv_cache_tokens=600,
                max_running_requests=4,
            ),
            model,
        )
        try:
            assert type(c.engine.worker.attention).__name__.lower().startswith(backend)
            results[(backend, overlap)] = [collect(o)[0] for o in c.generate(prompts, sp)]
        finally:
            c.close()
    assert results[("triton", False)] == results[("torch", False)]
    assert results[("triton", True)] == results[("torch", False)]


def test_device_options():
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="no CUDA"):
            resolve_device("cuda")
    with pytest.raises(ValueError):
        resolve_device("meta")
    cpu = Device.of("cpu")
    assert resolve_attention_backend("auto", cpu) == "torch"
    assert resolve_attention_backend("triton", cpu) == "triton"
    with pytest.raises(ValueError):
        resolve_attention_backend("flash", cpu)
    args = parse_server_args(
        ["--device", "cpu", "--attention-backend", "triton", "--dtype", "float16", "--load-format", "dummy"]
    )
    assert (args.device, args.attention_backend, args.dtype, args.load_format) == (
        "cpu",
        "triton",
        "float16",
        "dummy",
    )
    # CPU transfers are the identity: no copies, no pinned memory
    t = torch.arange(3)
    assert cpu.to_device(t)[0] is t and cpu.to_host(t) is t


def test_cuda_graph_buckets_cover_every_batch_size():
    from service.engine.cuda_graph import graph_buckets

    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_buckets(5) == [1, 2, 4, 5]
    assert graph_buckets(100)[-3:] == [80, 96, 100]


def test_dummy_weights_are_deterministic(tiny_llama_dir):
    """--load-format dummy: random weights from the config, the same in every engine."""
    outs = []
    for _ in range(2):
        c = SyncClient(
            ServerArgs(dtype="float32", load_format="dummy", kv_cache_tokens=200, max_running_requests=2),
            tiny_llama_dir,
        )
        try:
            outs.append(
                collect(
                    c.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True))[
                        0
                    ]
                )[0]
            )
        finally:
            c.close()
    assert outs[0] == outs[1] and len(outs[0]) == 5
