"""Image tokens and PNG I/O: exact round trips, the reserved block, and clear refusals."""

from __future__ import annotations

import base64
import contextlib
import json
import struct
import zlib
from pathlib import Path

import pytest

from molora_runtime.multimodal import codebook, codebook_fit, png, tokens
from molora_runtime.multimodal.digits import split

MODEL = Path("~/.cache/molora/models/smollm2-135m-instruct").expanduser()


def test_token_round_trip_on_real_digits() -> None:
    for pixels, _ in split("eval")[:50]:
        ids = tokens.image_to_ids(pixels)
        assert len(ids) == tokens.IMAGE_LEN == 18 and ids[0] == tokens.BOI and ids[-1] == tokens.EOI
        assert all(tokens.BLOCK[0] <= t < tokens.BLOCK[1] for t in ids)
        image = tokens.ids_to_image(ids)
        assert image == tokens.quantize(pixels)
        assert tokens.image_to_ids(image) == ids  # codes -> image -> codes is exact


def test_shipped_codebook_is_the_seeded_fit_on_the_train_split() -> None:
    assert [list(c) for c in codebook.codebook()] == codebook_fit.fit_codebook()
    assert codebook.codebook()[0] == (0, 0, 0, 0)  # blank paper pads short images


def test_block_is_the_end_of_smollm2_vocab_and_the_route_range_excludes_eoi() -> None:
    assert tokens.BLOCK == (49133, 49152)
    assert tokens.IMAGE_RANGE == (49133, 49151)
    assert tokens.EOI == 49151 and not tokens.IMAGE_RANGE[0] <= tokens.EOI < tokens.IMAGE_RANGE[1]
    if (MODEL / "config.json").exists():
        assert json.loads((MODEL / "config.json").read_text())["vocab_size"] == tokens.MIN_VOCAB


def test_bad_images_are_refused() -> None:
    with pytest.raises(ValueError, match="64 pixels"):
        tokens.image_to_ids([0] * 63)
    with pytest.raises(ValueError, match="grey levels"):
        tokens.image_to_ids([17] + [0] * 63)


def test_split_images_keeps_text_and_repairs_short_images() -> None:
    img = tokens.quantize(split("eval")[0][0])
    ids = [5, *tokens.image_to_ids(img), 7, tokens.BOI, tokens.CODE0 + 16, 9]
    text, images = tokens.split_images(ids)
    assert text == [5, 7, 9]
    assert images[0] == img
    assert images[1] == tokens.decode([16] + [0] * 15)


def test_streamed_images_come_once_as_each_closes() -> None:
    ids = [11, *tokens.image_to_ids(split("eval")[0][0]), 12]
    stream = tokens.ImageStream()
    got = [stream.feed(ids[i : i + 5]) for i in range(0, len(ids), 5)]
    assert [len(g) for g in got] == [0, 0, 0, 1] and stream.feed([], True) == []
    open_stream = tokens.ImageStream()
    assert open_stream.feed([tokens.BOI, tokens.CODE0 + 3]) == []
    assert len(open_stream.feed([], True)) == 1  # an unfinished image still comes at the end


def test_png_round_trip_is_exact() -> None:
    for pixels, _ in split("eval")[:20]:
        data = png.levels_to_png(pixels)
        assert data.startswith(png.PNG_SIGNATURE)
        assert png.png_to_levels(data) == pixels
        assert png.data_url_to_levels(png.levels_to_data_url(pixels)) == pixels


def _save(img, **kw) -> bytes:
    import io

    buf = io.BytesIO()
    img.save(buf, format="PNG", **kw)
    return buf.getvalue()


def test_pillow_pngs_of_every_mode_decode_like_pillow() -> None:
    """The stdlib reader against Pillow's own decoding (every colour type, every row filter)."""
    image_mod = pytest.importorskip("PIL.Image")
    import numpy as np

    rng = np.random.default_rng(0)
    rgb = image_mod.fromarray(rng.integers(0, 256, (33, 17, 3), dtype=np.uint8), "RGB")
    for mode in ("L", "RGB", "RGBA", "LA", "P"):
        data = _save(rgb.convert(mode))
        ref = image_mod.open(__import__("io").BytesIO(data)).convert("RGBA")
        white = image_mod.new("RGBA", ref.size, (255, 255, 255, 255))
        expect = np.asarray(image_mod.alpha_composite(white, ref).convert("L"), float)
        assert np.abs(png.decode_png(data) - expect).max() <= 1.01, mode


