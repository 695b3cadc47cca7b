"""The judge: a digit classifier fit on the train split only, to score generated images.

scikit-learn's LogisticRegression on the 64 raw grey levels. It is refit at eval time (lbfgs
on fixed data is deterministic, about a second), so no fitted judge is stored.
"""

from __future__ import annotations

from molora_runtime.multimodal.digits import split


class DigitJudge:
    """Predicts the digit in 64-level images; fit on the train split, never on eval."""

    def __init__(self) -> None:
        from sklearn.linear_model import LogisticRegression  # the optional `train` extra

        train = split("train")
        self.model = LogisticRegression(max_iter=2000)
        self.model.fit([p for p, _ in train], [y for _, y in train])

    def predict(self, images: list[list[int]]) -> list[int]:
        if not images:
            return []
        return [int(v) for v in self.model.predict(images)]

    def accuracy(self, images: list[list[int]], labels: list[int]) -> float:
        got = self.predict(images)
        return sum(int(a == b) for a, b in zip(got, labels, strict=True)) / max(len(labels), 1)
