"""The LLaVA family (Hugging Face format): vision tower + projector + our Llama-family language model.

The language model is a Llama-family `service.models.layers.CausalLM`, filled from the checkpoint's
language-model weights (`model.language_model.*` and `lm_head.*` in transformers 5.x; the
older `language_model.model.*` / `language_model.lm_head.*` layout too). The vision side runs
off the scheduler loop, on the image worker (features/multimodal.py): the CLIP-style tower is
transformers' own vision module (`AutoModel.from_config(vision_config)`, e.g. CLIPVisionModel)
with the checkpoint's `vision_tower.*` weights, so its numerics are those of the reference; the
projector (`linear_1 -> act -> linear_2`) is ours. Features are taken from
`vision_feature_layer` (one index, or several concatenated) with
`vision_feature_select_strategy` ("default" drops the CLS position, "full" keeps it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from service.models.checkpoint import tensors_under

LLAVA_ARCHITECTURES = ("LlavaForConditionalGeneration",)
_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


def is_llava(config: Any) -> bool:
    """Whether a (top-level) model config is a LLaVA vision-language model."""
    if config is None:
        return False
    archs = getattr(config, "architectures", None) or []
    return getattr(config, "model_type", "") == "llava" or any(a in LLAVA_ARCHITECTURES for a in archs)


def language_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LLaVA checkpoint's language-model tensors under the plain Llama names
    (`model.layers...`, `lm_head.weight`); other checkpoints are returned as they are."""
    out: dict[str, torch.Tensor] = {}
    found = False
    for name, t in tensors.items():
        for old, new in (
            ("model.language_model.", "model."),
            ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."),
            ("model.text_model.", "model."),  # Idefics3 / SmolVLM
        ):
            if name.startswith(old):
                out[new + name[len(old) :]] = t
                found = True
                break
        else:
            if name.startswith("lm_head."):
                out[name] = t
    return out if found else tensors


class Projector(nn.Module):
    """LLaVA's multimodal projector: linear_1 -> act -> linear_2."""

    def __init__(self, in_features: int, hidden: int, act: str, bias: bool):
        super().__init__()
        from transformers.activations import ACT2FN

        self.linear_1 = nn.Linear(in_features, hidden, bias=bias)
        self.act = ACT2FN[act]
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class VisionEncoder(nn.Module):
    """Pixel values [n, 3, H, W] -> image embeddings [n, tokens_per_image, text hidden]."""

    def __init__(self, config: Any):
        super().__init__()
        from transformers import AutoModel

        vc = config.vision_config
        layers = config.vision_feature_layer
        self.feature_layers: list[int] = [layers] if isinstance(layers, int) else list(layers)
        self.strategy: str = config.vision_feature_select_strategy
        if self.strategy not in ("default", "full"):
            raise ValueError(
                f"unsupported vision_feature_select_strategy {self.strategy!r} (default or full)"
            )
        self.tower = AutoModel.from_config(vc)
        self.projector = Projector(
            vc.hidden_size * len(self.feature_layers),
            config.text_config.hidden_size,
            config.projector_hidden_act,
            bool(getattr(config, "multimodal_projector_bias", True)),
        )
        self.image_size: int = vc.image_size
        patches = (vc.image_size // vc.patch_size) ** 2
        self.tokens_per_image = patches + (1 if self.strategy == "full" else 0)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.tower(pixel_values, output_hidden_states=True, return_dict=True)
        picked = [out.hidden_states[i] for i in self.feature_layers]
        if self.strategy == "default":
            picked = [h[:, 1:] for h in picked]
        return self.projector(torch.cat(picked, dim=-1))

    def load_from(self, model_dir: Path) -> None:
        """The checkpoint's vision-tower and projector tensors (read lazily: the language model's are skipped)."""
        own = set(self.tower.state_dict())
        tower = {
            # the older layout nests the tower (CLIPVisionModel.vision_model)
            k.removeprefix("vision_model.") if k not in own and k.startswith("vision_model.") else k: t
            for k, t in tensors_under(model_dir, _VISION_PREFIXES).items()
        }
        proj = tensors_under(model_dir, _PROJECTOR_PREFIXES)
        for module, tensors, what in (
            (self.tower, tower, "vision_tower"),
            (self.projector, proj, "multi_modal_projector"),
        ):
            missing, unexpected = module.load_state_dict(tensors, strict=False)
            missing = [m for m in missing if not m.endswith("position_ids")]  # a buffer, not a weight
            if missing or unexpected:
                raise KeyError(
                    f"checkpoint {what} weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
                )


def load_vision_encoder(
    model_dir: str | Path, config: Any, dtype: torch.dtype, device: torch.device | str
) -> VisionEncoder:
    """The vision tower + projector of a LLaVA directory, in `dtype` on `device`."""
    enc = VisionEncoder(config)
    enc.load_from(Path(model_dir))
    return enc.to(dtype=dtype, device=device).eval()
