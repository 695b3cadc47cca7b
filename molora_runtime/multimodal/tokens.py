"""Image tokens: one token per pixel grey level, in a reserved block at the end of the vocabulary.

An 8x8 image with 17 grey levels (scikit-learn's digits: 0 = white paper, 16 = full ink) becomes
`BOI, 64 level tokens (row-major), EOI`. The block is ids 49133..49151 of SmolLM2's 49,152-token
vocabulary: the last ids BPE learned, so the rarest merges (' Identities', ' carbide', ...,
'ectable'); the model almost never emits them for text, so reusing them costs the text side nothing.

The layout makes the vocabulary route one range: BOI and the 17 levels ([49133, 49151)) are the
*image* range (served by `draw`), EOI (49151) and every other id are text (served by `read`).
Why EOI counts as text: under a vocab route a position's own input id picks its adapter, so the
adapter of a token is the one that *predicts the next token*. BOI's position predicts the first
pixel and the pixels predict the following pixel or EOI: the image side's work. EOI's position
predicts the first text token after the image: the text side's work. Whoever reads the prompt
(text) decides to start an image by emitting BOI.
"""

from __future__ import annotations

from collections.abc import Sequence

SIDE = 8
PIXELS = SIDE * SIDE
LEVELS = 17
BOI = 49133
LEVEL0 = BOI + 1  # level v is id LEVEL0 + v
EOI = LEVEL0 + LEVELS  # 49151, the vocabulary's last id
BLOCK = (BOI, EOI + 1)  # all reserved ids, [start, end)
IMAGE_RANGE = (BOI, EOI)  # the vocab route's image range, [start, end): BOI + levels
MIN_VOCAB = EOI + 1


def image_to_ids(pixels: Sequence[int]) -> list[int]:
    """64 grey levels (0..16, row-major) -> BOI, 64 level ids, EOI."""
    levels = [int(v) for v in pixels]
    if len(levels) != PIXELS:
        raise ValueError(f"an image has {PIXELS} pixels, got {len(levels)}")
    bad = [v for v in levels if not 0 <= v < LEVELS]
    if bad:
        raise ValueError(f"grey levels are 0..{LEVELS - 1}, got {bad[0]}")
    return [BOI, *(LEVEL0 + v for v in levels), EOI]


def is_level(token: int) -> bool:
    return LEVEL0 <= token < LEVEL0 + LEVELS


def ids_to_image(ids: Sequence[int]) -> list[int]:
    """The inverse of `image_to_ids` for a well-formed image (BOI, 64 levels, EOI)."""
    if len(ids) != PIXELS + 2 or ids[0] != BOI or ids[-1] != EOI:
        raise ValueError("an image is BOI, 64 level tokens, EOI")
    if not all(is_level(t) for t in ids[1:-1]):
        raise ValueError("an image's inner tokens must all be level tokens")
    return [t - LEVEL0 for t in ids[1:-1]]


def split_images(ids: Sequence[int]) -> tuple[list[int], list[list[int]]]:
    """Split generated ids into text ids and images.

    A generated image may be malformed (too few or many pixels, no EOI): its level tokens are
    kept in order, cut or padded with blank paper to 64, so a caller always gets an image for a
    BOI. Stray level tokens outside an image are dropped (they are not text either).
    """
    text: list[int] = []
    images: list[list[int]] = []
    current: list[int] | None = None
    for t in ids:
        if t == BOI:
            if current is not None:
                images.append(_fit(current))
            current = []
        elif t == EOI:
            if current is not None:
                images.append(_fit(current))
                current = None
        elif is_level(t):
            if current is not None:
                current.append(t - LEVEL0)
        elif current is not None:
            images.append(_fit(current))
            current = None
            text.append(t)
        else:
            text.append(t)
    if current is not None:
        images.append(_fit(current))
    return text, images


def _fit(levels: list[int]) -> list[int]:
    return (levels + [0] * PIXELS)[:PIXELS]


class ImageStream:
    """Images of a streamed completion, each reported once, as soon as it is closed.

    An image is closed by EOI or by any text token after it; at the end of the stream an open
    one is reported as it stands (padded, see `split_images`).
    """

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.sent = 0

    def feed(self, ids: Sequence[int], finished: bool = False) -> list[list[int]]:
        self.ids.extend(ids)
        if not any(t == BOI for t in ids) and not finished and self.sent == self._boi_count():
            return []
        _, images = split_images(self.ids)
        closed = len(images) if finished or not self._open() else len(images) - 1
        new = images[self.sent : closed]
        self.sent = max(self.sent, closed)
        return new

    def _boi_count(self) -> int:
        return sum(t == BOI for t in self.ids)

    def _open(self) -> bool:
        for t in reversed(self.ids):
            if t == BOI:
                return True
            if not is_level(t):
                return False
        return False
