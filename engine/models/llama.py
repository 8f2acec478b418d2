"""One Llama-family model: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm), SmolLM."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, PagedAttention
from engine.models.layers import RMSNorm, RotaryEmbedding
from engine.models.packed_linear import pack, prepack_supported
from kernels import apply_rotary, silu_and_mul

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class LlamaAttention(nn.Module):
    """Self-attention with merged QKV projection, GQA and the paged KV cache."""

    def __init__(self, config, backend: str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, backend)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, backend)
        self.backend = backend
        self.attn = PagedAttention(self.head_dim**-0.5, backend)

    def forward(self, rope, hidden, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """``rope`` is the step's ``(cos, signed_sin)`` from ``RotaryEmbedding.cos_sin``."""
        num_tokens, heads = hidden.shape[0], self.num_heads
        qkv = self.qkv_proj(hidden)
        # q and k sit side by side in qkv: one rotation for both, on a view (no split copies).
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        # In place on qkv where the backend can (the C++ kernel on the CPU).
        qk = apply_rotary(qk, *rope, backend=self.backend)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, -1, self.head_dim)
        out = self.attn(qk[:, :heads], qk[:, heads:], v, kv_cache, meta)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward with merged gate/up projection."""

    def __init__(self, config, backend: str = "auto") -> None:
        super().__init__()
        self.backend = backend
        self.intermediate_size = config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if getattr(gate_up, "fuses_silu_and_mul", False):  # pagedq's GEMM: one pass, same numbers
            return self.down_proj(gate_up.silu_and_mul(x))
        return self.down_proj(silu_and_mul(gate_up(x), backend=self.backend))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals."""

    def __init__(self, config, backend: str) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, backend)
        self.mlp = LlamaMLP(config, backend)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)

    def forward(self, rope, hidden, residual, kv_cache, meta):
        """``(mlp output, residual stream)``: the residual add is fused into the next norm."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """The model over a flat batch of tokens: ``forward`` gives hidden states, then logits."""

    def __init__(self, config, max_position: int, attention_backend: str = "auto") -> None:
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={config.model_type!r} is not supported: must be one of "
                f"{SUPPORTED_MODEL_TYPES}"
            )
        self.config = config
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.rotary = RotaryEmbedding(config, head_dim, max_position)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attention_backend) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, attention_backend)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.packed_lm_head = None

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], meta) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` of one flat batch."""
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary.cos_sin(positions, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(rope, hidden, residual, kv_cache, meta)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 of the rows that need sampling."""
        if self.packed_lm_head is not None:
            return self.packed_lm_head(hidden)
        weight = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def greedy_token_ids(self, hidden: torch.Tensor) -> list[int] | None:
        """``compute_logits(hidden).argmax(-1)`` where the packed LM head can take the argmax in
        its GEMM (no logits written), else None."""
        head = self.packed_lm_head
        if head is None or not head.fuses_argmax(hidden.shape[0]):
            return None
        return head.argmax(hidden).tolist()

    def prepack(self) -> bool:
        """Reorder every projection and the LM head for oneDNN where that is faster (CPU: fp32,
        and bf16, widened to fp32 where this host measured that faster); the packed LM head
        gives fp32 logits.

        Idempotent; call after the weights are loaded and the model is on its device and dtype.
        A tied LM head gets its own packed copy: the embedding still needs the plain table.
        """
        weight = self.embed_tokens.weight
        if self.packed_lm_head is not None or not prepack_supported(weight.device, weight.dtype):
            return self.packed_lm_head is not None
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj, attn.o_proj = pack(attn.qkv_proj), pack(attn.o_proj)
            mlp.gate_up_proj, mlp.down_proj = pack(mlp.gate_up_proj), pack(mlp.down_proj)
        if self.tie_word_embeddings:
            self.packed_lm_head = pack(_Tied(weight), torch.float32)
        else:
            self.lm_head = self.packed_lm_head = pack(self.lm_head, torch.float32)
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face named tensors, merging q/k/v and gate/up into their fused layers."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            target, shard = _fused_target(name)
            if target not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {self.config.model_type}")
            param = params[target]
            if shard is None:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"weight {hf_name!r}: shape {tuple(tensor.shape)}, "
                        f"expected {tuple(param.shape)}"
                    )
                param.data.copy_(tensor)
            else:
                offset, size = self._shard_range(target, shard)
                param.data[offset : offset + size].copy_(tensor)
            loaded.add(f"{target}:{shard}")
        expected = _expected_loads(params)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}")

    def _shard_range(self, target: str, shard: str) -> tuple[int, int]:
        attn = self.layers[0].self_attn
        if "qkv_proj" in target:
            sizes = {"q": attn.q_size, "k": attn.kv_size, "v": attn.kv_size}
            offsets = {"q": 0, "k": attn.q_size, "v": attn.q_size + attn.kv_size}
            return offsets[shard], sizes[shard]
        size = self.layers[0].mlp.intermediate_size
        return (0 if shard == "gate" else size), size


class _Tied:
    """The embedding table seen as a bias-free linear layer (the tied LM head)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.bias = weight, None


_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def _fused_target(name: str) -> tuple[str, str | None]:
    for part, (fused, shard) in _FUSED.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard
    return name, None


def _expected_loads(params: dict[str, nn.Parameter]) -> set[str]:
    out = set()
    for name in params:
        if ".qkv_proj." in name:
            out |= {f"{name}:{s}" for s in "qkv"}
        elif ".gate_up_proj." in name:
            out |= {f"{name}:gate", f"{name}:up"}
        else:
            out.add(f"{name}:None")
    return out
