"""Quantized checkpoints written at test time in the exact on-disk layouts of GPTQModel (AutoGPTQ),
AutoAWQ (GEMM) and llm-compressor (compressed-tensors), each beside a plain fp32 Hugging Face
folder of the very weights the quantized one encodes, as transformers' reference.

Independent of engine/quantization on purpose: a loader bug must not be mirrored here. Layouts
follow AutoGPTQ `qlinear_cuda_old.pack`, AutoAWQ `WQLinear_GEMM.from_linear`, and
compressed-tensors' own compressors and config models (which these writers call)."""

from __future__ import annotations

import copy
import json
import re
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from tiny_models import default_tokenizer
from torch import nn
from torch.overrides import TorchFunctionMode

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # column order_map[i] goes to nibble i of a word
FP8_MAX = 448.0
CT_SCHEMES = ("w4a16", "w8a8-int8", "w8a8-fp8")

# One linear's tensors by suffix ("qweight", ...), and its dequantized fp32 weight.
Quantized = tuple[dict[str, torch.Tensor], torch.Tensor]


def write_gptq(
    model: nn.Module,
    quant_dir: Path,
    ref_dir: Path,
    bits: int = 4,
    group_size: int = 32,
    sym: bool = True,
    desc_act: bool = False,
    checkpoint_format: str = "gptq",
    seed: int = 0,
) -> tuple[Path, Path]:
    """GPTQ: `qweight` int32 [K*bits/32, N], `qzeros` int32 [G, N*bits/32] (zero - 1 in
    "gptq", zero in "gptq_v2"), `scales` fp16 [G, N], `g_idx` int32 [K]; `desc_act` quantizes
    the columns in a random order (act order), as GPTQ does."""
    if bits not in (4, 8) or checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"bits {bits}, format {checkpoint_format!r}: want 4|8, gptq|gptq_v2")

    def quantize(name: str, w: torch.Tensor) -> Quantized:
        # GPTQ orders columns by its Hessian, which only the layer's input decides: the
        # projections that read one input (q/k/v, gate/up) share their order.
        gen = torch.Generator().manual_seed(seed + zlib.crc32(_input_of(name).encode()))
        return _gptq(w, bits, group_size, sym, desc_act, checkpoint_format == "gptq_v2", gen)

    config = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "lm_head": False,
        "checkpoint_format": checkpoint_format,
        "pack_dtype": "int32",
        "true_sequential": True,
        "damp_percent": 0.01,
        "static_groups": False,
        "meta": {"quantizer": ["gptqmodel:2.2.0"]},
    }
    _write(model, quant_dir, ref_dir, quantize, torch.float16, config)
    return Path(quant_dir), Path(ref_dir)


def write_awq(
    model: nn.Module,
    quant_dir: Path,
    ref_dir: Path,
    group_size: int = 32,
    modules_to_not_convert: list[str] | None = None,
) -> tuple[Path, Path]:
    """AutoAWQ GEMM, 4 bits with zero point: `qweight` int32 [K, N/8] and `qzeros` int32
    [G, N/8] packed along the output dim in AWQ's interleaved order, `scales` fp16 [G, N]."""

    def quantize(name: str, w: torch.Tensor) -> Quantized:
        return _awq(w, group_size)

    config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": modules_to_not_convert,
    }
    _write(model, quant_dir, ref_dir, quantize, torch.float16, config)
    return Path(quant_dir), Path(ref_dir)


