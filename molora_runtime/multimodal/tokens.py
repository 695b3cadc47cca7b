"""Image tokens: 16 codes of a small VQ codebook per image, in a reserved block of the vocabulary.

An 8x8 image with 17 grey levels (scikit-learn's digits: 0 = white paper, 16 = full ink) is cut
into a 4x4 grid of 2x2 patches; each patch becomes the nearest of 17 codebook centroids
(`codebook`: k-means on the train split, fit at build time and shipped as JSON). The image is
then `BOI, 16 code tokens (row-major over the grid), EOI`. The block is ids 49133..49151 of
SmolLM2's 49,152-token vocabulary: the last ids BPE learned, so the rarest merges
(' Identities', ' carbide', ..., 'ectable'); the model almost never emits them for text, so
reusing them costs the text side nothing. Their embedding rows (tied with lm_head) are ordinary
distinct rows (norms 2.6..4.4, mean cosine 0.56 between them), not degenerate.

The layout makes the vocabulary route one range: BOI and the 17 codes ([49133, 49151)) are the
*image* range (served by `draw`), EOI (49151) and every other id are text (served by `read`).
Why EOI counts as text: under a vocab route a position's own input id picks its adapter, so the
adapter of a token is the one that *predicts the next token*. BOI's position predicts the first
code and the codes predict the following code or EOI: the image side's work. EOI's position
predicts the first text token after the image: the text side's work. Whoever reads the prompt
(text) decides to start an image by emitting BOI.
"""

from __future__ import annotations

from collections.abc import Sequence

from molora_runtime.multimodal.codebook import NUM_CODES, PATCH, codebook

SIDE = 8
PIXELS = SIDE * SIDE
LEVELS = 17  # grey levels of a pixel (0 white .. 16 black)
GRID = SIDE // PATCH  # 4x4 patches
CODES_PER_IMAGE = GRID * GRID  # 16
BOI = 49133
CODE0 = BOI + 1  # code c is id CODE0 + c
EOI = CODE0 + NUM_CODES  # 49151, the vocabulary's last id
BLOCK = (BOI, EOI + 1)  # all reserved ids, [start, end)
IMAGE_RANGE = (BOI, EOI)  # the vocab route's image range, [start, end): BOI + codes
MIN_VOCAB = EOI + 1
IMAGE_LEN = CODES_PER_IMAGE + 2  # tokens of one image, BOI..EOI


def patches(pixels: Sequence[int]) -> list[list[int]]:
    """The 16 2x2 patches of an 8x8 image (row-major grid; row-major inside a patch)."""
    return [
        [pixels[(gy * PATCH + dy) * SIDE + gx * PATCH + dx] for dy in range(2) for dx in range(2)]
        for gy in range(GRID)
        for gx in range(GRID)
    ]


def _check(pixels: Sequence[int]) -> list[int]:
    levels = [int(v) for v in pixels]
    if len(levels) != PIXELS:
        raise ValueError(f"an image has {PIXELS} pixels, got {len(levels)}")
    bad = [v for v in levels if not 0 <= v < LEVELS]
    if bad:
        raise ValueError(f"grey levels are 0..{LEVELS - 1}, got {bad[0]}")
    return levels


def encode(pixels: Sequence[int]) -> list[int]:
    """64 grey levels -> 16 codes (nearest centroid, squared distance; ties to the lower code)."""
    book = codebook()

    def nearest(patch: list[int]) -> int:
        dist = [sum((a - b) ** 2 for a, b in zip(patch, c, strict=True)) for c in book]
        return dist.index(min(dist))

    return [nearest(p) for p in patches(_check(pixels))]


def decode(codes: Sequence[int]) -> list[int]:
    """16 codes -> 64 grey levels (each patch its centroid)."""
    book = codebook()
    out = [0] * PIXELS
    for i, c in enumerate(codes):
        gy, gx = divmod(i, GRID)
        for j, v in enumerate(book[c]):
            dy, dx = divmod(j, PATCH)
            out[(gy * PATCH + dy) * SIDE + gx * PATCH + dx] = v
    return out


def quantize(pixels: Sequence[int]) -> list[int]:
    """The image as the codebook sees it (what a round trip through tokens gives back)."""
    return decode(encode(pixels))


def image_to_ids(pixels: Sequence[int]) -> list[int]:
    """64 grey levels (0..16, row-major) -> BOI, 16 code ids, EOI."""
    return [BOI, *(CODE0 + c for c in encode(pixels)), EOI]


def is_code(token: int) -> bool:
    return CODE0 <= token < CODE0 + NUM_CODES


def ids_to_image(ids: Sequence[int]) -> list[int]:
    """A well-formed image's ids (BOI, 16 codes, EOI) -> its 64 grey levels."""
    if len(ids) != IMAGE_LEN or ids[0] != BOI or ids[-1] != EOI:
        raise ValueError(f"an image is BOI, {CODES_PER_IMAGE} code tokens, EOI")
    if not all(is_code(t) for t in ids[1:-1]):
        raise ValueError("an image's inner tokens must all be code tokens")
    return decode([t - CODE0 for t in ids[1:-1]])


def split_images(ids: Sequence[int]) -> tuple[list[int], list[list[int]]]:
    """Split generated ids into text ids and images (64 grey levels each).

    A generated image may be malformed (too few or many codes, no EOI): its codes are kept in
    order, cut or padded with blank paper (code 0) to 16, so a caller always gets an image for
    a BOI. Stray code tokens outside an image are dropped (they are not text either).
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
        elif is_code(t):
            if current is not None:
                current.append(t - CODE0)
        elif current is not None:
            images.append(_fit(current))
            current = None
            text.append(t)
        else:
            text.append(t)
    if current is not None:
        images.append(_fit(current))
    return text, images


def _fit(codes: list[int]) -> list[int]:
    return decode((codes + [0] * CODES_PER_IMAGE)[:CODES_PER_IMAGE])


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
            if not is_code(t):
                return False
        return False
