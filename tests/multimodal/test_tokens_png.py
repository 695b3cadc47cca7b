"""Image tokens and PNG I/O: exact round trips, the reserved block, and clear refusals."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest

from molora_runtime.multimodal import png, tokens
from molora_runtime.multimodal.digits import split

MODEL = Path("~/.cache/molora/models/smollm2-135m-instruct").expanduser()


def test_token_round_trip_on_real_digits() -> None:
    for pixels, _ in split("eval")[:50]:
        ids = tokens.image_to_ids(pixels)
        assert len(ids) == 66 and ids[0] == tokens.BOI and ids[-1] == tokens.EOI
        assert all(tokens.BLOCK[0] <= t < tokens.BLOCK[1] for t in ids)
        assert tokens.ids_to_image(ids) == pixels


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
    img = list(range(17)) * 3 + [0] * 13
    ids = [5, *tokens.image_to_ids(img), 7, tokens.BOI, tokens.LEVEL0 + 16, 9]
    text, images = tokens.split_images(ids)
    assert text == [5, 7, 9]
    assert images[0] == img
    assert images[1] == [16] + [0] * 63


def test_png_round_trip_is_exact() -> None:
    for pixels, _ in split("eval")[:20]:
        data = png.levels_to_png(pixels)
        assert data.startswith(png.PNG_SIGNATURE)
        assert png.png_to_levels(data) == pixels
        assert png.data_url_to_levels(png.levels_to_data_url(pixels)) == pixels


def test_any_png_is_resized_and_quantised() -> None:
    from PIL import Image

    img = Image.new("RGBA", (40, 40), (0, 0, 0, 0))  # transparent: flattened onto white paper
    img.paste((0, 0, 0, 255), (0, 0, 20, 40))  # left half black ink
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    levels = png.png_to_levels(buf.getvalue())
    assert levels[:8] == [16, 16, 16, 16, 0, 0, 0, 0]


def test_png_refusals_say_why() -> None:
    with pytest.raises(png.ImageInputError, match="data URL"):
        png.decode_data_url("https://example.com/x.png")
    with pytest.raises(png.ImageInputError, match="base64"):
        png.decode_data_url(png.DATA_URL_PREFIX + "not base64!")
    with pytest.raises(png.ImageInputError, match="larger than"):
        png.decode_data_url(png.DATA_URL_PREFIX + base64.b64encode(b"x" * 2000).decode(), 1000)
    with pytest.raises(png.ImageInputError, match="not a PNG"):
        png.png_to_levels(b"GIF89a" + b"\0" * 20)
    with pytest.raises(png.ImageInputError, match="readable"):
        png.png_to_levels(png.PNG_SIGNATURE + b"\0" * 30)
    big = png.levels_to_png([0] * 64, scale=40)  # 320x320
    with pytest.raises(png.ImageInputError, match="pixels"):
        png.png_to_levels(big, max_pixels=100 * 100)
