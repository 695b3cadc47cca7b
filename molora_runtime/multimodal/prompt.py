"""Chat prompts with images: the engine-side splice of image tokens into a templated prompt.

A caller (the HTTP ingress, or offline code) writes each image's place in a message's text as
IMAGE_SLOT and passes the images' 64 grey levels beside the messages; the engine renders the
chat template, then tokenizes the text between slots and puts each image's BOI..EOI ids in its
slot. U+FFFC is Unicode's own "object replacement character", so it never means anything else
in a prompt; a slot count that differs from the number of images is refused, so user text that
happens to contain it cannot shift an image.
"""

from __future__ import annotations

from typing import Any

from molora_runtime.multimodal.tokens import BLOCK, MIN_VOCAB, image_to_ids

IMAGE_SLOT = "\ufffc"
HIDDEN_IDS = frozenset(range(*BLOCK))  # image codes never appear in generated text


def encode_with_images(
    tokenizer: Any, text: str, images: list[list[int]], vocab_size: int
) -> list[int]:
    """Token ids of `text` with each IMAGE_SLOT replaced by the next image's tokens."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(
            f"this model's vocabulary ({vocab_size}) has no image-code block (needs {MIN_VOCAB})"
        )
    pieces = text.split(IMAGE_SLOT)
    if len(pieces) - 1 != len(images):
        raise ValueError(
            f"the messages have {len(pieces) - 1} image slots for {len(images)} images"
        )
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
        if i < len(images):
            ids += image_to_ids(images[i])
    return ids
