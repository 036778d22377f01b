"""Image bytes -> checked, decoded RGB image -> pixel values (any worker thread).

Accepted formats are PNG, JPEG and WebP (the first frame of an animated one). An image is
refused (ImageError, which the multimodal feature turns into INVALID_ARGUMENT naming the
image's index) when it is empty, larger than the byte limit, not one of those formats, larger
than the pixel limit (checked from the header, before any pixel is decoded), or corrupt or
truncated. A JPEG's EXIF orientation is applied before anything else (a phone's portrait photo
reaches the model upright, as transformers' `load_image` gives it), and its size is read the same
way from the header. Transparency is dropped: RGBA / LA / palette images are converted to RGB as
Pillow does (alpha ignored, not composited on white), which equals `load_image` + the processor.
Preprocessing is the model's own transformers image processor, Pillow backend
(`CLIPImageProcessorPil`, `Qwen2VLImageProcessorPil`; torchvision is never needed).
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageOps, UnidentifiedImageError

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


_SWAPS_SIDES = (5, 6, 7, 8)  # EXIF orientations that turn the image by 90 degrees


def _open(data: bytes, limits: ImageLimits) -> Image.Image:
    """The image opened from its header (no pixel decoded), checked: format, size, pixel count."""
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
    return img


def _orientation(img: Image.Image) -> int:
    try:
        return int(img.getexif().get(0x0112, 1))
    except Exception:  # noqa: BLE001 (a broken EXIF block: keep the image as stored)
        return 1


def upright_size(data: bytes, limits: ImageLimits) -> tuple[int, int]:
    """(width, height) the image will have once decoded and turned by its EXIF orientation, from
    the header alone; or ImageError."""
    img = _open(data, limits)
    w, h = img.size
    return (h, w) if _orientation(img) in _SWAPS_SIDES else (w, h)


def decode(data: bytes, limits: ImageLimits) -> Image.Image:
    """The image as RGB, upright by its EXIF orientation, or ImageError."""
    img = _open(data, limits)
    try:
        img.load()
        if _orientation(img) != 1:
            img = ImageOps.exif_transpose(img)
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


@dataclass(frozen=True)
class Patches:
    """A dynamic-resolution image's flattened patches [n, C*T*P*P] and its (t, h, w) patch grid."""

    pixels: torch.Tensor
    grid: tuple[int, int, int]


class DynamicPreprocessor:
    """Qwen2-VL's image processor (Pillow backend): resized within min_pixels..max_pixels to a multiple
    of patch x merge, cut into patches. `grid` says from a size alone what the processor will give."""

    def __init__(self, model_dir: str | Path, patch_size: int, merge: int):
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(
            str(model_dir), backend="pil", local_files_only=True
        )
        p = self.processor
        if (p.patch_size, p.merge_size) != (patch_size, merge):
            raise ValueError(
                f"the image processor cuts {p.patch_size}-pixel patches merged "
                f"{p.merge_size}x{p.merge_size}; "
                f"the vision tower takes {patch_size} and {merge}"
            )
        self.patch_size, self.merge = patch_size, merge
        self.min_pixels, self.max_pixels = p.size["shortest_edge"], p.size["longest_edge"]

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        try:
            h, w = smart_resize(height, width, self.patch_size * self.merge, self.min_pixels, self.max_pixels)
        except ValueError as e:  # an aspect ratio over 200
            raise ImageError(str(e)) from None
        return 1, h // self.patch_size, w // self.patch_size

    def __call__(self, img: Image.Image) -> Patches:
        out = self.processor(images=[img], return_tensors="pt")
        grid = tuple(int(n) for n in out["image_grid_thw"][0])
        want = self.grid(*img.size)
        if grid != want:
            raise RuntimeError(f"the image processor gives a {grid} patch grid; its size says {want}")
        return Patches(out["pixel_values"], want)  # type: ignore[arg-type]
