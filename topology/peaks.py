"""Dense (non-sparse) peak FLOP/s per device, for MFU.

GPUs: values are NVIDIA's published tensor-core peaks without 2:4 structured sparsity (datasheets
quote the sparse figure, twice these). Sources: NVIDIA's H100, H200, B200 and GB200 NVL72
datasheets (also tabulated in the jax-ml scaling book's GPU chapter); the H100 PCIe, H100 NVL
and H200 NVL figures are half of the sparse numbers on NVIDIA's H100 and H200 product pages.
GB200 is quoted at 2.5 PFLOP/s BF16 per GPU (NVL72 datasheet: 360 PFLOP/s sparse over 72
GPUs); one source gives 2.25, the B200 (HGX) figure.

TPUs (one JAX device is one chip): Google Cloud's TPU v5e, v5p and v6e pages give the peak
compute per chip in bf16: 197, 459 and 918 TFLOP/s (docs.cloud.google.com/tpu/docs/v5e, /v5p,
/v6e). These chips have no fp8 matmul unit (their other figure is int8), so there is no fp8
peak for them. JAX's ``device_kind`` names them "TPU v5 lite" (v5e), "TPU v5" (v5p; "TPU v5p"
under Pathways) and "TPU v6 lite" (v6e); "TPU v5e" and "TPU v6e" are accepted too, as JAX's own
Pallas TPU code accepts them (``jax._src.pallas.mosaic.tpu_info.chip_version_from_device_kind``).

``peak_flops`` returns None for CPUs, devices not listed here, dtypes a device has no peak for,
and dtypes whose peak depends on settings this module cannot see (float32 may run as TF32 or
as true FP32).
"""

from __future__ import annotations

# name -> {dtype family: dense FLOP/s}
_PEAKS: dict[str, dict[str, float]] = {
    "H100 SXM": {"bf16": 989e12, "fp8": 1979e12},
    "H100 PCIe": {"bf16": 756e12, "fp8": 1513e12},
    "H100 NVL": {"bf16": 835e12, "fp8": 1671e12},
    "H200": {"bf16": 989e12, "fp8": 1979e12},
    "H200 NVL": {"bf16": 835e12, "fp8": 1671e12},
    "GH200": {"bf16": 989e12, "fp8": 1979e12},
    "B200": {"bf16": 2250e12, "fp8": 4500e12},
    "GB200": {"bf16": 2500e12, "fp8": 5000e12},
    "TPU v5e": {"bf16": 197e12},
    "TPU v5p": {"bf16": 459e12},
    "TPU v6e": {"bf16": 918e12},
}
# JAX's TPU device_kind (upper-cased, single-spaced) -> the key in the peak table
_TPU_KINDS = {
    "TPU V5 LITE": "TPU v5e",
    "TPU V5E": "TPU v5e",
    "TPU V5": "TPU v5p",
    "TPU V5P": "TPU v5p",
    "TPU V6 LITE": "TPU v6e",
    "TPU V6E": "TPU v6e",
}

_DTYPE_FAMILY = {
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float16": "bf16",
    "fp16": "bf16",
    "half": "bf16",
    "float8": "fp8",
    "fp8": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "float8_e4m3": "fp8",
    "e4m3": "fp8",
    "e5m2": "fp8",
}


def device_model(device_kind: str) -> str | None:
    """The key in the peak table for a ``device_kind`` string, or None if unknown.

    JAX reports the CUDA device name, e.g. "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe",
    "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA GH200 480GB", "NVIDIA B200",
    "NVIDIA GB200". Longer names are tested first: "GB200" contains "B200", "GH200" contains
    "H200". TPU kinds match whole (``_TPU_KINDS``): "TPU v5 lite" is a v5e, "TPU v5" a v5p.
    """
    kind = " ".join(device_kind.upper().replace("-", " ").split())
    if kind in _TPU_KINDS:
        return _TPU_KINDS[kind]
    words = kind.split()
    if "GB200" in kind:
        return "GB200"
    if "B200" in kind:
        return "B200"
    if "GH200" in kind:
        return "GH200"
    if "H200" in kind:
        return "H200 NVL" if "NVL" in words else "H200"
    if "H100" in kind:
        if "PCIE" in words:
            return "H100 PCIe"
        if "NVL" in words:
            return "H100 NVL"
        return "H100 SXM"  # "H100 80GB HBM3", "H100 SXM5 80GB", "H100 SXM", bare "H100"
    return None


def dtype_family(dtype: str) -> str | None:
    """ "bf16" or "fp8" for a matmul dtype name; None where the peak is ambiguous (float32)."""
    return _DTYPE_FAMILY.get(dtype.lower())


def peak_flops(device_kind: str, dtype: str = "bfloat16") -> float | None:
    """Dense peak FLOP/s of one device for matmuls in ``dtype``; None when unknown."""
    model = device_model(device_kind)
    family = dtype_family(dtype)
    if model is None or family is None:
        return None
    return _PEAKS[model].get(family)
