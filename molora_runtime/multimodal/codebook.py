"""The image codebook: k-means on 2x2 patches of the train split's digits, fit at build time.

17 centroids of 4 grey levels each (integers 0..16, row-major inside the patch) are saved to
`codebook.json` beside this file. `python -m molora_runtime.multimodal.codebook` refits and
rewrites it (seeded: the same file every time); tests check the shipped file matches a refit.
Why a codebook and not one token per pixel: 16 codes per image instead of 64 pixels make a
digit four times shorter, so the adapters train on half-length sequences and `draw` has 16
positions to learn, not 64 (see the README's multimodal section for the measurements).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

CODEBOOK_FILE = Path(__file__).with_name("codebook.json")
NUM_CODES = 17
PATCH = 2
SEED = 0


def fit_codebook() -> list[list[int]]:
    """17 integer 2x2 centroids fit on the train split (blank paper first, then by ink)."""
    import numpy as np
    from sklearn.cluster import KMeans

    from molora_runtime.multimodal.digits import split
    from molora_runtime.multimodal.tokens import patches

    rows = [p for pixels, _ in split("train") for p in patches(pixels)]
    km = KMeans(NUM_CODES, n_init=4, random_state=SEED).fit(np.array(rows, dtype=float))
    centroids = sorted(
        {tuple(int(v) for v in np.clip(np.rint(c), 0, 16)) for c in km.cluster_centers_},
        key=lambda c: (sum(c), c),
    )
    if len(centroids) != NUM_CODES:
        raise RuntimeError("two centroids rounded to the same patch; change the seed")
    return [list(c) for c in centroids]


@lru_cache(maxsize=1)
def codebook() -> tuple[tuple[int, ...], ...]:
    data = json.loads(CODEBOOK_FILE.read_text())
    return tuple(tuple(int(v) for v in c) for c in data["centroids"])


def main() -> None:
    CODEBOOK_FILE.write_text(
        json.dumps({"patch": PATCH, "seed": SEED, "centroids": fit_codebook()}) + "\n"
    )
    print(f"wrote {CODEBOOK_FILE}")


if __name__ == "__main__":
    main()
