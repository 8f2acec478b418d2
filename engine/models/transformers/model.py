"""``TransformersForCausalLM``: a Hugging Face causal LM run on pagedq's paged KV cache.

transformers' own model is built for the config (weights allocated, not initialized), its
attention set to ``attn_implementation="pagedq"`` (``attention.py``), and the checkpoint loaded
with pagedq's weight stream. It follows the native ``CausalLM``'s protocol (``forward`` over the
flat batch, ``compute_logits``, cache specs, loading, prepacking), and its module names are the
checkpoint's, so a quantized checkpoint swaps the same linears it would in transformers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from engine.attention import PagedAttention
from engine.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
from engine.models.causal_lm import CausalLM, _Tied
from engine.models.config_fields import layer_sliding_window
from engine.models.linear import linear_fp32_out
from engine.models.packed_linear import pack, prepack_supported
from engine.models.transformers import TRANSFORMERS_BACKEND_TYPES, attention, experts, parallel
from engine.models.transformers.build import build_model, fp32_tensors
from engine.models.transformers.support import (
    applies_windows,
    causal_lm_class,
    check_attention_interface,
    check_config,
    check_modules,
    decoder_layers,
    logits_transform,
)
from engine.models.transformers.weights import load_checkpoint
from engine.parallel.layers import ParallelLMHead
from engine.parallel.state import tp_size

log = logging.getLogger(__name__)
PROBE_TOKENS = 2


class TransformersForCausalLM(nn.Module):
    """transformers' model for ``config`` with pagedq's paged attention; the modules are the
    Hugging Face model's own (``model``, ``lm_head``...), registered under their names."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__()
        check_config(config)
        if config.model_type in TRANSFORMERS_BACKEND_TYPES:
            log.info("model_type=%r runs on the Transformers modeling backend", config.model_type)
        else:
            log.warning(
                "model_type=%r runs on the Transformers modeling backend, unverified: it is not "
                "among the types pagedq's tests hold (`pagedq models`)",
                config.model_type,
            )
        self.config = config
        self.backend = backend
        self.max_position = max_position
        check_attention_interface(causal_lm_class(config))
        hf = build_model(config)
        check_modules(hf)
        if tp_size() > 1:
            parallel.split(hf)
        experts.prepare(hf, backend)
        for name, child in hf.named_children():
            self.add_module(name, child)
        # Held outside the module tree: its children are ours already.
        self.__dict__["hf_model"] = hf
        self.__dict__["base_model"] = getattr(hf, hf.base_model_prefix)
        self.num_layers = len(decoder_layers(self.base_model, config.num_hidden_layers))
        self.logit_scale, self.final_logit_softcapping = logits_transform(hf)
        self.tie_word_embeddings = (
            hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
        )
        self.packed_lm_head = None
        self.uses_prompt_lens = False
        self.layer_calls: list[attention.LayerCall] | None = None
        self.paged: list[PagedAttention] = []
        # Set by the loader from generation_config.json: where generation also stops.
        self.generation_eos_token_ids: frozenset[int] = frozenset()

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], meta) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` (after the final norm) of one flat batch."""
        if self.layer_calls is None:
            self.probe()
        state = attention.Step(kv_caches=kv_caches, meta=meta, layers=self.paged)
        with attention.step(state):
            out = self.base_model(
                input_ids=input_ids[None], position_ids=positions[None], use_cache=False
            )
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def probe(self) -> list[attention.LayerCall]:
        """Run the model once over a few tokens, recording each attention call: every layer
        must call it once, with options the paged kernels run; gives each layer's page shape,
        scale, window, soft cap and sinks."""
        if self.layer_calls is not None:
            return self.layer_calls
        device = self.hf_model.get_input_embeddings().weight.device
        calls: list = []
        ids = torch.zeros(1, PROBE_TOKENS, dtype=torch.long, device=device)
        positions = torch.arange(PROBE_TOKENS, device=device)[None]
        with attention.step(attention.Step(probe=calls)):
            try:
                self.base_model(input_ids=ids, position_ids=positions, use_cache=False)
            except RuntimeError as e:
                if tp_size() == 1:
                    raise
                raise ValueError(
                    f"tensor_parallel_size={tp_size()}: {type(self.hf_model).__name__} fails on "
                    f"this rank's shard ({e}): its modeling code assumes whole heads or features "
                    "where the plan splits them"
                ) from e
        seen = [module.layer_idx for module, *_ in calls]
        if sorted(seen) != list(range(self.num_layers)):
            layers = decoder_layers(self.base_model, self.num_layers)
            silent = sorted(set(range(self.num_layers)) - set(seen))
            if silent:
                layer = layers[silent[0]]
                parts = sorted({type(m).__name__ for m in layer.children()})
                raise ValueError(
                    f"{type(layer).__name__} (layers {silent}) calls no attention (it holds "
                    f"{parts}): the Transformers backend runs attention layers only"
                )
            raise ValueError(
                f"attention layer indices {seen} are not each of 0..{self.num_layers - 1} once: "
                "layers sharing a KV cache are not supported by the Transformers backend"
            )
        by_layer = {call[0].layer_idx: call for call in calls}
        windows = applies_windows(self.hf_model)
        self.layer_calls = [
            attention.layer_call(
                by_layer[i],
                layer_sliding_window(self.config, i, self.max_position) if windows else None,
            )
            for i in range(self.num_layers)
        ]
        if tp_size() > 1:
            parallel.check_heads(self.layer_calls, self.config)
        self.paged = [
            PagedAttention(c.scale, self.backend, c.sliding_window, c.sinks, c.logits_soft_cap)
            for c in self.layer_calls
        ]
        return self.layer_calls

    def kv_cache_specs(self) -> list[FullAttentionSpec]:
        """One spec per layer, in layer order, from the probe's K/V shapes and windows."""
        specs = []
        for call in self.probe():
            if call.sliding_window is None or call.sliding_window >= self.max_position:
                specs.append(FullAttentionSpec(call.num_kv_heads, call.head_dim))
            else:
                specs.append(
                    SlidingWindowSpec(call.num_kv_heads, call.head_dim, call.sliding_window)
                )
        return specs

    def kv_cache_indices(self) -> list[int]:
        """Layer ``i`` uses cache ``i``."""
        return list(range(self.num_layers))

    def move_rotaries(self, device: torch.device) -> None:
        """Nothing to do: the rotary frequencies moved with the model, in fp32 (``_apply``)."""

    def _apply(self, fn, recurse: bool = True):
        """``model.to(...)``, except that what transformers keeps in fp32 (``fp32_tensors``:
        its RoPE frequencies, some families' routers) stays fp32: moved, never rounded."""
        hf = self.__dict__.get("hf_model")
        if hf is None:  # nn.Module's own set-up
            return super()._apply(fn, recurse)
        kept = [(owner, name, t.detach(), always) for owner, name, t, always in fp32_tensors(hf)]
        super()._apply(fn, recurse)
        fp16 = hf.get_input_embeddings().weight.dtype == torch.float16
        for owner, name, saved, always in kept:
            current = getattr(owner, name)
            if current.dtype != saved.dtype and (always or fp16):
                current.data = saved.to(current.device)
        return self

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the rows that need sampling, scaled and soft-capped as the family's
        forward does."""
        if self.packed_lm_head is not None:
            logits = self.packed_lm_head(hidden)
        else:
            head = self.hf_model.get_output_embeddings()
            if isinstance(head, ParallelLMHead):  # this rank's rows: every rank's gathered
                logits = head.logits(hidden)
            else:
                logits = linear_fp32_out(hidden, head.weight, getattr(head, "bias", None))
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def greedy_token_ids(self, hidden: torch.Tensor) -> list[int] | None:
        """The argmax in the packed LM head's GEMM where it can (a positive scale and a soft
        cap keep the order), else None."""
        if self.logit_scale <= 0:
            return None
        return CausalLM.greedy_token_ids(self, hidden)

    def prepack(self) -> bool:
        """Reorder the decoder layers' plain ``nn.Linear`` layers, the experts of the fused
        layout (``experts.prepack``) and the LM head for this host's CPU GEMMs, as
        ``CausalLM.prepack`` does."""
        weight = self.hf_model.get_input_embeddings().weight
        if self.packed_lm_head is not None or not prepack_supported(weight.device, weight.dtype):
            return self.packed_lm_head is not None
        if tp_size() > 1:  # as the native families: packed, a row-parallel layer loses its sum
            return False
        layers = decoder_layers(self.base_model, self.num_layers)
        for module in list(layers.modules()):
            for name, child in list(module.named_children()):
                # Not a linear kept in fp32 (a router): its output dtype is the family's choice.
                if type(child) is nn.Linear and child.weight.dtype == weight.dtype:
                    setattr(module, name, pack(child))
        experts.prepack(self.hf_model)
        head = _Tied(weight) if self.tie_word_embeddings else self.hf_model.get_output_embeddings()
        self.packed_lm_head = pack(head, torch.float32)
        return True

    weight_bytes = CausalLM.weight_bytes

    def checkpoint_name(self, name: str) -> str | None:
        """The model's name for checkpoint tensor ``name`` (given without ``model.``), or
        None to skip it."""
        if "rotary_emb." in name:
            return None
        top = name.split(".", 1)[0]
        if top in self._modules:
            if self.tie_word_embeddings and top == "lm_head":
                return None
            return name
        return f"{self.hf_model.base_model_prefix}.{name}"

    def split_target(self, name: str) -> tuple[str, object]:
        """``(parameter name, shard)``: the Hugging Face modules are not merged, no shards."""
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face named tensors (converted as ``from_pretrained`` would); unknown,
        mis-shaped or missing ones are refused naming the first."""
        load_checkpoint(
            self,
            self.hf_model,
            weights,
            lambda hf_name: self.checkpoint_name(hf_name.removeprefix("model.")),
        )
