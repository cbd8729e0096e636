"""The telemetry sampler: NVML readings against a fake pynvml, host fallback, never fatal.

The fake is the real ``pynvml`` module with its functions monkeypatched to return recorded
values (real ctypes structs) and raise real ``NVMLError`` subclasses, so field parsing and
error handling run the same code as on a GPU. The ``gpu`` tests read a real GPU.
"""

import json
import sys
import time
from types import SimpleNamespace

import pytest

from moe_train import telemetry
from moe_train.telemetry import nvml as tnvml
from moe_train.telemetry.sampler import NullSampler, Sampler, Target

pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py (the cluster extra) is not installed")

TX_COUNTS = [2**32 - 300, 2**32 - 100, 996]  # KiB, uint32: wraps between the 2nd and 3rd read
TX_STAMPS_US = [10_000_000, 11_000_000, 12_000_000]  # NVML's microsecond timestamps
ENERGY_MJ = [5_000_000, 5_650_000, 6_300_000]  # 650 J per second at 650 W


def _field_values(ids, tx_index):
    arr = (pynvml.c_nvmlFieldValue_t * len(ids))()
    for out, (field_id, scope) in zip(arr, ids):
        assert scope == tnvml.UINT_MAX, "NVLink throughput must be read over all links"
        out.fieldId, out.scopeId = field_id, scope
        if field_id == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX:
            out.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
            out.value.uiVal = TX_COUNTS[tx_index]
            out.timestamp = TX_STAMPS_US[tx_index]
        else:
            out.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
    return arr


@pytest.fixture
def fake_nvml(monkeypatch):
    """pynvml answering like an H200 without a temperature sensor, RX counter or DRAM GPM."""
    calls = {"temp": 0, "fields": 0, "energy": 0, "rx_asked": 0}

    def temperature(handle, sensor):
        calls["temp"] += 1
        raise pynvml.NVMLError_NotSupported()

    def field_values(handle, ids):
        calls["rx_asked"] += sum(f == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX for f, _ in ids)
        calls["fields"] += 1
        return _field_values(ids, min(calls["fields"], len(TX_COUNTS)) - 1)

    def energy(handle):
        calls["energy"] += 1
        return ENERGY_MJ[min(calls["energy"], len(ENERGY_MJ)) - 1]

    def metrics_get(request):
        values = {pynvml.NVML_GPM_METRIC_SM_UTIL: 55.0, pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 33.0}
        for i in range(request.numMetrics):
            m = request.metrics[i]
            if m.metricId in values:
                m.value = values[m.metricId]
            else:
                m.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return request

    patch = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetHandleByIndex": lambda i: f"handle{i}",
        "nvmlDeviceGetName": lambda h: "NVIDIA H200",
        "nvmlDeviceGetUUID": lambda h: "GPU-1234",
        "nvmlDeviceGetArchitecture": lambda h: pynvml.NVML_DEVICE_ARCH_HOPPER,
        "nvmlDeviceGetUtilizationRates": lambda h: pynvml.c_nvmlUtilization_t(gpu=87, memory=41),
        "nvmlDeviceGetMemoryInfo": lambda h: pynvml.c_nvmlMemory_t(
            total=141 * 10**9, free=41 * 10**9, used=100 * 10**9
        ),
        "nvmlDeviceGetPowerUsage": lambda h: 650_000,
        "nvmlDeviceGetTotalEnergyConsumption": energy,
        "nvmlDeviceGetClockInfo": lambda h, clock: 1980,
        "nvmlDeviceGetTemperature": temperature,
        "nvmlDeviceGetPcieThroughput": lambda h, counter: 2_000_000 if counter == 0 else 1_000_000,
        "nvmlDeviceGetFieldValues": field_values,
        "nvmlGpmQueryDeviceSupport": lambda h: SimpleNamespace(isSupportedDevice=1),
        "nvmlGpmSampleAlloc": lambda: pynvml.c_nvmlGpmSample_t(),
        "nvmlGpmSampleGet": lambda h, s: s,
        "nvmlGpmSampleFree": lambda s: None,
        "nvmlGpmMetricsGet": metrics_get,
    }
    for name, fn in patch.items():
        monkeypatch.setattr(pynvml, name, fn)
    return calls


