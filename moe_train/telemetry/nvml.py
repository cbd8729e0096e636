"""NVML readings of one GPU for the telemetry sampler (nvidia-ml-py, imported as ``pynvml``).

``open_gpu(index)`` initialises NVML and returns an ``NvmlGpu`` for the GPU with that NVML
index, or the reason there is none (``"unavailable: NVML Shared Library Not Found"``).
``NvmlGpu.read(now)`` returns one sample's values and the fields that just turned out to be
unsupported. A field whose NVML call fails is recorded once with the NVML error and never
asked again; nothing here raises an NVML error to the caller.

Fields (units in the name; absent from a sample when there is no value yet):

* ``gpu_util_pct``, ``mem_util_pct``: ``nvmlDeviceGetUtilizationRates`` (percent of time a
  kernel / a memory transfer ran in the driver's last sample period).
* ``mem_used_bytes``, ``mem_total_bytes``: ``nvmlDeviceGetMemoryInfo``.
* ``power_w``: ``nvmlDeviceGetPowerUsage`` (mW). ``energy_j``: energy since the sampler
  started, from the cumulative ``nvmlDeviceGetTotalEnergyConsumption`` counter (mJ).
* ``sm_clock_mhz``: ``nvmlDeviceGetClockInfo(NVML_CLOCK_SM)``; ``temp_c``: GPU core
  temperature.
* ``nvlink_tx_gbps``, ``nvlink_rx_gbps``: GB/s (1e9 bytes/s) from the cumulative KiB counters
  ``NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX`` read through ``nvmlDeviceGetFieldValues`` with
  ``scopeId = UINT_MAX`` (all links together), turned into rates between samples (the
  deprecated ``nvmlDeviceGetNvLinkUtilizationCounter`` is not used).
* ``pcie_tx_gbps``, ``pcie_rx_gbps``: ``nvmlDeviceGetPcieThroughput`` (KB/s over a 20 ms
  window, taken as KiB/s).
* ``gpm_sm_active_pct``, ``gpm_tensor_active_pct``, ``gpm_dram_bw_pct``: GPM metrics
  (Hopper and newer) between two consecutive ``nvmlGpmSampleGet`` samples.

Counters: a reading lower than the previous one is a wrap of the counter's width (from the
field's value type) when the wrapped difference is under half that range, else a reset
(driver reload); a reset gives no rate for that sample.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

UINT_MAX = 0xFFFFFFFF  # scopeId of the NVLink throughput fields: the sum over all links
KIB = 1024
GB = 1e9
# NVML_VALUE_TYPE_* -> (attribute of c_nvmlValue_t, counter width in bits; None: not a counter)
VALUE_TYPES: dict[int, tuple[str, int | None]] = {
    0: ("dVal", None),
    1: ("uiVal", 32),
    2: ("ulVal", 64),
    3: ("ullVal", 64),
    4: ("sllVal", 63),
    5: ("siVal", 31),
    6: ("usVal", 16),
}
# field name -> pynvml constant name of the GPM metric
GPM_METRICS = {
    "gpm_sm_active_pct": "NVML_GPM_METRIC_SM_UTIL",
    "gpm_tensor_active_pct": "NVML_GPM_METRIC_ANY_TENSOR_UTIL",
    "gpm_dram_bw_pct": "NVML_GPM_METRIC_DRAM_BW_UTIL",
}
NVLINK_FIELDS = {
    "nvlink_tx_gbps": "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX",
    "nvlink_rx_gbps": "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX",
}


@dataclass(frozen=True)
class Unsupported:
    """A field NVML cannot give on this GPU, driver or permission level."""

    error: str  # the NVML error, e.g. "NVMLError_NotSupported: Not Supported"


@dataclass(frozen=True)
class Opened:
    """What ``open_gpu`` found."""

    gpu: NvmlGpu | None  # the GPU to sample; None when NVML or the GPU is unavailable
    status: str  # "ok", or why there is no GPU ("unavailable: ..." / "unused: ...")


def error_text(err: BaseException) -> str:
    """``"NVMLError_NotSupported: Not Supported"``: the error class and NVML's message."""
    return f"{type(err).__name__}: {err}"


