"""Images through the OpenAI API: image_url parts in, generated images out as PNG data URLs.

In: each chat `image_url` part must be a `data:image/png;base64,` URL (remote URLs are refused,
never fetched). The ingress decodes it here with the strict stdlib PNG reader of
molora_runtime/multimodal/png.py (size from IHDR before any inflating, inflation capped at what
that size needs, every CRC checked) to 8x8 grey levels, writes the part's place in the message
text as IMAGE_SLOT, and sends the levels beside the messages; the engine splices each image's
codes into the templated prompt. Every refusal is an ImageInputError, answered 400 with the
part's path as `param`.

Out: the token ids of each completion are watched for BOI..EOI runs; each closed image becomes
an `image_url` part of `message.images` (or of a chunk's `delta.images` as soon as its EOI
arrives), and the image codes are kept out of the text.
"""

from __future__ import annotations

from deployments.api.message_models import ImageContentPart
from deployments.api.request_models import ChatCompletionRequest
from deployments.api.response_models import ImageOut, ImageURLOut
from molora_runtime.multimodal.png import ImageInputError, data_url_to_levels, levels_to_data_url
from molora_runtime.multimodal.tokens import IMAGE_RANGE, ImageStream, split_images
from molora_runtime.routes import RouteSpec

__all__ = ["ImageInputError", "ImageOutput", "ImagePartError", "request_images", "wants_images"]


class ImagePartError(ImageInputError):
    """An image part the server cannot use, with the JSON path of its URL."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def request_images(body: ChatCompletionRequest) -> list[list[int]] | None:
    """Each image part's 64 grey levels, in message order; None without image parts.

    Raises ImagePartError (a 400) for a non-data URL, bad base64, a non-PNG, a corrupt or
    unsupported PNG, or one past the byte or size limits.
    """
    images: list[list[int]] = []
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            continue
        for j, part in enumerate(message.content):
            if not isinstance(part, ImageContentPart):
                continue
            try:
                images.append(data_url_to_levels(part.image_url.url))
            except ImageInputError as exc:
                raise ImagePartError(str(exc), f"messages.{i}.content.{j}.image_url.url") from None
    return images or None


def route_draws(route: RouteSpec) -> bool:
    """Does this route send (part of) the image-code range to an adapter?"""
    return route.adapts_ids(*IMAGE_RANGE)


def wants_images(body: ChatCompletionRequest, route: RouteSpec) -> bool:
    """Return image codes as images: as asked (`molora.images`), else when the request has
    image parts or its route sends the image-code range to an adapter."""
    if body.molora.images is not None:
        return body.molora.images
    return body.has_images() or route_draws(route)


def _out(levels: list[int]) -> ImageOut:
    return ImageOut(image_url=ImageURLOut(url=levels_to_data_url(levels)))


class ImageOutput:
    """Generated images of a request's choices: all at once, or streamed as each closes."""

    def __init__(self) -> None:
        self.streams: dict[int, ImageStream] = {}

    @staticmethod
    def all(token_ids: list[int]) -> list[ImageOut]:
        return [_out(img) for img in split_images(token_ids)[1]]

    def feed(self, index: int, token_ids: list[int], finished: bool) -> list[ImageOut]:
        stream = self.streams.setdefault(index, ImageStream())
        return [_out(img) for img in stream.feed(token_ids, finished)]