def test_counter_delta_wraps_and_resets():
    assert tnvml.counter_delta(100, 250, 32) == 150
    assert tnvml.counter_delta(2**32 - 100, 996, 32) == 1096  # wrapped once
    assert tnvml.counter_delta(2**64 - 1, 4, 64) == 5
    assert tnvml.counter_delta(10**12, 5, 64) is None  # a reset, not a wrap: size unknown
    assert tnvml.counter_delta(1_000_000_000, 10, 32) is None  # wrapped delta over half the range


def test_field_value_reads_the_union_member_of_its_type():
    fv = pynvml.c_nvmlFieldValue_t()
    fv.valueType, fv.value.ullVal = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, 2**40 + 7
    assert tnvml.field_value(fv) == (2**40 + 7, 64)
    fv.valueType, fv.value.uiVal = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, 12
    assert tnvml.field_value(fv) == (12, 32)
    fv.valueType, fv.value.dVal = pynvml.NVML_VALUE_TYPE_DOUBLE, 1.5
    assert tnvml.field_value(fv) == (1.5, None)


def test_nvml_fields_rates_and_unsupported_once(fake_nvml):
    opened = tnvml.open_gpu(0, nvml=pynvml)
    assert opened.status == "ok" and opened.gpu is not None
    gpu = opened.gpu
    first, new1 = gpu.read(100.0)
    second, new2 = gpu.read(101.0)
    third, new3 = gpu.read(102.0)
    assert first["gpu_util_pct"] == 87 and first["mem_util_pct"] == 41
    assert first["mem_used_bytes"] == 100 * 10**9 and first["mem_total_bytes"] == 141 * 10**9
    assert first["power_w"] == 650.0 and first["sm_clock_mhz"] == 1980
    assert first["pcie_tx_gbps"] == pytest.approx(2_000_000 * 1024 / 1e9)
    assert "nvlink_tx_gbps" not in first and "gpm_sm_active_pct" not in first  # no rate yet
    assert second["nvlink_tx_gbps"] == pytest.approx(200 * 1024 / 1e9)  # 200 KiB in 1 s
    assert third["nvlink_tx_gbps"] == pytest.approx(1096 * 1024 / 1e9)  # across the wrap
    assert (first["energy_j"], second["energy_j"], third["energy_j"]) == (0.0, 650.0, 1300.0)
    assert second["gpm_sm_active_pct"] == 55.0 and second["gpm_tensor_active_pct"] == 33.0
    assert new1 == {
        "temp_c": "NVMLError_NotSupported: Not Supported",
        "nvlink_rx_gbps": "NVMLError_NotSupported: Not Supported",
    }
    assert new2 == {"gpm_dram_bw_pct": "NVMLError_NotSupported: Not Supported"} and new3 == {}
    assert fake_nvml["temp"] == 1 and fake_nvml["rx_asked"] == 1  # never asked again
    gpu.close()


def test_gpm_unsupported_before_hopper(fake_nvml, monkeypatch):
    monkeypatch.setattr(pynvml, "nvmlGpmQueryDeviceSupport", lambda h: SimpleNamespace(isSupportedDevice=0))
    gpu = tnvml.open_gpu(0, nvml=pynvml).gpu
    assert gpu is not None
    values, new = gpu.read(1.0)
    assert set(tnvml.GPM_METRICS) <= set(new) and "Hopper" in new["gpm_sm_active_pct"]
    assert values["gpu_util_pct"] == 87


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _sample_briefly(target, **kw):
    sampler = Sampler(target, **kw).start()
    sampler.set_step(1)
    time.sleep(0.25)
    sampler.set_step(2)
    time.sleep(0.1)
    sampler.set_step(None)
    sampler.stop()
    return sampler, _lines(target.path)


