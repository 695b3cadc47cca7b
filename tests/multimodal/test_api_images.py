"""Images through the OpenAI payloads and the engine: parts in (400-worthy refusals name the
part), codes spliced into the prompt, generated codes out as PNG parts and not as text."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.api.images import (
    ImageOutput,
    ImagePartError,
    request_images,
    route_draws,
    wants_images,
)
from deployments.api.request_models import ChatCompletionRequest
from deployments.api.response_models import ChatCompletionResponse
from molora_runtime.engine.types import GenerationRequest, SamplingParams
from molora_runtime.multimodal import png, tokens
from molora_runtime.multimodal.digits import split
from molora_runtime.multimodal.prompt import IMAGE_SLOT
from molora_runtime.routes import SingleRoute, VocabRange, VocabRoute

PIXELS = split("eval")[0][0]
URL = png.levels_to_data_url(PIXELS)


def _chat(*urls: str, text: str = "Which digit is this? ", **molora) -> ChatCompletionRequest:
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return ChatCompletionRequest.model_validate(
        {"model": "digits", "messages": [{"role": "user", "content": parts}], "molora": molora}
    )


def test_image_parts_become_slots_and_levels() -> None:
    body = _chat(URL)
    assert body.engine_messages()[0]["content"] == "Which digit is this? " + IMAGE_SLOT
    assert request_images(body) == [PIXELS]
    assert wants_images(body, SingleRoute(adapter="read"))
    assert not wants_images(_chat(URL, images=False), SingleRoute(adapter="x"))
    assert request_images(_chat()) is None


def test_a_bad_part_is_named_by_its_path() -> None:
    with pytest.raises(ImagePartError, match="remote URLs are not fetched") as info:
        request_images(_chat(URL, "https://example.com/a.png"))
    assert info.value.param == "messages.0.content.2.image_url.url"


def test_request_bounds() -> None:
    with pytest.raises(ValidationError, match="at most 16 image parts"):
        _chat(*[URL] * 17)
    with pytest.raises(ValidationError, match="U\\+FFFC"):
        _chat(URL, text="two \ufffc slots")
    _chat(text="a lone \ufffc without images is just text")
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
        )


def test_engine_request_checks_images() -> None:
    GenerationRequest(
        request_id="a", messages=[{"role": "user", "content": IMAGE_SLOT}], images=[PIXELS]
    )
    with pytest.raises(ValidationError, match="64 grey levels"):
        GenerationRequest(request_id="a", messages=[{"role": "user", "content": "x"}], images=[[0]])
    with pytest.raises(ValidationError, match="go with messages"):
        GenerationRequest(request_id="a", prompt="x", images=[PIXELS])


def test_generated_images_come_back_as_png_parts_streamed_once() -> None:
    ids = [11, *tokens.image_to_ids(PIXELS), 12]
    [out] = ImageOutput.all(ids)
    assert png.data_url_to_levels(out.image_url.url) == tokens.quantize(PIXELS)
    stream = ImageOutput()
    got = [stream.feed(0, ids[i : i + 7], False) for i in range(0, len(ids), 7)]
    assert sum(len(g) for g in got) == 1 and stream.feed(0, [], True) == []
    assert stream.feed(1, [tokens.BOI], False) == []  # choices stream apart
    assert len(stream.feed(1, [], True)) == 1
    message = {"content": "hi", "images": [out.model_dump()]}
    response = ChatCompletionResponse.model_validate(
        {"id": "x", "model": "m", "choices": [{"message": message}]}
    )
    dumped = response.model_dump(exclude_none=True)["choices"][0]["message"]
    assert dumped["images"][0]["type"] == "image_url"


def test_vocab_routes_over_the_image_block_draw() -> None:
    draw = VocabRoute(
        ranges=[VocabRange(start=tokens.BOI, end=tokens.EOI, adapter="draw")], default="read"
    )
    assert route_draws(draw)
    base_range = VocabRoute(ranges=[VocabRange(start=tokens.BOI, end=tokens.EOI, adapter=None)])
    assert not route_draws(base_range) and not route_draws(SingleRoute(adapter="draw"))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from molora_runtime.model.model_paths import ModelNotFoundError, resolve_model_path

    try:
        resolve_model_path("smollm2-135m-instruct")  # the tokenizer of the tiny model
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    from molora_runtime.config import EngineConfig
    from molora_runtime.engine.engine import LLMEngine
    from molora_runtime.lora.source import DirectorySource
    from molora_runtime.model.tiny import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("tiny-mm"), seed=3, with_tokenizer=True)
    config = EngineConfig(
        model=str(model), dtype="float32", device="cpu", enable_cuda_graph=False, max_model_len=256
    )
    return LLMEngine(config, DirectorySource({}, {}))


def _request(rid: str, content: str, images=None, **kw) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid, messages=[{"role": "user", "content": content}], images=images, **kw
    )


def test_engine_splices_image_codes_into_the_templated_prompt(engine) -> None:
    from molora_runtime.errors import InvalidRequestError

    ids = engine.encode_prompt(_request("a", f"look {IMAGE_SLOT} here", [PIXELS]))
    start = ids.index(tokens.BOI)
    assert ids[start : start + tokens.IMAGE_LEN] == tokens.image_to_ids(PIXELS)
    text = engine.encode_prompt(_request("b", "look  here"))
    assert len(ids) == len(text) + tokens.IMAGE_LEN
    with pytest.raises(InvalidRequestError, match="2 image slots for 1 images"):
        engine.encode_prompt(_request("c", IMAGE_SLOT * 2, [PIXELS]))


def _run(engine, req: GenerationRequest) -> tuple[str, list[int]]:
    engine.add_request(req, engine.validate_request(req))
    text, ids = "", []
    while engine.has_work():
        for out in engine.step():
            text += out.text_delta
            ids += out.new_token_ids
    return text, ids


def test_image_output_keeps_codes_out_of_the_text(engine) -> None:
    forced = SamplingParams(max_tokens=6, logit_bias={tokens.CODE0 + 4: 100.0})
    text, ids = _run(engine, _request("d", "draw", sampling=forced, image_output=True))
    assert ids == [tokens.CODE0 + 4] * 6 and text == ""
    plain, same = _run(engine, _request("e", "draw", sampling=forced))
    assert same == ids and plain.strip()  # the codes' own BPE text, when not asked for images
