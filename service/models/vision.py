"""Which vision-language family a checkpoint is, and the parts each needs: one place to ask.

LLaVA (`llava.py`: one fixed resolution, CLIP-style tower) and Qwen2-VL / Qwen2.5-VL
(`qwen_vl.py`: dynamic resolution, M-RoPE). A text-only config is none of them. Another
vision-language checkpoint (Gemma-3 4B and up, Mistral-Small-3.1, Ministral 3, SmolVLM, Qwen3-VL and
Qwen3-VL-MoE: a `text_config` beside a
`vision_config`) is served for its language model alone, text in and out, when that model's
family is served; its images are refused.
"""

from __future__ import annotations

import copy
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
    """The language model's config: a vision-language model's `text_config` (Qwen2-VL's read as a
    Qwen2), the config itself for a text-only model."""
    if qwen_vl.is_qwen_vl(config):
        return qwen_vl.qwen_text_config(config)
    return getattr(config, "text_config", None) or config


def language_config_for(config: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The text config our language model is built from, given the checkpoint's (renamed) tensors:
    a vision-language model's has tied embeddings exactly when the checkpoint has no LM head of its
    own (the flag sits at either level in the wild)."""
    if qwen_vl.is_qwen_vl(config):
        return qwen_vl.qwen_text_config(config, tensors)
    if getattr(config, "text_config", None) is None:
        return config
    cfg = copy.deepcopy(config.text_config)
    cfg.tie_word_embeddings = "lm_head.weight" not in tensors
    return cfg


def load_vision_encoder(
    model_dir: str | Path, config: Any, dtype: torch.dtype, device: torch.device | str
) -> Any:
    """The vision side of a vision-language directory, in `dtype` on `device`."""
    if qwen_vl.is_qwen_vl(config):
        return qwen_vl.load_qwen_vision_encoder(model_dir, config, dtype, device)
    return llava.load_vision_encoder(model_dir, config, dtype, device)
