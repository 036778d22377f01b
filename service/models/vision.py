"""Which vision-language family a checkpoint is, and the parts each needs: one place to ask.

LLaVA (`llava.py`: one fixed resolution, CLIP-style tower) and Qwen2-VL / Qwen2.5-VL
(`qwen_vl.py`: dynamic resolution, M-RoPE). A text-only config is none of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from service.models import llava, qwen_vl


def family(config: Any) -> str | None:
    """'llava', 'qwen_vl' or None (a text-only model)."""
    if llava.is_llava(config):
        return "llava"
    if qwen_vl.is_qwen_vl(config):
        return "qwen_vl"
    return None


def text_config(config: Any) -> Any:
    """The language model's config (the config itself for a text-only model)."""
    if qwen_vl.is_qwen_vl(config):
        return qwen_vl.qwen_text_config(config)
    return llava.text_config(config)


def language_config_for(config: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The text config our language model is built from, given the checkpoint's (renamed) tensors."""
    if qwen_vl.is_qwen_vl(config):
        return qwen_vl.qwen_text_config(config, tensors)
    return llava.language_config_for(config, tensors)


def load_vision_encoder(
    model_dir: str | Path, config: Any, dtype: torch.dtype, device: torch.device | str
) -> Any:
    """The vision side of a vision-language directory, in `dtype` on `device`."""
    if qwen_vl.is_qwen_vl(config):
        return qwen_vl.load_qwen_vision_encoder(model_dir, config, dtype, device)
    return llava.load_vision_encoder(model_dir, config, dtype, device)