def write_compressed_tensors(
    model: nn.Module,
    quant_dir: Path,
    ref_dir: Path,
    scheme: str = "w4a16",
    symmetric: bool = True,
    strategy: str | None = None,
    group_size: int = 32,
    dynamic: bool = True,
) -> tuple[Path, Path]:
    """llm-compressor's output for `scheme`, scales in bf16: "w4a16" (pack-quantized, strategy
    "group" or "channel", `symmetric` or not), "w8a8-int8" (int-quantized, channel) or
    "w8a8-fp8" (float-quantized, "channel" or "tensor"). W8A8 activations are dynamic per
    token, or (`dynamic=False`) static per tensor with an `input_scale` calibrated on a batch."""
    from compressed_tensors.compressors.model_compressors.model_compressor import (
        ModelCompressor,
    )
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )

    if scheme not in CT_SCHEMES:
        raise ValueError(f"scheme {scheme!r}: want one of {CT_SCHEMES}")
    strategy = strategy or ("group" if scheme == "w4a16" else "channel")
    allowed = {"w4a16": ("group", "channel"), "w8a8-int8": ("channel",)}.get(
        scheme, ("channel", "tensor")
    )
    if strategy not in allowed or (scheme != "w4a16" and not symmetric):
        raise ValueError(f"{scheme}: strategy {strategy!r} (want {allowed}), symmetric only")
    kind = "float" if scheme == "w8a8-fp8" else "int"
    bits = 4 if scheme == "w4a16" else 8
    weights = QuantizationArgs(
        num_bits=bits,
        type=kind,
        symmetric=symmetric,
        strategy=strategy,
        group_size=group_size if strategy == "group" else None,
    )
    inputs = None
    if scheme != "w4a16":
        inputs = QuantizationArgs(
            num_bits=8, type=kind, strategy="token" if dynamic else "tensor", dynamic=dynamic
        )
    fmt = {"w4a16": "pack-quantized", "w8a8-int8": "int-quantized"}.get(scheme, "float-quantized")
    input_amax = {} if dynamic or inputs is None else _input_amax(model)
    dtype = torch.bfloat16

    def quantize(name: str, w: torch.Tensor) -> Quantized:
        group = group_size if strategy == "group" else w.shape[1]  # fp8 "tensor": unused
        if kind == "float":
            q, scale, deq = _fp8(w, per_row=strategy == "channel", dtype=dtype)
            tensors = {"weight": q, "weight_scale": scale}
        elif bits == 8:
            q, scale, _, deq = _ct_int(w, 8, group, True, dtype)
            tensors = {"weight": q, "weight_scale": scale}
        else:
            q, scale, zp, deq = _ct_int(w, 4, group, symmetric, dtype)
            tensors = {
                "weight_packed": pack_to_int32(q, 4),
                "weight_scale": scale,
                "weight_shape": torch.tensor(w.shape),
            }
            if not symmetric:
                tensors["weight_zero_point"] = pack_to_int32(zp, 4, packed_dim=0)
        if input_amax:
            top = FP8_MAX if kind == "float" else 127.5  # compressed-tensors: amax / (range/2)
            tensors["input_scale"] = torch.tensor([input_amax[name] / top], dtype=dtype)
        return tensors, deq

    def config(ignore: list[str]) -> ModelCompressor:
        group = QuantizationScheme(
            targets=["Linear"], weights=weights, input_activations=inputs, format=fmt
        )
        qc = QuantizationConfig(
            config_groups={"group_0": group},
            format=fmt,
            quantization_status="compressed",
            ignore=["lm_head", *ignore],
        )
        return ModelCompressor(quantization_config=qc)  # writes config.json's entry itself

    _write(model, quant_dir, ref_dir, quantize, dtype, config)
    return Path(quant_dir), Path(ref_dir)


def _input_of(name: str) -> str:
    """A name shared by the projections that read the same input."""
    for part in ("q_proj", "k_proj", "v_proj"):
        name = name.replace(f".{part}", ".qkv")
    for part in ("gate_proj", "up_proj", "w1", "w3"):
        name = name.replace(f".{part}", ".gate_up")
    return name


