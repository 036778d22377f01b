"""Where a checkpoint's weights are, and reading them: safetensors files (sharded or not), else
PyTorch `.bin` files (older checkpoints: GPT-2's, OPT's, Pythia's), read with `weights_only`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

# (index file, the weight files' pattern without one), safetensors first; `model*` before any
# other safetensors (a Mistral repo's `consolidated.safetensors` holds the same weights, named its way)
LAYOUTS = (
    ("model.safetensors.index.json", "model*.safetensors"),
    ("model.safetensors.index.json", "*.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model*.bin"),
)


class NoWeights(FileNotFoundError):
    """A model directory with neither safetensors nor PyTorch `.bin` weights."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    for index_name, pattern in LAYOUTS:
        index = model_dir / index_name
        if index.exists():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [model_dir / n for n in names]
        files = sorted(model_dir.glob(pattern))
        if files:
            return files
    raise NoWeights(f"no weights in {model_dir} (*.safetensors, or pytorch_model*.bin)")


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """One weight file's tensors (a `.bin` through torch.load with `weights_only`: no code runs)."""
    if path.suffix == ".safetensors":
        return load_file(str(path))
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # a legacy (pre-zip) file cannot be mapped: read it whole
        return torch.load(str(path), map_location="cpu", weights_only=True)


def tensors_under(model_dir: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors named with one of `prefixes`, by their names without it
    (safetensors read lazily: the others are never loaded)."""
    out = {}
    for f in checkpoint_files(model_dir):
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    p = next((p for p in prefixes if name.startswith(p)), None)
                    if p is not None:
                        out[name[len(p) :]] = st.get_tensor(name)
            continue
        for name, t in read_weights(f).items():
            p = next((p for p in prefixes if name.startswith(p)), None)
            if p is not None:
                out[name[len(p) :]] = t
    return out
