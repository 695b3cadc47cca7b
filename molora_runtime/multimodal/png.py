"""PNG <-> 8x8 17-level images, and `data:image/png;base64,...` URLs, for the HTTP API.

Pillow decodes and encodes; a strict check runs first so a hostile PNG costs nothing: every chunk's
CRC is checked, the size and format come from IHDR before a byte is inflated (an image larger than
MAX_SIDE x MAX_SIDE, interlaced, or of a sub-byte depth is refused outright), and the pixel data is
inflated with a cap of exactly the bytes its size needs, so a decompression bomb costs at most that
cap. The image is flattened onto white paper, converted to grey, resized to 8x8 by area averaging
and quantised to 17 levels where 0 is white paper and 16 full black ink, the digits' convention.
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
import zlib

import numpy as np
from PIL import Image

from molora_runtime.multimodal.tokens import LEVELS, PIXELS, SIDE

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DATA_URL_PREFIX = "data:image/png;base64,"
MAX_PNG_BYTES = 256 * 1024  # of PNG, before base64
MAX_SIDE = 128  # pixels per side; an 8x8 digit needs far fewer
MIN_SIDE = SIDE
OUTPUT_SCALE = 8  # generated images are returned as 64x64 PNGs (each pixel an 8x8 block)
_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel
_MAX_CHUNKS = 4096


class ImageInputError(ValueError):
    """A client sent an image the server cannot use (a 400, with this message)."""


def decode_data_url(url: str, max_bytes: int = MAX_PNG_BYTES) -> bytes:
    """The PNG bytes of a `data:image/png;base64,` URL (remote URLs are refused, never fetched)."""
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


def _chunks(data: bytes):
    pos, count = len(PNG_SIGNATURE), 0
    while pos < len(data):
        if pos + 12 > len(data):
            raise ImageInputError("PNG is truncated (a chunk header is cut off)")
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        end = pos + 12 + length
        if end > len(data):
            raise ImageInputError("PNG is truncated (a chunk runs past the end)")
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[end - 4 : end])
        if zlib.crc32(kind + body) != crc:
            raise ImageInputError(f"PNG is corrupt (bad CRC in chunk {kind!r})")
        count += 1
        if count > _MAX_CHUNKS:
            raise ImageInputError(f"PNG has more than {_MAX_CHUNKS} chunks")
        yield kind, body
        if kind == b"IEND":
            return
        pos = end
    raise ImageInputError("PNG is truncated (no IEND chunk)")


def _check(data: bytes, max_side: int) -> None:
    """Refuse, with a reason, any PNG that is not a small, well-formed, supported image."""
    if not data.startswith(PNG_SIGNATURE):
        raise ImageInputError("image is not a PNG")
    chunks = _chunks(data)
    try:
        kind, ihdr = next(chunks)
    except StopIteration:
        raise ImageInputError("PNG is truncated (no IHDR chunk)") from None
    if kind != b"IHDR" or len(ihdr) != 13:
        raise ImageInputError("image is not a readable PNG (IHDR must come first)")
    width, height, depth, colour, compression, filtering, interlace = struct.unpack(
        ">IIBBBBB", ihdr
    )
    if not (MIN_SIDE <= width <= max_side and MIN_SIDE <= height <= max_side):
        raise ImageInputError(
            f"image is {width}x{height} pixels; each side must be {MIN_SIDE}..{max_side}"
        )
    if colour not in _CHANNELS or depth not in (8, 16) or (colour == 3 and depth != 8):
        raise ImageInputError(
            f"unsupported PNG (colour type {colour}, bit depth {depth}): send 8- or 16-bit "
            "grey, RGB, RGBA, grey+alpha or 8-bit palette"
        )
    if compression or filtering or interlace:
        raise ImageInputError("unsupported PNG (interlaced or non-standard compression/filter)")
    stride = width * _CHANNELS[colour] * depth // 8
    need = height * (stride + 1)
    inflate = zlib.decompressobj()
    raw = bytearray()
    has_palette = False
    try:
        for kind, body in chunks:
            has_palette |= kind == b"PLTE"
            if kind == b"IDAT":
                raw += inflate.decompress(body, need + 1 - len(raw))
                if len(raw) > need or inflate.unconsumed_tail:
                    raise ImageInputError("PNG is corrupt (more pixel data than its size)")
    except zlib.error:
        raise ImageInputError("PNG is corrupt (bad zlib data)") from None
    if len(raw) < need:
        raise ImageInputError("PNG is truncated (too little pixel data)")
    bad = next((raw[y * (stride + 1)] for y in range(height) if raw[y * (stride + 1)] > 4), None)
    if bad is not None:
        raise ImageInputError(f"PNG is corrupt (unknown row filter {bad})")
    if colour == 3 and not has_palette:
        raise ImageInputError("PNG is corrupt (palette image without PLTE)")


def decode_png(data: bytes, max_side: int = MAX_SIDE) -> np.ndarray:
    """A PNG's pixels as grey values on white paper: float [height, width], 0 black .. 255 white."""
    _check(data, max_side)
    try:
        img = Image.open(io.BytesIO(data), formats=["PNG"])
        img.load()
        if img.mode in ("I", "I;16", "I;16B"):  # 16-bit grey: its high byte
            return (np.asarray(img, dtype=np.int64) >> 8).astype(np.float64)
        rgba = img.convert("RGBA")
    except (OSError, SyntaxError, ValueError) as exc:  # what the checks above cannot see
        raise ImageInputError(f"image is not a readable PNG ({exc})") from None
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return np.asarray(Image.alpha_composite(white, rgba).convert("L"), dtype=np.float64)


def _box(n: int, out: int) -> np.ndarray:
    """[out, n] area weights of resampling n pixels to out (each row sums to 1)."""
    w = np.zeros((out, n))
    for o in range(out):
        lo, hi = o * n / out, (o + 1) * n / out
        for i in range(int(lo), min(n, int(np.ceil(hi)))):
            w[o, i] = min(hi, i + 1) - max(lo, i)
    return w / w.sum(axis=1, keepdims=True)


def png_to_levels(data: bytes, max_side: int = MAX_SIDE) -> list[int]:
    """64 grey levels (0 white .. 16 black, row-major) of a PNG."""
    try:
        grey = decode_png(data, max_side)
    except ImageInputError:
        raise
    except (ValueError, IndexError) as exc:  # a case the checks above missed
        raise ImageInputError(f"image is not a readable PNG ({type(exc).__name__})") from None
    small = _box(grey.shape[0], SIDE) @ grey @ _box(grey.shape[1], SIDE).T
    levels = np.rint((255.0 - small) * (LEVELS - 1) / 255.0).astype(int).clip(0, LEVELS - 1)
    return [int(v) for v in levels.reshape(-1)]


def levels_to_png(levels: list[int], scale: int = OUTPUT_SCALE) -> bytes:
    """An 8-bit grey PNG of a 64-level image (0 white .. 16 black), each pixel a `scale` square."""
    if len(levels) != PIXELS:
        raise ValueError(f"an image has {PIXELS} pixels, got {len(levels)}")
    grey = np.array([255 - round(v * 255 / (LEVELS - 1)) for v in levels], np.uint8)
    big = np.kron(grey.reshape(SIDE, SIDE), np.ones((scale, scale), np.uint8))
    buf = io.BytesIO()
    Image.fromarray(big, "L").save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def levels_to_data_url(levels: list[int]) -> str:
    return DATA_URL_PREFIX + base64.b64encode(levels_to_png(levels)).decode("ascii")


def data_url_to_levels(url: str) -> list[int]:
    return png_to_levels(decode_data_url(url))
