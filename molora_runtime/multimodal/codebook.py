"""The image codebook: k-means on 2x2 patches of the train split's digits, fit at build time.

17 centroids of 4 grey levels each (integers 0..16, row-major inside the patch) are saved to
`codebook.json` beside this file. `python -m molora_runtime.multimodal.codebook_fit` refits and
rewrites it (seeded: the same file every time); tests check the shipped file matches a refit.
Why a codebook and not one token per pixel: 16 codes per image instead of 64 pixels make a
digit four times shorter, so the adapters train on half-length sequences and `draw` has 16
positions to learn, not 64.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

CODEBOOK_FILE = Path(__file__).with_name("codebook.json")
NUM_CODES = 17
PATCH = 2
SEED = 0


@lru_cache(maxsize=1)
def codebook() -> tuple[tuple[int, ...], ...]:
    data = json.loads(CODEBOOK_FILE.read_text())
    return tuple(tuple(int(v) for v in c) for c in data["centroids"])
