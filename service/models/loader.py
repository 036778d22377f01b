"""Load a local Hugging Face model directory into our packed-batch model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from service.models.llama import LlamaModel


def load_config(model_dir: str | Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    return files


def load_model(model_dir: str | Path, dtype: torch.dtype, max_positions: int, config=None, pack: bool = True) -> LlamaModel:
    """Build the model on the meta device, then fill it from safetensors."""
    model_dir = Path(model_dir)
    config = config or load_config(model_dir)
    with torch.device("meta"):
        model = LlamaModel(config, max_positions)
    model = model.to_empty(device="cpu")
    tensors: dict[str, torch.Tensor] = {}
    for f in _checkpoint_files(model_dir):
        tensors.update(load_file(str(f)))
    model.load_hf_state_dict(tensors)
    model = model.to(dtype)
    model.init_rope()
    if pack:
        model.pack_weights()
    return model.eval()