def _gptq(w, bits, group_size, sym, desc_act, v2, gen) -> Quantized:
    """GPTQ's Quantizer.find_params/quantize per group (min/max including 0), then AutoGPTQ's
    pack: columns packed along K, little end first."""
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    maxq = 2**bits - 1
    perm = torch.randperm(k, generator=gen) if desc_act else torch.arange(k)
    g = _groups(w[:, perm], gs)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    if sym:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    scale = ((hi - lo) / maxq).clamp(min=1e-8).half()
    s = scale.float()
    if sym:
        zero = torch.full_like(s, (maxq + 1) // 2)
    else:  # v1 stores zero - 1: a zero of 0 has no encoding there
        zero = (-lo / s).round().clamp(0 if v2 else 1, maxq)
    q = ((g / s[..., None]).round() + zero[..., None]).clamp(0, maxq)
    deq = ((q - zero[..., None]) * s[..., None]).reshape(n, k)
    inv = torch.argsort(perm)
    q, deq = q.reshape(n, k)[:, inv], deq[:, inv]
    g_idx = (torch.arange(k) // gs)[inv].to(torch.int32)
    tensors = {
        "qweight": _pack(q, bits).T.contiguous(),
        "qzeros": _pack(zero.T - (0 if v2 else 1), bits),
        "scales": scale.T.contiguous(),
        "g_idx": g_idx,
    }
    return tensors, deq


def _awq(w, group_size) -> Quantized:
    """AutoAWQ's pseudo_quantize_tensor (zero point, 4 bits) and WQLinear_GEMM packing."""
    n, k = w.shape
    g = _groups(w, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo).clamp(min=1e-5) / 15).half()
    s = scale.float()
    zero = (-(lo / s).round()).clamp(0, 15)
    q = ((g / s[..., None]).round() + zero[..., None]).clamp(0, 15)
    deq = ((q - zero[..., None]) * s[..., None]).reshape(n, k)

    def pack(x: torch.Tensor) -> torch.Tensor:  # [rows, N] -> [rows, N/8], interleaved
        return _pack(x.reshape(x.shape[0], -1, 8)[..., AWQ_ORDER].reshape(x.shape[0], -1), 4)

    tensors = {"qweight": pack(q.reshape(n, k).T), "qzeros": pack(zero.T), "scales": scale.T}
    return {k: v.contiguous() for k, v in tensors.items()}, deq


def _ct_int(w, bits, group, symmetric, dtype):
    """compressed-tensors' calculate_qparams (min/max including 0) and quantize: signed ints,
    `(q - zero_point) * scale`; scales [N, G] in `dtype`, zero points int8 [N, G]."""
    n, k = w.shape
    g = _groups(w, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    span = qmax - qmin
    scale = torch.maximum(-lo, hi) / (span / 2) if symmetric else (hi - lo) / span
    scale = scale.clamp(min=1e-8).to(dtype)
    s = scale.float()
    zp = torch.zeros_like(s) if symmetric else (qmin - lo / s).round().clamp(qmin, qmax)
    q = (g / s[..., None] + zp[..., None]).round().clamp(qmin, qmax)
    deq = ((q - zp[..., None]) * s[..., None]).reshape(n, k)
    return q.reshape(n, k).to(torch.int8), scale, zp.to(torch.int8), deq


def _fp8(w, per_row: bool, dtype):
    """float8_e4m3fn weights with a bf16 scale per row [N, 1] or per tensor [1]."""
    amax = w.abs().amax(dim=1, keepdim=True) if per_row else w.abs().amax().reshape(1)
    scale = (amax / FP8_MAX).clamp(min=1e-12).to(dtype)
    q = (w / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale, q.float() * scale.float()


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] -> [N, K / group_size, group_size]."""
    if group_size <= 0 or w.shape[1] % group_size:
        raise ValueError(f"group size {group_size} does not divide K = {w.shape[1]}")
    return w.reshape(w.shape[0], -1, group_size)


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned `bits`-bit values along the last dim into int32, element 0 in the low
    bits (GPTQ's and, after AWQ's interleave, AWQ's order)."""
    per = 32 // bits
    q = q.to(torch.int64).reshape(*q.shape[:-1], -1, per)
    words = (q << (torch.arange(per) * bits)).sum(-1)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement of uint32


def _checkpoint_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as `save_pretrained` writes it: hub names, fused experts split into
    per-expert 2-D tensors (transformers' conversion mapping reversed), tied weights out."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = remove_tied_weights_from_state_dict(model.state_dict(), model)  # by shared storage
    return _revert(model, {k: v.detach() for k, v in state.items()})


def _targets(model: nn.Module, state: dict[str, torch.Tensor]) -> tuple[set[str], list[str]]:
    """(linears to quantize, router-like linears left out), by checkpoint module name: every
    2-D weight inside the decoder layers that is an `nn.Linear` or a per-expert slice of fused
    experts; never routers (`mlp.gate`, `shared_expert_gate`)."""
    modules = dict(model.named_modules())
    quantize, left_out = set(), []
    for key, tensor in state.items():
        path = key.removesuffix(".weight")
        if not re.search(r"(^|\.)layers\.\d+\.", path):
            continue
        if tensor.dim() == 3 and ".experts" in key:
            raise ValueError(f"{key}: fused experts with no per-expert checkpoint names")
        if not key.endswith(".weight") or tensor.dim() != 2:
            continue
        leaf = path.rsplit(".", 1)[-1]
        if leaf.endswith("gate") or "router" in leaf:
            left_out.append(path)
        elif isinstance(modules.get(path), nn.Linear) or (
            path not in modules and ".experts." in path
        ):
            quantize.add(path)
    return quantize, left_out


def _input_amax(model: nn.Module, num_tokens: int = 64) -> dict[str, float]:
    """Largest |input| of each decoder linear (per expert too) over a random batch: a static
    min/max observer. Fused experts are seen through the F.linear calls on their slices, in
    transformers' eager experts loop (grouped_mm, its default, hides them)."""
    model = copy.deepcopy(model)
    if model._can_set_experts_implementation():
        model.set_experts_implementation("eager")
    params = dict(model.named_parameters())
    by_storage = {p.untyped_storage().data_ptr(): n for n, p in params.items() if p.dim() >= 2}
    seen: dict[tuple[str, int], float] = {}

    class Observer(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is nn.functional.linear:
                x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
                name = by_storage.get(weight.untyped_storage().data_ptr())
                if name is not None:
                    base = params[name]
                    offset = weight.storage_offset() - base.storage_offset()
                    expert = offset // base.stride(0) if base.dim() == 3 else 0
                    key = (name, expert)
                    seen[key] = max(seen.get(key, 0.0), x.detach().abs().max().item())
            return func(*args, **kwargs)

    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(vocab, (1, num_tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), Observer():
        model(input_ids=ids)
    if not seen:
        raise ValueError(f"{type(model).__name__}: no F.linear call seen to calibrate")
    # Each parameter filled with its observed maxima, then renamed like the checkpoint.
    filled = {}
    for name, p in params.items():
        t = torch.full_like(p, float("nan"))
        for (seen_name, expert), value in seen.items():
            if seen_name == name:
                (t[expert] if p.dim() == 3 else t).fill_(value)
        filled[name] = t.detach()
    fallback = max(seen.values())
    out = {}
    for key, t in _revert(model, filled).items():
        value = t.float().nan_to_num(nan=fallback).max().item()  # an expert never routed
        out[key.removesuffix(".weight")] = value
    return out


def _revert(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` renamed (and fused experts split) as transformers' save_pretrained would."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, state)


def _write(
    model: nn.Module,
    quant_dir: Path,
    ref_dir: Path,
    quantize: Callable[[str, torch.Tensor], Quantized],
    dtype: torch.dtype,
    config: dict | Callable[[list[str]], object],
) -> None:
    """Quantize the target linears; store everything else in `dtype` (the reference holds the
    same rounded values in fp32); write both folders. `config` is the quantization_config, or
    makes a compressed-tensors ModelCompressor from the linears left out (routers)."""
    state = _checkpoint_state_dict(model)
    targets, left_out = _targets(model, state)
    if not targets:
        raise ValueError(f"{type(model).__name__}: no linear inside the decoder layers")
    quant, ref = {}, {}
    for key, tensor in state.items():
        path = key.removesuffix(".weight")
        if key.endswith(".weight") and path in targets:
            n, k = tensor.shape
            if n % 8 or k % 32:
                raise ValueError(f"{path}: [N, K] = [{n}, {k}], want N % 8 == 0, K % 32 == 0")
            tensors, deq = quantize(path, tensor.float())
            quant.update({f"{path}.{suffix}": t for suffix, t in tensors.items()})
            ref[key] = deq
        elif tensor.is_floating_point():
            quant[key] = tensor.to(dtype)
            ref[key] = quant[key].float()
        else:
            quant[key] = ref[key] = tensor
    qconfig = config(left_out) if callable(config) else config
    _save(model, quant_dir, quant, dtype, qconfig)
    _save(model, ref_dir, ref, torch.float32, None)


def _save(model, folder: Path, tensors, dtype, qconfig) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    config.dtype = dtype
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    if isinstance(qconfig, dict):
        path = folder / "config.json"
        data = json.loads(path.read_text())
        data["quantization_config"] = qconfig
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    elif qconfig is not None:
        qconfig.update_config(str(folder))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    default_tokenizer().save_pretrained(folder)
