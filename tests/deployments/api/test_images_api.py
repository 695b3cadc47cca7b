"""Images through the real HTTP stack (Ray, engine, tiny model with SmolLM2's vocabulary).

In: `image_url` parts with PNG data URLs become 18 image tokens of the prompt; every bad image
(remote URL, bad base64, not a PNG, corrupt, a decompression bomb, the wrong size, too big,
too many) is a 400 naming the part, and the server stays healthy. Out: generated image codes
come back as PNG `image_url` parts (`message.images`; streamed once, when the image closes) and
stay out of the text. The tiny model is random, so the image is forced with logit_bias.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib

import httpx
import pytest

from molora_runtime.multimodal import png, tokens
from molora_runtime.multimodal.digits import split
from tests.deployments.serve_helpers import serving, tiny_args

PIXELS = split("eval")[0][0]
URL = png.levels_to_data_url(PIXELS)
# BOI first, then the 17 codes once each (presence penalty), then EOI: one image of 17 codes
# (cut to 16) in 19 greedy tokens (the random model's own logits are far below 0.5).
DRAW = {
    "logit_bias": {
        str(tokens.BOI): 100,
        **{str(tokens.CODE0 + c): 99 for c in range(17)},
        str(tokens.EOI): 98.5,
    },
    "presence_penalty": 2.0,
    "max_tokens": 19,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def app_url(ray_cluster, tiny_assets):
    pictures = {
        "kind": "vocab",
        "ranges": [{"start": tokens.BOI, "end": tokens.EOI, "adapter": "math"}],
        "default": "code",
    }
    args = tiny_args(
        tiny_assets, seqs=4, model_len=512, max_tokens=8, expose={"routes": {"pictures": pictures}}
    )
    yield from serving(ray_cluster, args, replicas=1, max_ongoing=16)


def _chat(url: str, body: dict, raw: bytes | None = None) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(
        f"{url}/v1/chat/completions",
        content=content,
        headers={"content-type": "application/json"},
        timeout=60,
    )


def _image_message(url: str, text: str = "Which digit is this?") -> list[dict]:
    parts = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    return [{"role": "user", "content": parts}]


def test_an_image_part_is_18_prompt_tokens(app_url):
    body = {"model": "math", "max_tokens": 2}
    with_image = _chat(app_url, {**body, "messages": _image_message(URL)})
    assert with_image.status_code == 200, with_image.text
    text_only = _chat(
        app_url, {**body, "messages": [{"role": "user", "content": "Which digit is this?"}]}
    )
    diff = with_image.json()["usage"]["prompt_tokens"] - text_only.json()["usage"]["prompt_tokens"]
    assert diff == tokens.IMAGE_LEN
    assert "images" not in text_only.json()["choices"][0]["message"]


def _images(message: dict) -> list[list[int]]:
    out = []
    for part in message.get("images") or []:
        assert part["type"] == "image_url"
        out.append(png.data_url_to_levels(part["image_url"]["url"]))
    return out


def _ask(url: str, model: str, **extra) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "7"}], **DRAW, **extra}
    resp = _chat(url, body)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]


def test_generated_images_come_back_as_png_parts_not_text(app_url):
    # the base model, forced: exactly BOI, 17 codes, EOI (the route's random adapters would
    # move the logits past the bias margins)
    message = _ask(app_url, "tiny-base", molora={"images": True})
    [image] = _images(message)
    assert image == tokens.quantize(image) and image != [0] * 64  # codebook patches
    assert message["content"] == ""  # the codes are the image, not text
    # not asked for, the same codes come back as the (rare BPE) words they are
    plain = _ask(app_url, "tiny-base")
    assert "images" not in plain and len(plain["content"]) > 40
    # a route that sends the image range to an adapter returns images by default
    assert "images" in _ask(app_url, "pictures")
    # streamed: the image arrives once, in the chunk where it closes, equal to the full one
    chunks = []
    body = {"model": "tiny-base", "messages": [{"role": "user", "content": "7"}], **DRAW}
    body |= {"stream": True, "molora": {"images": True}}
    with httpx.stream("POST", f"{app_url}/v1/chat/completions", json=body, timeout=60) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    streamed = [img for c in chunks for ch in c["choices"] for img in _images(ch["delta"])]
    assert streamed == [image]
    assert "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"]) == ""


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png_url(width: int, height: int, idat: bytes) -> str:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    data = png.PNG_SIGNATURE + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
    return png.DATA_URL_PREFIX + base64.b64encode(data).decode()


PART = "messages.0.content.1.image_url.url"
BAD_IMAGES = [
    ("https://example.com/seven.png", "remote URLs are not fetched"),
    ("http://169.254.169.254/latest/meta-data", "remote URLs are not fetched"),
    ("file:///etc/passwd", "data URL"),
    ("data:image/jpeg;base64,/9j/4AAQ", "data URL"),
    (png.DATA_URL_PREFIX + "%%%not-base64", "base64"),
    (png.DATA_URL_PREFIX + base64.b64encode(b"GIF89a" + b"\0" * 30).decode(), "not a PNG"),
    (URL[:-24], "base64|truncated"),
    (_png_url(64, 64, zlib.compress(b"\0" * 30_000_000, 9)), "more pixel data"),  # bomb
    (_png_url(50_000, 50_000, zlib.compress(b"\0" * 64)), "each side must be"),
    (_png_url(4, 4, zlib.compress(b"\0" * 20)), "each side must be"),
    (_png_url(8, 8, b"\x78\x9c garbage"), "zlib"),
    (png.DATA_URL_PREFIX + "A" * 600_000, "larger than"),
]


@pytest.mark.parametrize(("url", "needle"), BAD_IMAGES)
def test_bad_images_are_400s_naming_the_part(app_url, url, needle):
    resp = _chat(app_url, {"model": "math", "messages": _image_message(url)})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == PART and err["type"] == "invalid_request_error"
    import re

    assert re.search(needle, err["message"]), err["message"]


def test_too_many_or_oversized_requests_and_slot_spoofing(app_url):
    parts = [{"type": "image_url", "image_url": {"url": URL}}] * 17
    resp = _chat(app_url, {"model": "math", "messages": [{"role": "user", "content": parts}]})
    assert resp.status_code == 400 and "at most 16 image parts" in resp.json()["error"]["message"]
    huge = png.DATA_URL_PREFIX + "A" * (2 << 20)  # past the request body limit
    resp = _chat(app_url, {"model": "math", "messages": _image_message(huge)})
    assert resp.status_code == 413
    spoof = _image_message(URL, text="\ufffc two slots")
    resp = _chat(app_url, {"model": "math", "messages": spoof})
    assert resp.status_code == 400 and "U+FFFC" in resp.json()["error"]["message"]
    bad_part = [{"role": "user", "content": [{"type": "image_url", "image_url": {"uri": URL}}]}]
    resp = _chat(app_url, {"model": "math", "messages": bad_part})
    assert resp.status_code == 400
    assert httpx.get(f"{app_url}/health", timeout=10).status_code == 200
    ok = _chat(app_url, {"model": "math", "messages": _image_message(URL), "max_tokens": 1})
    assert ok.status_code == 200
