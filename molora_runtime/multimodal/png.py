"""PNG <-> 8x8 17-level images, and `data:image/png;base64,...` URLs, for the HTTP API.

A small, strict PNG codec on the standard library (zlib) and numpy, so the serving path needs no
image library: it reads non-interlaced PNGs of 8 or 16 bits per channel in every colour type
(grey, RGB, palette, grey+alpha, RGBA) and refuses the rest with a reason. Every chunk's CRC is
checked, and the size comes from IHDR before a byte is inflated: an image larger than
MAX_SIDE x MAX_SIDE is refused outright, and the pixel data is inflated with a cap of exactly the
bytes its size needs, so a decompression bomb (a few KB of zlib that inflate to gigabytes) costs
at most that cap. The image is flattened onto white paper, converted to grey (ITU-R 601 luma),
resized to 8x8 by area averaging (a box filter, like the digits' own 4x4-block counts) and
quantised to 17 levels where 0 is white paper and 16 full black ink, the digits' convention.
"""

from __future__ import annotations

import base64
import binascii
import struct
import zlib

import numpy as np

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


def _unfilter(raw: bytes, height: int, stride: int, bpp: int) -> np.ndarray:
    """Undo the per-row PNG filters; returns [height, stride] uint8."""
    out = np.zeros((height, stride), dtype=np.uint8)
    prior = np.zeros(stride, dtype=np.int32)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        row = np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).astype(np.int32)
        if kind == 0:
            cur = row
        elif kind == 1:  # Sub: a running sum per channel
            cur = np.cumsum(row.reshape(-1, bpp), axis=0).reshape(-1) & 0xFF
        elif kind == 2:  # Up
            cur = (row + prior) & 0xFF
        elif kind in (3, 4):  # Average, Paeth: sequential along the row
            r, p, c = row.tolist(), prior.tolist(), [0] * stride
            for i in range(stride):
                a = c[i - bpp] if i >= bpp else 0
                b = p[i]
                if kind == 3:
                    c[i] = (r[i] + ((a + b) >> 1)) & 0xFF
                else:
                    ul = p[i - bpp] if i >= bpp else 0
                    pa, pb, pc = abs(b - ul), abs(a - ul), abs(a + b - 2 * ul)
                    pred = a if pa <= pb and pa <= pc else b if pb <= pc else ul
                    c[i] = (r[i] + pred) & 0xFF
            cur = np.array(c, dtype=np.int32)
        else:
            raise ImageInputError(f"PNG is corrupt (unknown row filter {kind})")
        out[y] = cur
        prior = cur
    return out


def decode_png(data: bytes, max_side: int = MAX_SIDE) -> np.ndarray:
    """A PNG's pixels as grey values on white paper: float [height, width], 0 black .. 255 white."""
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
    channels, size = _CHANNELS[colour], depth // 8
    bpp = channels * size
    stride = width * bpp
    need = height * (stride + 1)
    inflate = zlib.decompressobj()
    raw = bytearray()
    palette = alpha = None
    try:
        for kind, body in chunks:
            if kind == b"PLTE":
                palette = np.frombuffer(body, np.uint8)[: len(body) // 3 * 3].reshape(-1, 3)
            elif kind == b"tRNS" and colour == 3:
                alpha = np.frombuffer(body, np.uint8)
            elif kind == b"IDAT":
                raw += inflate.decompress(body, need + 1 - len(raw))
                if len(raw) > need or inflate.unconsumed_tail:
                    raise ImageInputError("PNG is corrupt (more pixel data than its size)")
    except zlib.error:
        raise ImageInputError("PNG is corrupt (bad zlib data)") from None
    if len(raw) < need:
        raise ImageInputError("PNG is truncated (too little pixel data)")
    rows = _unfilter(bytes(raw), height, stride, bpp)
    if size == 2:
        rows = rows[:, 0::2]  # the high byte of each 16-bit sample
    px = rows.reshape(height, width, channels).astype(np.float64)
    if colour == 3:
        if palette is None:
            raise ImageInputError("PNG is corrupt (palette image without PLTE)")
        index = rows.reshape(height, width)
        if int(index.max()) >= len(palette):
            raise ImageInputError("PNG is corrupt (palette index out of range)")
        full = np.full(len(palette), 255, np.uint8)
        if alpha is not None:
            full[: min(len(alpha), len(palette))] = alpha[: len(palette)]
        px = np.concatenate([palette[index], full[index][..., None]], axis=2).astype(np.float64)
    if px.shape[2] in (2, 4):  # flatten onto white paper
        a = px[..., -1:] / 255.0
        px = px[..., :-1] * a + 255.0 * (1 - a)
    if px.shape[2] == 3:
        return px @ np.array([0.299, 0.587, 0.114])
    return px[..., 0]


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
    except (ValueError, IndexError, struct.error) as exc:  # a case the checks above missed
        raise ImageInputError(f"image is not a readable PNG ({type(exc).__name__})") from None
    small = _box(grey.shape[0], SIDE) @ grey @ _box(grey.shape[1], SIDE).T
    levels = np.rint((255.0 - small) * (LEVELS - 1) / 255.0).astype(int).clip(0, LEVELS - 1)
    return [int(v) for v in levels.reshape(-1)]


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def levels_to_png(levels: list[int], scale: int = OUTPUT_SCALE) -> bytes:
    """An 8-bit grey PNG of a 64-level image (0 white .. 16 black), each pixel a `scale` square."""
    if len(levels) != PIXELS:
        raise ValueError(f"an image has {PIXELS} pixels, got {len(levels)}")
    grey = np.array([255 - round(v * 255 / (LEVELS - 1)) for v in levels], np.uint8)
    big = np.kron(grey.reshape(SIDE, SIDE), np.ones((scale, scale), np.uint8))
    side = SIDE * scale
    raw = b"".join(b"\0" + big[y].tobytes() for y in range(side))
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return (
        PNG_SIGNATURE
        + _chunk(b"IHDR", ihdr)
        + _chunk(b"IDAT", zlib.compress(raw, 9))
        + _chunk(b"IEND", b"")
    )


def levels_to_data_url(levels: list[int]) -> str:
    return DATA_URL_PREFIX + base64.b64encode(levels_to_png(levels)).decode("ascii")


def data_url_to_levels(url: str) -> list[int]:
    return png_to_levels(decode_data_url(url))