def test_any_png_is_resized_and_quantised() -> None:
    image_mod = pytest.importorskip("PIL.Image")
    img = image_mod.new("RGBA", (40, 40), (0, 0, 0, 0))  # transparent: flattened onto white
    img.paste((0, 0, 0, 255), (0, 0, 20, 40))  # left half black ink
    levels = png.png_to_levels(_save(img))
    assert levels[:8] == [16, 16, 16, 16, 0, 0, 0, 0]


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png(width: int, height: int, idat: bytes, colour: int = 0, depth: int = 8) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    return png.PNG_SIGNATURE + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def test_decompression_bombs_cost_only_the_declared_size() -> None:
    # 64x64 grey declared, 50 MB of zeros inside: inflating stops at 64*65 + 1 bytes
    bomb = _png(64, 64, zlib.compress(b"\0" * 50_000_000, 9))
    assert len(bomb) < 100_000
    with pytest.raises(png.ImageInputError, match="more pixel data"):
        png.png_to_levels(bomb)
    # a huge declared size is refused from IHDR, before any inflating
    with pytest.raises(png.ImageInputError, match="each side must be"):
        png.png_to_levels(_png(100_000, 100_000, zlib.compress(b"\0" * 100)))


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"GIF89a" + b"\0" * 20, "not a PNG"),
        (png.PNG_SIGNATURE + b"\0" * 30, "IHDR|truncated|CRC"),
        (png.levels_to_png([0] * 64)[:-20], "truncated"),
        (png.levels_to_png([0] * 64)[:40] + b"\xff" + png.levels_to_png([0] * 64)[41:], "CRC"),
        (_png(8, 8, b"not zlib at all"), "zlib"),
        (_png(8, 8, zlib.compress(b"\0" * 10)), "too little"),
        (_png(8, 8, zlib.compress(b"\x07" * 72)), "row filter"),
        (_png(4, 4, zlib.compress(b"\0" * 20)), "each side"),
        (_png(8, 8, zlib.compress(b"\0" * 72), colour=0, depth=4), "unsupported"),
        (_png(8, 8, zlib.compress(b"\0" * 72), colour=3), "PLTE"),
    ],
)
def test_malformed_pngs_are_refused_with_a_reason(data: bytes, needle: str) -> None:
    with pytest.raises(png.ImageInputError, match=needle):
        png.png_to_levels(data)


def test_data_url_refusals_say_why() -> None:
    with pytest.raises(png.ImageInputError, match="data URL"):
        png.decode_data_url("https://example.com/x.png")
    with pytest.raises(png.ImageInputError, match="data URL"):
        png.decode_data_url("data:image/jpeg;base64,AAAA")
    with pytest.raises(png.ImageInputError, match="base64"):
        png.decode_data_url(png.DATA_URL_PREFIX + "not base64!")
    with pytest.raises(png.ImageInputError, match="larger than"):
        png.decode_data_url(png.DATA_URL_PREFIX + base64.b64encode(b"x" * 2000).decode(), 1000)
    with pytest.raises(png.ImageInputError, match="larger than"):
        png.decode_data_url(png.DATA_URL_PREFIX + "A" * 10_000_000)  # refused before decoding


def test_mutated_pngs_fail_only_with_image_input_errors() -> None:
    import random

    rng = random.Random(0)
    good = png.levels_to_png(split("eval")[1][0], scale=2)
    for _ in range(300):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(png.PNG_SIGNATURE), len(data))] = rng.randrange(256)
        with contextlib.suppress(png.ImageInputError):
            png.png_to_levels(bytes(data))


def test_random_well_framed_pngs_decode_or_fail_cleanly() -> None:
    """Valid chunks and CRCs around random headers and pixel data (every filter, colour type)."""
    import random

    rng = random.Random(1)
    for _ in range(200):
        w, h = rng.randint(6, 20), rng.randint(6, 20)
        colour, depth = rng.choice([0, 2, 3, 4, 6]), rng.choice([8, 8, 16, 4])
        bpp = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[colour] * max(depth // 8, 1)
        rows = b"".join(
            bytes([rng.randint(0, 5)]) + rng.randbytes(w * bpp)
            for _ in range(h + rng.randint(-1, 1))
        )
        ihdr = struct.pack(">IIBBBBB", w, h, depth, colour, 0, 0, 0)
        extra = _chunk(b"PLTE", rng.randbytes(3 * rng.randint(0, 256))) if colour == 3 else b""
        data = (
            png.PNG_SIGNATURE
            + _chunk(b"IHDR", ihdr)
            + extra
            + _chunk(b"IDAT", zlib.compress(rows))
            + _chunk(b"IEND", b"")
        )
        try:
            levels = png.png_to_levels(data)
        except png.ImageInputError:
            continue
        assert len(levels) == 64 and all(0 <= v <= 16 for v in levels)
