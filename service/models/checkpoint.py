"""Where a checkpoint's weights are: its safetensors files (sharded or not)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    return files


def tensors_under(model_dir: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors named with one of `prefixes`, by their names without it (read
    lazily: the others are never loaded)."""
    out = {}
    for f in checkpoint_files(model_dir):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                for p in prefixes:
                    if name.startswith(p):
                        out[name[len(p) :]] = st.get_tensor(name)
                        break
    return out