def test_sampler_writes_gpu_lines_and_each_unsupported_field_once(fake_nvml, tmp_path):
    target = Target(
        path=tmp_path / "telemetry" / "rank3.jsonl",
        interval_s=0.05,
        rank=3,
        process_count=4,
        gpu_index=0,
        context={"platform": "gpu"},
    )
    sampler, lines = _sample_briefly(target, nvml=pynvml)
    start, stop = lines[0], lines[-1]
    assert start["kind"] == "start" and start["nvml"] == "ok" and start["rank"] == 3
    assert start["gpu_name"] == "NVIDIA H200" and start["process_count"] == 4
    unsupported = [l["field"] for l in lines if l["kind"] == "unsupported"]
    assert sorted(unsupported) == ["gpm_dram_bw_pct", "nvlink_rx_gbps", "temp_c"]
    samples = [l for l in lines if l["kind"] == "sample"]
    assert len(samples) >= 4 and all(s["gpu_util_pct"] == 87 and "rss_bytes" in s for s in samples)
    assert {s["step"] for s in samples} >= {1, 2}
    marks = [m for s in samples for m in s.get("steps", [])]
    assert [m[0] for m in marks] == [1, 2, None]
    assert stop["kind"] == "stop" and stop["samples"] == len(samples) and sampler.error is None


def _host_target(tmp_path):
    return Target(
        path=tmp_path / "telemetry" / "rank0.jsonl",
        interval_s=0.05,
        rank=0,
        process_count=1,
        gpu_index=None,
        no_gpu_reason="JAX platform is cpu",
        context={"platform": "cpu"},
    )


def test_a_held_sampler_that_is_never_released_writes_nothing(tmp_path):
    sampler = Sampler(_host_target(tmp_path), hold=True).start()
    time.sleep(0.2)
    sampler.stop()
    assert not (tmp_path / "telemetry").exists()


def test_a_released_sampler_writes_what_it_held(tmp_path):
    target = _host_target(tmp_path)
    sampler = Sampler(target, hold=True).start()
    sampler.set_step(1)
    time.sleep(0.2)
    sampler.release()
    sampler.stop()
    lines = _lines(target.path)
    assert lines[0]["kind"] == "start" and [m[0] for l in lines for m in l.get("steps", [])] == [1]


@pytest.mark.parametrize(
    "broken, expected",
    [
        ("init", "unavailable: NVML Shared Library Not Found"),
        ("import", "unavailable: pynvml not importable"),
    ],
)
def test_without_nvml_one_line_says_why_and_the_host_is_sampled(broken, expected, tmp_path, monkeypatch):
    if broken == "init":

        def init():
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

        monkeypatch.setattr(pynvml, "nvmlInit", init)
    else:
        monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    target = Target(path=tmp_path / "rank0.jsonl", interval_s=0.05, rank=0, process_count=1, gpu_index=0)
    _, lines = _sample_briefly(target)
    nvml_lines = [l for l in lines if "nvml" in l]
    assert len(nvml_lines) == 1 and nvml_lines[0]["nvml"].startswith(expected)
    samples = [l for l in lines if l["kind"] == "sample"]
    assert samples and all("rss_bytes" in s and "load1" in s and "gpu_util_pct" not in s for s in samples)


def test_a_process_without_gpu_says_so(fake_nvml, tmp_path):
    target = Target(
        path=tmp_path / "rank0.jsonl",
        interval_s=0.05,
        rank=0,
        process_count=1,
        gpu_index=None,
        no_gpu_reason="JAX platform is cpu",
    )
    _, lines = _sample_briefly(target, nvml=pynvml)
    assert lines[0]["nvml"] == "unused: JAX platform is cpu"


