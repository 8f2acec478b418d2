"""What the Transformers backend runs, checked before any weight loads: a decoder-only causal LM
whose layers are full or sliding-window attention, calling transformers' ``AttentionInterface``,
with a RoPE that does not depend on the sequence length and an LM head whose logits it knows.
(The attention calls themselves are checked by a probe once the weights are in:
``attention.layer_call``.)

Everything else is refused naming the config field or the layer class, and why.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import textwrap

from torch import nn

from engine.multimodal import MULTIMODAL_FIELDS

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# RoPE types whose frequencies follow each sequence's length: transformers takes one length for
# the whole batch (the longest position), a flat batch of many requests needs one per request.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
# Layers that keep a recurrent state or convolve over past tokens: no paged KV cache holds that.
# (GPT-2's ``Conv1D`` is a linear layer with its weight transposed, not a convolution.)
RECURRENT_CLASS = re.compile(
    r"Mamba|Conv(?!1D$)|LinearAttention|DeltaNet|Rwkv|Recurrent|Ssm|Lstm|Mixer"
)
# How a causal LM's forward takes its base model's output: ``outputs`` or GPT-2's
# ``transformer_outputs``, ``[0]`` or ``.last_hidden_state``, sliced on the way (GPT-J).
OUTPUT_LINE = re.compile(
    r"hidden_states = (slice_logits_to_keep\()?(transformer_)?outputs(\[0\]|\.last_hidden_state)?"
)
# The statements a causal LM's forward may run from its base model's output to its loss, each
# with what it does to the logits: ("scale", c) multiply by the model's (or config's) c,
# ("divide", c) divide by config.c; None: nothing (slicing, the plain LM head).
LOGIT_LINES = {
    "hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)": None,
    "logits = self.lm_head(hidden_states)": None,
    "logits = self.lm_head(hidden_states).contiguous()": None,
    "logits = self.lm_head(hidden_states).float()": None,
    "logits = self.lm_head(hidden_states[:, slice_indices, :])": None,
    "logits = logits * self.logit_scale": ("scale", "logit_scale"),
    "logits = self.lm_head(hidden_states) * self.config.logits_scaling": (
        "scale",
        "logits_scaling",
    ),
    "logits = logits / self.config.logits_scaling": ("divide", "logits_scaling"),
}
# Final soft-capping, cap * tanh(logits / cap) with config.final_logit_softcapping: all four
# statements or none.
SOFTCAP_LINES = (
    "if self.config.final_logit_softcapping is not None:",
    "logits = logits / self.config.final_logit_softcapping",
    "logits = torch.tanh(logits)",
    "logits = logits * self.config.final_logit_softcapping",
)
# Statements that only cast the logits to fp32 first (Beam): pagedq's logits are fp32 sums.
FP32_SPELLINGS = {
    "logits = logits.float() / self.config.final_logit_softcapping": SOFTCAP_LINES[1],
}


def check_config(config) -> None:
    """Refuse a config the backend cannot run, naming the field and its value."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"model_type={model_type!r}: config.is_encoder_decoder=True; pagedq runs "
            "decoder-only causal LMs"
        )
    for name in MULTIMODAL_FIELDS:
        if getattr(config, name, None) is not None:
            raise ValueError(
                f"model_type={model_type!r}: config.{name} is set (a multimodal or "
                "encoder-decoder model); the Transformers backend runs text decoders only"
            )
    if getattr(config, "is_decoder", None) is False and _reads_is_decoder(config):
        raise ValueError(
            f"model_type={model_type!r}: config.is_decoder=False, so transformers runs this "
            "family's attention bidirectionally (an encoder); pagedq runs causal decoders: a "
            "decoder checkpoint says is_decoder: true"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"model_type={model_type!r} has no causal-LM class in transformers "
            "(AutoModelForCausalLM): pagedq runs decoder-only causal LMs"
        )
    for where, params in _rope_settings(config):
        rope_type = params.get("rope_type", params.get("type"))
        if rope_type in LENGTH_DEPENDENT_ROPE:
            raise ValueError(
                f"model_type={model_type!r}: config.{where}.rope_type={rope_type!r} scales "
                "with each sequence's length, which transformers' rotary takes batch-wide; "
                f"the Transformers backend refuses {list(LENGTH_DEPENDENT_ROPE)}"
            )


# A branch on it (not a docstring's example, as GPT-NeoX's has).
_CHOOSES_BY_IS_DECODER = re.compile(r"if (not )?(self\.)?config\.is_decoder")


def _reads_is_decoder(config) -> bool:
    """True when the family's modeling file chooses its mask by ``config.is_decoder`` (BERT's
    descendants: bidirectional unless it is set)."""
    name = type(config).__module__.replace("configuration_", "modeling_")
    if not name.startswith("transformers.models."):  # transformers' own files only
        return False
    try:
        module = importlib.import_module(name)
    except ImportError:
        return False
    return _CHOOSES_BY_IS_DECODER.search(inspect.getsource(module)) is not None


