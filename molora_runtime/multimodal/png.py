"""PNG <-> 8x8 17-level images, and `data:image/png;base64,...` URLs, for the HTTP API.

Pillow decodes (it comes with matplotlib in the `train` extra; the serve image installs it too).
An input PNG of any size and mode is flattened onto white, converted to grey, resized to 8x8
(box filter: an average, like the digits' own 4x4-block counts) and quantised to 17 levels where
0 is white paper and 16 full black ink, the digits' convention. Limits are checked before
decoding (bytes) and from the header before any pixel is decompressed (pixels), so a
decompression bomb costs nothing.
"""

from __future__ import annotations

import base64
import binascii
import io

from molora_runtime.multimodal.tokens import LEVELS, PIXELS, SIDE

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DATA_URL_PREFIX = "data:image/png;base64,"
MAX_PNG_BYTES = 1 << 20  # 1 MiB of PNG
MAX_PNG_PIXELS = 4096 * 4096
OUTPUT_SCALE = 8  # generated images are returned as 64x64 PNGs (each pixel an 8x8 block)


class ImageInputError(ValueError):
    """A client sent an image the server cannot use (a 400, with this message)."""


def decode_data_url(url: str, max_bytes: int = MAX_PNG_BYTES) -> bytes:
    """The PNG bytes of a `data:image/png;base64,` URL."""
    if not url.startswith(DATA_URL_PREFIX):
        head = url.split(",", 1)[0][:40]
        raise ImageInputError(
            f"image_url must be a data URL starting with {DATA_URL_PREFIX!r} (got {head!r}); "
            "remote URLs are not fetched"
        )
    payload = url[len(DATA_URL_PREFIX) :]
    if len(payload) > (max_bytes * 4) // 3 + 4:
        raise ImageInputError(f"image is larger than {max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError("image_url is not valid base64") from None
    if len(data) > max_bytes:
        raise ImageInputError(f"image is larger than {max_bytes} bytes")
    return data


def png_to_levels(data: bytes, max_pixels: int = MAX_PNG_PIXELS) -> list[int]:
    """64 grey levels (0 white .. 16 black, row-major) of a PNG."""
    from PIL import Image

    if not data.startswith(PNG_SIGNATURE):
        raise ImageInputError("image is not a PNG")
    try:
        img = Image.open(io.BytesIO(data), formats=["PNG"])
        width, height = img.size
        if width * height > max_pixels:
            raise ImageInputError(
                f"image has {width}x{height} pixels, more than the limit of {max_pixels}"
            )
        img.load()
    except ImageInputError:
        raise
    except Exception as exc:  # Pillow raises many types for corrupt data
        raise ImageInputError(f"image is not a readable PNG ({type(exc).__name__})") from None
    if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, rgba)
    grey = img.convert("L").resize((SIDE, SIDE), Image.Resampling.BOX)
    values = list(grey.tobytes())
    return [round((255 - v) * (LEVELS - 1) / 255) for v in values]


def levels_to_png(levels: list[int], scale: int = OUTPUT_SCALE) -> bytes:
    """A grey PNG of a 64-level image (0 white .. 16 black), each pixel a `scale` square."""
    from PIL import Image

    if len(levels) != PIXELS:
        raise ValueError(f"an image has {PIXELS} pixels, got {len(levels)}")
    img = Image.new("L", (SIDE, SIDE))
    img.putdata([255 - round(v * 255 / (LEVELS - 1)) for v in levels])
    img = img.resize((SIDE * scale, SIDE * scale), Image.Resampling.NEAREST)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def levels_to_data_url(levels: list[int]) -> str:
    return DATA_URL_PREFIX + base64.b64encode(levels_to_png(levels)).decode("ascii")


def data_url_to_levels(url: str) -> list[int]:
    return png_to_levels(decode_data_url(url))