def counter_delta(previous: int, current: int, bits: int = 64) -> int | None:
    """Increase of a cumulative counter of ``bits`` bits; None when it was reset.

    A lower reading is a wrap when the wrapped difference is under half the counter's range,
    else a reset (e.g. the driver was reloaded) whose size is unknown.
    """
    if current >= previous:
        return current - previous
    wrapped = current + (1 << bits) - previous
    return wrapped if wrapped < (1 << (bits - 1)) else None


def field_value(value: Any) -> tuple[float | int, int | None]:
    """(number, counter width in bits) of one ``c_nvmlFieldValue_t``."""
    attr, bits = VALUE_TYPES.get(int(value.valueType), ("ullVal", 64))
    return getattr(value.value, attr), bits


def open_gpu(index: int | None, no_gpu_reason: str = "", nvml: Any = None) -> Opened:
    """Initialise NVML and open the GPU with NVML index ``index``; never raises.

    ``index`` None means this process has no GPU (``no_gpu_reason`` says why); NVML is still
    initialised first so that a machine without a driver reports the NVML error instead.
    """
    if nvml is None:
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError as err:
            return Opened(None, f"unavailable: pynvml not importable ({err})")
    try:
        nvml.nvmlInit()
    except Exception as err:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return Opened(None, f"unavailable: {err}")
    if index is None:
        _shutdown(nvml)
        return Opened(None, f"unused: {no_gpu_reason or 'this process has no GPU'}")
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as err:
        _shutdown(nvml)
        return Opened(None, f"unavailable: GPU {index}: {error_text(err)}")
    return Opened(NvmlGpu(nvml, handle, index), "ok")


