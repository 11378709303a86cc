"""Dense peak TFLOPS of common accelerators, for MFU when --peak-tflops is not given.

The figures are the vendors' datasheet numbers for dense matrix math (no structured sparsity):
where a datasheet prints only the sparse figure, it is halved. fp32 is plain single precision (what
PyTorch runs by default, matmul TF32 being off); pass dtype 'tf32' when TF32 matmuls are allowed.
AMD's fp32 is the matrix-core figure. None means the device has no such unit, or is not listed.
"""
import re
from typing import Optional

# (pattern on the device name, {dtype: dense peak TFLOPS}). First match wins, so a variant comes
# before its family; `\b` keeps 'A10' from matching 'A100' or 'A10G', and 'H200' from 'GH200'.
_PEAKS = [
    (r"\bGH200\b", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    (r"\bH200 NVL\b", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"\bH200\b", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    (r"\bH100 NVL\b", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"\bH100\b.*\bPCIe\b", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0}),
    (r"\bH100\b.*\b(SXM|HBM3)", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    (r"\bA100\b", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"\bA40\b", {"bf16": 149.7, "fp16": 149.7, "tf32": 74.8, "fp32": 37.4}),
    (r"\bA30\b", {"bf16": 165.0, "fp16": 165.0, "tf32": 82.0, "fp32": 10.3}),
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"\bRTX A6000\b", {"bf16": 154.8, "fp16": 154.8, "tf32": 77.4, "fp32": 38.7}),
    (r"\bL40S\b", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL40\b", {"bf16": 181.05, "fp16": 181.05, "tf32": 90.5, "fp32": 90.5}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    # GeForce: tensor throughput with fp32 accumulation, what PyTorch's GEMMs use.
    (r"\bRTX 4090\b", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    (r"\bRTX 3090\b", {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}),
    # Volta and Turing have no bf16 or tf32 units.
    (r"\bV100S\b", {"fp16": 130.0, "fp32": 16.4}),
    (r"\bV100\b.*\bPCIE\b", {"fp16": 112.0, "fp32": 14.0}),
    (r"\bV100\b.*\bSXM2\b", {"fp16": 125.0, "fp32": 15.7}),
    (r"\bT4\b", {"fp16": 65.0, "fp32": 8.1}),
    (r"\bMI300X\b", {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
    (r"\bMI300A\b", {"bf16": 980.6, "fp16": 980.6, "tf32": 490.3, "fp32": 122.6}),
    (r"\bMI250X\b", {"bf16": 383.0, "fp16": 383.0, "fp32": 95.7}),
    (r"\bMI250\b", {"bf16": 362.1, "fp16": 362.1, "fp32": 90.5}),
]

_DTYPE_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "tf32": "tf32",
}


def peak_tflops_for(device_name: str, dtype: str) -> Optional[float]:
    """Dense peak TFLOPS of one device for `dtype`, or None (CPU, unknown device or dtype)."""
    kind = _DTYPE_ALIASES.get(str(dtype).lower().replace("torch.", ""))
    if kind is None or not device_name:
        return None
    for pattern, peaks in _PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peaks.get(kind)
    return None
