"""Quantized checkpoints that stay packed in memory: GPTQ, AWQ and compressed-tensors
(``checkpoint.QuantizedCheckpoint``), run by ``QuantizedLinear`` over the weight-only quantized
GEMM of ``kernels/quant_linear.py``. MXFP4 and block-wise FP8 checkpoints are dequantized as they
load instead (``engine/models/quantized_weights.py``)."""

from engine.quantization.checkpoint import FORMATS, QuantizedCheckpoint

PACKED_METHODS = tuple(FORMATS)

__all__ = ["PACKED_METHODS", "QuantizedCheckpoint"]
