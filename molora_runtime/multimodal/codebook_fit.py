"""Refit the image codebook: k-means (seeded) on the train split's 2x2 patches, written to codebook.json."""

from __future__ import annotations

import json

import numpy as np
from sklearn.cluster import KMeans

from molora_runtime.multimodal.codebook import CODEBOOK_FILE, NUM_CODES, PATCH, SEED
from molora_runtime.multimodal.digits import split
from molora_runtime.multimodal.tokens import patches


def fit_codebook() -> list[list[int]]:
    """17 integer 2x2 centroids fit on the train split (blank paper first, then by ink)."""
    rows = [p for pixels, _ in split("train") for p in patches(pixels)]
    km = KMeans(NUM_CODES, n_init=4, random_state=SEED).fit(np.array(rows, dtype=float))
    centroids = sorted(
        {tuple(int(v) for v in np.clip(np.rint(c), 0, 16)) for c in km.cluster_centers_},
        key=lambda c: (sum(c), c),
    )
    if len(centroids) != NUM_CODES:
        raise RuntimeError("two centroids rounded to the same patch; change the seed")
    return [list(c) for c in centroids]


def main() -> None:
    CODEBOOK_FILE.write_text(
        json.dumps({"patch": PATCH, "seed": SEED, "centroids": fit_codebook()}) + "\n"
    )
    print(f"wrote {CODEBOOK_FILE}")


if __name__ == "__main__":
    main()
