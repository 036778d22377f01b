"""Load a local Hugging Face model directory into our packed-batch model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from service.models.checkpoint import NoWeights, checkpoint_files, read_weights
from service.models.families import family_of, model_shape
from service.models.layers import CausalLM, Checkpoint, UnsupportedModel
from service.models.llava import language_tensors
from service.models.vision import language_config_for, text_config

log = logging.getLogger(__name__)


def load_config(model_dir: str | Path):
    """The directory's config.json through transformers; one it cannot read (not JSON, a model
    type it does not know) is refused as UnsupportedModel with transformers' first line."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (ValueError, OSError) as e:
        raise UnsupportedModel.because(str(Path(model_dir) / "config.json"), e) from None


def load_generation_config(model_dir: str | Path) -> dict:
    """generation_config.json's keys as the model publishes them ({} where there is none, or it
    cannot be read): its end-of-sequence ids and its sampling defaults."""
    path = Path(model_dir) / "generation_config.json"
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as e:
        log.warning("%s: not read (%s); no generation defaults", path, e)
        return {}
    return data if isinstance(data, dict) else {}


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    max_positions: int,
    config=None,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
    pack: bool = True,
) -> CausalLM:
    """Build the model on the meta device, then fill it from its weights (or with
    seeded random weights: load_format="dummy") and move it to `device`; on CPU, lay the linears out for oneDNN (`pack`)."""
    model_dir = Path(model_dir)
    config = config or load_config(model_dir)
    tensors: dict[str, torch.Tensor] = {}
    if load_format == "auto":  # a LLaVA checkpoint: its language model's tensors, under Llama names
        try:
            files = checkpoint_files(model_dir)
        except NoWeights as e:
            raise UnsupportedModel(str(e)) from None
        for f in files:
            tensors.update(read_weights(f))
        tensors = language_tensors(tensors)
        config = language_config_for(config, tensors)
    else:
        config = text_config(config)
    shape = model_shape(config)  # an unsupported architecture is refused here, naming those served
    with torch.device("meta"):
        model = CausalLM(shape, config, max_positions)
    if load_format == "dummy":
        model = model.to_empty(device=device)
        init_dummy_weights(model, getattr(config, "initializer_range", 0.02))
        model = cast(model, dtype, device)
    elif load_format == "auto":
        model = model.to_empty(device="cpu")
        with torch.no_grad():
            try:
                family_of(shape.architecture).load(model, Checkpoint(tensors))
            except KeyError as e:  # a tensor its family needs is not there
                raise UnsupportedModel(
                    f"{model_dir}: {e.args[0]} (is it a {shape.architecture} checkpoint?)"
                ) from None
        model = cast(model, dtype, device)
    else:
        raise ValueError(f"unknown load format {load_format!r} (auto or dummy)")
    model.init_rope(device)
    if pack and torch.device(device).type == "cpu":
        model.pack_weights()
    return model.eval()


def cast(model: CausalLM, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    """The model in `dtype` on `device`, but for the parameters a module names in its
    `float32_parameters` (DeepSeek-V3's router and correction bias): those stay float32."""
    kept = [
        (m, name, getattr(m, name).detach().float().clone())
        for m in model.modules()
        for name in getattr(m, "float32_parameters", ())
        if hasattr(m, name)
    ]
    model = model.to(dtype).to(device)
    for m, name, t in kept:
        getattr(m, name).data = t.to(device)
    return model


@torch.no_grad()
def init_dummy_weights(model: CausalLM, std: float, seed: int = 0) -> None:
    """Random weights, the same for a given seed and device: matrices ~ N(0, std),
    norms 1, biases 0 (what a benchmark needs, without weight files)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.normal_(0.0, std, generator=gen)
        elif "norm" in name:
            p.fill_(1.0)
        else:
            p.zero_()
