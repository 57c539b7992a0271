"""What an image becomes once a checkpoint's image processor resizes it, checked against the pixel
limit before it is resized: a thin strip (2 x 60000, within any byte or pixel limit) resized so its
short side is 336 would take gigabytes."""

from __future__ import annotations

from typing import Any

from backend_lib.config import require
from backend_lib.errors import InputError
from backend_lib.multimodal.images import ImageLimits


def resized_size(image_processor: Any, width: int, height: int) -> tuple[int, int]:
    """(width, height) a transformers image processor resizes a picture to before cropping: its
    short side to `size.shortest_edge` (CLIP's), or the fixed `size` (SigLIP's)."""
    size = image_processor.size
    edge = _field(size, "shortest_edge")
    if edge:
        scale = edge / min(width, height)
        return round(width * scale), round(height * scale)
    return int(_field(size, "width")), int(_field(size, "height"))


def resizes_by_area(image_processor: Any) -> bool:
    """Whether the processor resizes to an area between two bounds (Qwen2-VL's smart resize:
    `size.shortest_edge` and `size.longest_edge` are pixel counts there), whatever the aspect."""
    return hasattr(image_processor, "merge_size")


def check_resized(image_processor: Any, width: int, height: int, limits: ImageLimits) -> None:
    """`InputError` when the resized picture would exceed `limits.max_image_pixels`."""
    if resizes_by_area(image_processor):
        return  # at most size.longest_edge pixels, checked at load
    new_width, new_height = resized_size(image_processor, width, height)
    if new_width * new_height > limits.max_image_pixels:
        raise InputError(
            f"the image is {width}x{height} pixels; resized for the model it would be "
            f"{new_width}x{new_height} = {new_width * new_height} pixels, over the limit of "
            f"{limits.max_image_pixels} (max_image_pixels): its aspect ratio is too extreme"
        )


def check_processor_fits(image_processor: Any, limits: ImageLimits) -> None:
    """At load: a square image must fit the limit once resized, or every image would be
    refused (ConfigError naming max_image_pixels)."""
    if resizes_by_area(image_processor):
        most = int(_field(image_processor.size, "longest_edge"))
        require(
            most <= limits.max_image_pixels,
            "max_image_pixels",
            limits.max_image_pixels,
            f"the image processor resizes images to up to {most} pixels",
        )
        return
    width, height = resized_size(image_processor, 1, 1)
    require(
        width * height <= limits.max_image_pixels,
        "max_image_pixels",
        limits.max_image_pixels,
        f"the image processor resizes every image to at least {width}x{height} pixels",
    )


def _field(size: Any, key: str) -> Any:
    """`size.key` or `size[key]` (transformers' SizeDict, or a plain dict), None when absent."""
    if isinstance(size, dict):
        return size.get(key)
    return getattr(size, key, None)