def test_an_error_in_the_thread_is_logged_once_and_ends_sampling(fake_nvml, tmp_path, monkeypatch):
    def broken(handle):
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(pynvml, "nvmlDeviceGetUtilizationRates", broken)
    logged = []
    target = Target(path=tmp_path / "rank0.jsonl", interval_s=0.02, rank=0, process_count=1, gpu_index=0)
    sampler, lines = _sample_briefly(target, nvml=pynvml, log=logged.append)
    assert len(logged) == 1 and "driver exploded" in logged[0]
    assert sampler.error == "RuntimeError: driver exploded"
    assert lines[-1]["kind"] == "error" and not [l for l in lines if l["kind"] == "sample"]


def _device(platform, hw=None, kind="NVIDIA H200"):
    return SimpleNamespace(platform=platform, local_hardware_id=hw, device_kind=kind)


def test_target_maps_the_local_gpu_through_cuda_visible_devices(tmp_path):
    t = telemetry.target_for(
        tmp_path, 1.0, [_device("gpu", 1)], rank=2, process_count=8, env={"CUDA_VISIBLE_DEVICES": "4,5"}
    )
    assert (t.gpu_index, t.path.name, t.context["device_kind"]) == (5, "rank2.jsonl", "NVIDIA H200")
    uuid = telemetry.target_for(
        tmp_path, 1.0, [_device("gpu", 0)], rank=0, process_count=1, env={"CUDA_VISIBLE_DEVICES": "GPU-8e1f"}
    )
    assert uuid.gpu_index is None and "NVML index" in uuid.no_gpu_reason
    cpu = telemetry.target_for(tmp_path, 1.0, [_device("cpu", kind="cpu")], rank=0, process_count=1, env={})
    assert cpu.gpu_index is None and cpu.no_gpu_reason == "JAX platform is cpu"


def test_interval_zero_disables_and_a_failed_start_never_raises(tmp_path, monkeypatch):
    assert isinstance(telemetry.start(tmp_path, 0.0), NullSampler)

    def broken(*args, **kwargs):
        raise OSError("read-only file system")

    monkeypatch.setattr(telemetry, "target_for", broken)
    logged = []
    sampler = telemetry.start(tmp_path, 1.0, log=logged.append)
    sampler.set_step(1)
    sampler.stop()
    assert isinstance(sampler, NullSampler) and "read-only file system" in logged[0]


def test_sample_cost_is_small(tmp_path):
    """Host-only sampling (the CPU case) costs well under a millisecond on an idle thread."""
    from moe_train.telemetry.host import HostProbe

    probe = HostProbe()
    t0 = time.perf_counter()
    for _ in range(200):
        probe.read()
    assert (time.perf_counter() - t0) / 200 < 5e-3


def _real_nvml_gpu():
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        return count > 0
    except pynvml.NVMLError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _real_nvml_gpu(), reason="needs an NVIDIA GPU and driver (NVML)")
def test_real_nvml_reads_a_gpu():
    opened = tnvml.open_gpu(0)
    assert opened.status == "ok" and opened.gpu is not None, opened.status
    gpu = opened.gpu
    try:
        first, unsupported = gpu.read(time.time())
        time.sleep(0.2)
        second, _ = gpu.read(time.time())
    finally:
        gpu.close()
    assert 0 <= first["gpu_util_pct"] <= 100 and first["mem_total_bytes"] > 0
    assert first["power_w"] > 0 and first["sm_clock_mhz"] > 0
    assert all(isinstance(v, (int, float)) for v in second.values())
    assert all(isinstance(e, str) and e for e in unsupported.values())


@pytest.mark.gpu
@pytest.mark.skipif(not _real_nvml_gpu(), reason="needs an NVIDIA GPU and driver (NVML)")
def test_real_nvml_sampler_file(tmp_path):
    target = Target(path=tmp_path / "rank0.jsonl", interval_s=0.1, rank=0, process_count=1, gpu_index=0)
    sampler, lines = _sample_briefly(target)
    assert lines[0]["nvml"] == "ok" and sampler.error is None
    samples = [l for l in lines if l["kind"] == "sample"]
    assert samples and all("gpu_util_pct" in s for s in samples)