def _shutdown(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception:
        pass


class NvmlGpu:
    """One GPU's NVML state: handle, counter baselines, fields found unsupported."""

    def __init__(self, nvml: Any, handle: Any, index: int):
        self.nvml, self.handle, self.index = nvml, handle, index
        self.unsupported: dict[str, str] = {}  # field -> NVML error, never asked again
        self._counters: dict[str, tuple[int, float]] = {}  # field -> (last reading, time s)
        self._energy_j = 0.0
        self._gpm: list[Any] | None = None  # [previous sample, current sample]
        self._gpm_primed = False

    def describe(self) -> dict[str, Any]:
        """Name, UUID and memory of the GPU, for the telemetry file's first line."""
        out: dict[str, Any] = {"gpu_index": self.index}
        for key, fn in (
            ("gpu_name", "nvmlDeviceGetName"),
            ("gpu_uuid", "nvmlDeviceGetUUID"),
            ("gpu_architecture", "nvmlDeviceGetArchitecture"),
        ):
            try:
                value = getattr(self.nvml, fn)(self.handle)
                out[key] = value.decode() if isinstance(value, bytes) else value
            except Exception:
                pass
        return out

    def read(self, now: float) -> tuple[dict[str, Any], dict[str, str]]:
        """(values of this sample, fields newly found unsupported -> NVML error)."""
        values: dict[str, Any] = {}
        new: dict[str, str] = {}
        for names, reader in self._readers():
            if all(n in self.unsupported for n in names):
                continue
            try:
                got = reader(now)
            except (self.nvml.NVMLError, AttributeError) as err:  # AttributeError: an older
                got = {n: Unsupported(error_text(err)) for n in names}  # pynvml lacks the call
            for name, value in got.items():
                if name in self.unsupported:
                    continue
                if isinstance(value, Unsupported):
                    self.unsupported[name] = new[name] = value.error
                elif value is not None:
                    values[name] = value
        return values, new

    def close(self) -> None:
        """Free GPM samples and release NVML."""
        for sample in self._gpm or ():
            try:
                self.nvml.nvmlGpmSampleFree(sample)
            except Exception:
                pass
        self._gpm = None
        _shutdown(self.nvml)

    # ------------------------------------------------------------ readers

    def _readers(self) -> list[tuple[tuple[str, ...], Callable[[float], dict[str, Any]]]]:
        n, h = self.nvml, self.handle
        return [
            (("gpu_util_pct", "mem_util_pct"), self._utilization),
            (("mem_used_bytes", "mem_total_bytes"), self._memory),
            (("power_w",), lambda now: {"power_w": n.nvmlDeviceGetPowerUsage(h) / 1e3}),
            (("energy_j",), self._energy),
            (("sm_clock_mhz",), lambda now: {"sm_clock_mhz": n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)}),
            (("temp_c",), lambda now: {"temp_c": n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)}),
            (("pcie_tx_gbps",), lambda now: {"pcie_tx_gbps": self._pcie(n.NVML_PCIE_UTIL_TX_BYTES)}),
            (("pcie_rx_gbps",), lambda now: {"pcie_rx_gbps": self._pcie(n.NVML_PCIE_UTIL_RX_BYTES)}),
            (tuple(NVLINK_FIELDS), self._nvlink),
            (tuple(GPM_METRICS), self._gpm_read),
        ]

    def _utilization(self, now: float) -> dict[str, Any]:
        u = self.nvml.nvmlDeviceGetUtilizationRates(self.handle)
        return {"gpu_util_pct": int(u.gpu), "mem_util_pct": int(u.memory)}

    def _memory(self, now: float) -> dict[str, Any]:
        m = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
        return {"mem_used_bytes": int(m.used), "mem_total_bytes": int(m.total)}

    def _pcie(self, counter: int) -> float:
        return self.nvml.nvmlDeviceGetPcieThroughput(self.handle, counter) * KIB / GB

    def _energy(self, now: float) -> dict[str, Any]:
        """Joules since the first reading (the NVML counter counts mJ since driver load)."""
        raw = int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        previous = self._counters.get("energy_j")
        self._counters["energy_j"] = (raw, now)
        if previous is not None:
            delta = counter_delta(previous[0], raw, 64)
            self._energy_j += (delta or 0) / 1e3
        return {"energy_j": self._energy_j}

    def rate(self, name: str, raw: int, bits: int, t: float, scale: float) -> float | None:
        """``scale`` x counter increase per second since the last reading of ``name``."""
        previous = self._counters.get(name)
        self._counters[name] = (raw, t)
        if previous is None or t <= previous[1]:
            return None
        delta = counter_delta(previous[0], raw, bits)
        return None if delta is None else delta * scale / (t - previous[1])

    def _nvlink(self, now: float) -> dict[str, Any]:
        """NVLink data TX/RX over all links, GB/s; per-field errors mark only that field."""
        n = self.nvml
        wanted = [name for name in NVLINK_FIELDS if name not in self.unsupported]
        ids = [(getattr(n, NVLINK_FIELDS[name]), UINT_MAX) for name in wanted]
        out: dict[str, Any] = {}
        for name, fv in zip(wanted, n.nvmlDeviceGetFieldValues(self.handle, ids)):
            if fv.nvmlReturn != 0:
                out[name] = Unsupported(error_text(n.NVMLError(fv.nvmlReturn)))
                continue
            raw, bits = field_value(fv)
            t = fv.timestamp / 1e6 if fv.timestamp > 0 else now  # NVML's microsecond stamp
            out[name] = self.rate(name, int(raw), bits or 64, t, KIB / GB)
        return out

    def _gpm_read(self, now: float) -> dict[str, Any]:
        """GPM metrics between the previous and this sample (none on the first call)."""
        n = self.nvml
        if self._gpm is None:
            support = n.nvmlGpmQueryDeviceSupport(self.handle)
            if not support.isSupportedDevice:
                return {
                    name: Unsupported("GPM not supported on this GPU (needs Hopper or newer)")
                    for name in GPM_METRICS
                }
            self._gpm = [n.nvmlGpmSampleAlloc(), n.nvmlGpmSampleAlloc()]
        previous, current = self._gpm
        n.nvmlGpmSampleGet(self.handle, current)
        self._gpm = [current, previous]
        if not self._gpm_primed:
            self._gpm_primed = True
            return {}
        wanted = [name for name in GPM_METRICS if name not in self.unsupported]
        request = n.c_nvmlGpmMetricsGet_t()
        request.version = n.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(wanted)
        request.sample1, request.sample2 = previous, current
        for i, name in enumerate(wanted):
            request.metrics[i].metricId = getattr(n, GPM_METRICS[name])
        n.nvmlGpmMetricsGet(request)
        out: dict[str, Any] = {}
        for i, name in enumerate(wanted):
            metric = request.metrics[i]
            out[name] = (
                float(metric.value)
                if metric.nvmlReturn == 0
                else Unsupported(error_text(n.NVMLError(metric.nvmlReturn)))
            )
        return out