def _rope_settings(config):
    for where in ("rope_parameters", "rope_scaling"):
        params = getattr(config, where, None)
        if not isinstance(params, dict):
            continue
        if all(isinstance(v, dict) for v in params.values()) and params:
            yield from ((f"{where}[{k!r}]", v) for k, v in params.items())
        else:
            yield where, params


def causal_lm_class(config) -> type:
    """transformers' causal-LM class of ``config``."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(config)]


def check_attention_interface(cls: type) -> None:
    """Refuse a causal-LM class whose attention does not go through ``AttentionInterface``
    (checked before building it: Falcon and GPT-Neo look the implementation up in tables of
    their own while they build, and fail on an unknown one)."""
    if not cls._can_set_attn_implementation():
        raise ValueError(
            f"{cls.__name__} does not call transformers' AttentionInterface: the Transformers "
            "backend cannot plug pagedq's paged attention into it"
        )


def check_modules(hf_model: nn.Module) -> None:
    """Refuse a built model whose attention does not go through ``AttentionInterface``, that
    has a recurrent or convolution layer (naming the class), or other layer types than full
    and sliding-window attention (naming them)."""
    check_attention_interface(type(hf_model))
    from transformers import PreTrainedModel

    for name, module in hf_model.named_modules():
        kind = type(module)
        if isinstance(module, PreTrainedModel):  # the model classes, named after the family
            continue
        if isinstance(module, nn.Conv1d) or (
            kind.__module__.startswith("transformers.") and RECURRENT_CLASS.search(kind.__name__)
        ):
            raise ValueError(
                f"{kind.__name__} ({name}) is a recurrent or convolution layer: the "
                "Transformers backend runs attention layers over a paged KV cache only"
            )
    config = hf_model.config
    other = sorted(set(getattr(config, "layer_types", None) or ()) - set(ATTENTION_LAYER_TYPES))
    if other:
        raise ValueError(
            f"model_type={config.model_type!r}: config.layer_types has {other}; the "
            f"Transformers backend runs {list(ATTENTION_LAYER_TYPES)} layers only (no "
            "recurrent, convolution, linear-attention or chunked-attention layers)"
        )


def applies_windows(hf_model: nn.Module) -> bool:
    """True where the family's modeling code knows sliding windows at all: a config may carry
    a ``sliding_window`` its modeling ignores."""
    source = inspect.getsource(sys.modules[type(hf_model).__module__])
    return "sliding" in source


def decoder_layers(base_model: nn.Module, num_layers: int) -> nn.ModuleList:
    """The base model's list of decoder layers (``layers``, ``h``, ``blocks``...; OPT's are
    one level down, ``decoder.layers``)."""
    for modules in (base_model.children(), base_model.modules()):
        for module in modules:
            if isinstance(module, nn.ModuleList) and len(module) == num_layers:
                return module
    raise ValueError(
        f"{type(base_model).__name__} has no list of {num_layers} decoder layers "
        "(config.num_hidden_layers)"
    )


def logits_transform(hf_model: nn.Module) -> tuple[float, float | None]:
    """``(scale, soft_cap)`` the causal LM's forward applies to the LM head's output: logits
    are ``cap * tanh(scale * x / cap)`` (no cap: ``scale * x``). A forward doing anything else
    from its base model's output to its loss is refused, quoting the statement."""
    cls = type(hf_model)
    lines = _forward_lines(cls)
    start = next((i for i, x in enumerate(lines) if OUTPUT_LINE.match(x)), None)
    if start is None or not any(x.startswith("logits = self.lm_head(") for x in lines):
        raise ValueError(f"{cls.__name__}.forward has no LM head over its base model's output")
    scale, seen = 1.0, set()
    for line in lines[start + 1 :]:
        if line.startswith(("loss", "if labels", "return")):
            break
        if line.startswith("slice_indices ="):
            continue
        line = FP32_SPELLINGS.get(line, line)
        seen.add(line)
        if line not in LOGIT_LINES and line not in SOFTCAP_LINES:
            raise ValueError(
                f"{cls.__name__}.forward runs {line!r} around its LM head: pagedq's "
                "Transformers backend does not know that step"
            )
        kind, name = LOGIT_LINES.get(line) or (None, None)
        if kind is not None:
            value = getattr(hf_model, name, None)
            value = float(getattr(hf_model.config, name) if value is None else value)
            scale = scale * value if kind == "scale" else scale / value
    capped = seen.intersection(SOFTCAP_LINES)
    if capped and len(capped) != len(SOFTCAP_LINES):
        raise ValueError(
            f"{cls.__name__}.forward soft-caps its logits in a way pagedq does not know"
        )
    cap = getattr(hf_model.config, "final_logit_softcapping", None) if capped else None
    return scale, None if cap is None else float(cap)


def _forward_lines(cls) -> list[str]:
    """The statements of ``cls.forward``, one per line, comments and blank lines dropped."""
    source = textwrap.dedent(inspect.getsource(cls.forward))
    lines = []
    for raw in source.splitlines():
        line = raw.split("  #", 1)[0].strip()
        if line and not line.startswith("#"):
            lines.append(line)
    return lines
