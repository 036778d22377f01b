"""The Qwen2-VL / Qwen2.5-VL family (Hugging Face format): dynamic-resolution vision tower + M-RoPE.

The language model is `service.models.layers.CausalLM` built as a Qwen2 (qkv bias) with
M-RoPE: its rotary angles are taken per frequency band from one of three position streams
(time, height, width; `mrope_section` says how many bands each gets). Text tokens have the
three streams equal; an image's tokens get (t, row, column) offsets from the image's grid
(`mrope_positions`), and everything after an image continues from its largest position + 1,
so a request's positions run ahead of (or behind) its token count by a constant `delta`.

The vision side runs off the scheduler loop (features/multimodal.py): the tower is transformers'
own vision module (patch embedding, 2-D rotary positions, windowed and full attention blocks,
the 2x2 patch merger) with the checkpoint's `visual.*` weights, so its numerics are those of
the reference. It takes the patches of several images at once (`grid_thw` per image) and
returns their merged embeddings back to back: one call encodes a whole step's images.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from service.models.checkpoint import tensors_under

QWEN_VL_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
_VISUAL_PREFIXES = ("model.visual.", "visual.")


def is_qwen_vl(config: Any) -> bool:
    """Whether a (top-level) model config is a Qwen2-VL / Qwen2.5-VL model."""
    if config is None:
        return False
    archs = getattr(config, "architectures", None) or []
    return getattr(config, "model_type", "") in ("qwen2_vl", "qwen2_5_vl") or any(
        a in QWEN_VL_ARCHITECTURES for a in archs
    )


def qwen_text_config(config: Any, tensors: dict[str, torch.Tensor] | None = None) -> Any:
    """The language model's config as our model reads it: a Qwen2 (qkv bias), its M-RoPE sections in
    `rope_parameters`; tied embeddings exactly when the checkpoint has no LM head (when known)."""
    cfg = copy.deepcopy(config.text_config)
    cfg.architectures = ["Qwen2ForCausalLM"]
    if tensors is not None:
        cfg.tie_word_embeddings = "lm_head.weight" not in tensors
    return cfg


def mrope_positions(
    prompt_len: int, spans: list[tuple[int, int]], grids: list[tuple[int, int, int]], merge: int
) -> tuple[torch.Tensor, int]:
    """(positions [3, prompt_len] int64, delta): an image's tokens at (t, row, column) from where it
    starts, text after it from its largest position + 1 (transformers' get_rope_index for images).
    Tokens past the prompt sit at their index + delta."""
    pos = torch.empty(3, prompt_len, dtype=torch.int64)
    at = nxt = 0  # prompt index, next position
    for (start, n), (t, h, w) in zip(spans, grids):
        text = start - at
        pos[:, at:start] = torch.arange(nxt, nxt + text)
        nxt += text
        gh, gw = h // merge, w // merge
        if t * gh * gw != n:
            raise ValueError(f"an image span of {n} tokens for a {t}x{gh}x{gw} grid")
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        pos[:, start : start + n] = torch.stack([tt, hh, ww]).reshape(3, -1) + nxt
        nxt += max(t, gh, gw)
        at = start + n
    pos[:, at:] = torch.arange(nxt, nxt + prompt_len - at)
    delta = int(pos.max()) + 1 - prompt_len if prompt_len else 0
    return pos, delta


def _tower_class(config: Any) -> Any:
    """transformers' vision module of the family: Qwen2.5-VL's (windowed attention, RMSNorm, SwiGLU)
    or Qwen2-VL's (full attention everywhere, LayerNorm, GELU MLP)."""
    if getattr(config, "model_type", "") == "qwen2_vl" or "Qwen2VLForConditionalGeneration" in (
        getattr(config, "architectures", None) or []
    ):
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        return Qwen2VisionTransformerPretrainedModel
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    return Qwen2_5_VisionTransformerPretrainedModel


class QwenVisionEncoder(nn.Module):
    """Patches of several images [sum of patches, C*T*P*P] + their grids [n, 3] -> each image's
    merged embeddings [tokens, text hidden]."""

    def __init__(self, config: Any):
        super().__init__()
        vc = config.vision_config
        self.tower = _tower_class(config)._from_config(vc)
        self.merge: int = vc.spatial_merge_size
        self.patch_size: int = vc.patch_size

    def tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        grid_thw = torch.tensor(grids, dtype=torch.int64, device=patches.device)
        out = self.tower(patches, grid_thw=grid_thw)
        merged = getattr(out, "pooler_output", out)
        return list(merged.split([self.tokens(g) for g in grids]))

    def load_from(self, model_dir: Path) -> None:
        tensors = tensors_under(model_dir, _VISUAL_PREFIXES)
        missing, unexpected = self.tower.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise KeyError(
                f"checkpoint visual weights do not match the config: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )


def load_qwen_vision_encoder(
    model_dir: str | Path, config: Any, dtype: torch.dtype, device: torch.device | str
) -> QwenVisionEncoder:
    enc = QwenVisionEncoder(config)
    enc.load_from(Path(model_dir))
    return enc.to(dtype=dtype, device=device).eval()
