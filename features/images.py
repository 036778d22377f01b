"""Image bytes -> checked, decoded RGB image -> pixel values (any worker thread).

Accepted formats are PNG, JPEG and WebP (the first frame of an animated one). An image is
refused (ImageError, which the multimodal feature turns into INVALID_ARGUMENT naming the
image's index) when it is empty, larger than the byte limit, not one of those formats, larger
than the pixel limit (checked from the header, before any pixel is decoded), or corrupt or
truncated. Preprocessing is the model's own transformers image processor, Pillow backend
(`CLIPImageProcessorPil` and kin; torchvision is never needed).
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP")


class ImageError(ValueError):
    """An image that cannot be used, and why (without its index: the caller names it)."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 10 << 20  # --max-image-bytes
    max_pixels: int = 25_000_000  # --max-image-pixels (width x height)
    max_images: int = 8  # --max-images-per-request

    @classmethod
    def from_args(cls, args: Any) -> "ImageLimits":
        return cls(args.max_image_bytes, args.max_image_pixels, args.max_images_per_request)


def check_size(data: bytes, limits: ImageLimits) -> None:
    """The cheap checks, done before any work is queued."""
    if not data:
        raise ImageError("empty image data")
    if len(data) > limits.max_bytes:
        raise ImageError(f"{len(data)} bytes exceed the limit of {limits.max_bytes} (--max-image-bytes)")


def decode(data: bytes, limits: ImageLimits) -> Image.Image:
    """The image as RGB, or ImageError."""
    check_size(data, limits)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own pixel limit applies
            img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise ImageError(
            f"too many pixels, over the limit of {limits.max_pixels} (--max-image-pixels): {e}"
        ) from None
    except UnidentifiedImageError:
        raise ImageError("not a PNG, JPEG or WebP image (unrecognised data)") from None
    except Exception as e:  # noqa: BLE001 (a corrupt header can raise anything from a plugin)
        raise ImageError(f"corrupt image header ({type(e).__name__}: {e})") from None
    if img.format not in FORMATS:
        raise ImageError(f"unsupported image format {img.format} (PNG, JPEG or WebP)")
    w, h = img.size
    if w < 1 or h < 1:
        raise ImageError(f"empty image ({w}x{h})")
    if w * h > limits.max_pixels:
        raise ImageError(
            f"{w}x{h} = {w * h} pixels exceed the limit of {limits.max_pixels} (--max-image-pixels)"
        )
    try:
        img.load()
        return img.convert("RGB")
    except Exception as e:  # noqa: BLE001 (truncated: OSError; broken streams: SyntaxError, ValueError, ...)
        raise ImageError(f"corrupt or truncated {img.format} data ({type(e).__name__}: {e})") from None


class Preprocessor:
    """The model directory's image processor (Pillow backend): RGB image -> [3, H, W] float32."""

    def __init__(self, model_dir: str | Path, image_size: int):
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(
            str(model_dir), backend="pil", local_files_only=True
        )
        self.image_size = image_size

    def __call__(self, img: Image.Image) -> torch.Tensor:
        px = self.processor(images=[img], return_tensors="pt")["pixel_values"][0]
        if tuple(px.shape[-2:]) != (self.image_size, self.image_size):
            raise RuntimeError(
                f"the image processor gives {tuple(px.shape[-2:])} pixels; the vision tower takes "
                f"{self.image_size}x{self.image_size}"
            )
        return px
