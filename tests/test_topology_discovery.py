"""NVLink domain discovery from recorded inputs: NVML fabric info, JAX attributes, Slurm, host."""

import ctypes
import socket
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pynvml
import pytest

from topology import discovery as d
from topology.presets import load

RACK_A = bytes.fromhex("6f1c2a0e9b7d4c3a8e5f1b2c3d4e5f60")  # clusterUuid of one NVL72 rack
RACK_B = bytes.fromhex("0a9b8c7d6e5f40312233445566778899")
ZERO = bytes(16)


def gpu(dev_id, process_index, local_hardware_id=0, **attrs):
    """A recorded GPU jax.Device: id, owner process, CUDA ordinal, optional JAX attributes."""
    return SimpleNamespace(
        id=dev_id, process_index=process_index, platform="gpu", local_hardware_id=local_hardware_id, **attrs
    )


def reader(record):
    """An nvml_reader that answers ``record`` for every GPU index it is asked about."""
    return lambda indices: ([record] * len(indices), [])


def one_gpu_per_process(hosts, gpus_per_host, fabric, env=None):
    """What gather() returns for one process per GPU: hosts[h] answers fabric(h) via NVML."""
    records = []
    for h, host in enumerate(hosts):
        for g in range(gpus_per_host):
            i = h * gpus_per_host + g
            records += d.discover_local(
                [gpu(i, i, g)], hostname=host, env=env or {}, nvml_reader=reader(fabric(h))
            )
    return records


def rec(dev_id, domain, host="h0", source="host", process_index=0, note=""):
    return d.DeviceDomain(dev_id, process_index, host, domain, source, note)


# ---------------------------------------------------------------- NVML


def test_fabric_completed_with_uuid_is_a_domain():
    assert d.fabric_domain(RACK_A, 7, 3) == f"nvml:{RACK_A.hex()}/7"


@pytest.mark.parametrize("state", [0, 1, 2])
def test_fabric_not_completed_gives_no_answer(state):
    assert d.fabric_domain(RACK_A, 7, state) is None


def test_fabric_zero_uuid_gives_no_answer():
    assert d.fabric_domain(ZERO, 0, 3) is None


def test_fabric_failed_registration_gives_no_answer():
    assert d.fabric_domain(RACK_A, 7, 3, status=pynvml.NVML_ERROR_TIMEOUT) is None


def test_reader_library_not_found(monkeypatch):
    def no_library():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)  # an NVMLError_LibraryNotFound

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    records, reasons = d.read_nvml_fabric([0, 1])
    assert records == [None, None]
    assert len(reasons) == 2 and "Library Not Found" in reasons[0]


@pytest.fixture
def fake_nvml(monkeypatch):
    """pynvml with init, shutdown and handles faked; the test sets the fabric call."""
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: f"handle{i}")
    return monkeypatch


# NVMLError_NotSupported and NVMLError_FunctionNotFound (pynvml makes the classes at import)
@pytest.mark.parametrize(
    "error",
    [
        pynvml.nvmlExceptionClass(pynvml.NVML_ERROR_NOT_SUPPORTED),
        pynvml.nvmlExceptionClass(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND),
    ],
)
def test_reader_nvml_error_gives_none_and_reason(fake_nvml, error):
    def fails(handle, info):
        raise error()

    fake_nvml.setattr(pynvml, "nvmlDeviceGetGpuFabricInfoV", fails)
    records, reasons = d.read_nvml_fabric([3])
    assert records == [None]
    assert reasons[0].startswith("nvml: GPU 3: NVMLError_")


def test_reader_missing_function(monkeypatch):
    monkeypatch.delattr(pynvml, "nvmlDeviceGetGpuFabricInfoV")
    records, reasons = d.read_nvml_fabric([0])
    assert records == [None] and "no nvmlDeviceGetGpuFabricInfoV" in reasons[0]


def test_reader_without_pynvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    records, reasons = d.read_nvml_fabric([0])
    assert records == [None] and "pynvml not importable" in reasons[0]


def test_reader_fills_a_versioned_struct_by_reference(fake_nvml):
    seen = []

    def fill(handle, ref):
        info = ref._obj  # the c_nvmlGpuFabricInfoV_t passed by ctypes.byref
        seen.append((handle, info.version))
        ctypes.memmove(info.clusterUuid, RACK_A, 16)
        info.cliqueId, info.state, info.status = 7, 3, 0

    fake_nvml.setattr(pynvml, "nvmlDeviceGetGpuFabricInfoV", fill)
    records, reasons = d.read_nvml_fabric([2])
    assert records == [d.FabricRecord(RACK_A, 7, 3, 0)] and reasons == []
    assert seen == [("handle2", pynvml.nvmlGpuFabricInfo_v2)]


def test_nvml_indices_follow_cuda_visible_devices():
    assert d.nvml_indices([0, 1], "4,6") == [4, 6]
    assert d.nvml_indices([1], None) == [1]
    assert d.nvml_indices([0], "GPU-0b8f2c1e") is None


# ---------------------------------------------------------------- recorded clusters


def test_h100_pair_without_fabric_is_two_host_domains():
    records = one_gpu_per_process(["h100-a", "h100-b"], 8, lambda h: d.FabricRecord(ZERO, 0, 0, 0))
    assert d.domains_of(records) == [list(range(8)), list(range(8, 16))]
    assert {r.source for r in records} == {"host"}
    assert d.check_against(load("h100-dgx"), records) == []


def test_nvl72_full_rack_is_one_domain_of_72():
    records = one_gpu_per_process(
        [f"tray{t:02d}" for t in range(18)], 4, lambda h: d.FabricRecord(RACK_A, 7, 3, 0)
    )
    assert [len(g) for g in d.domains_of(records)] == [72]
    assert {r.source for r in records} == {"nvml"}


def test_nvl72_partial_rack_is_one_domain_of_64_without_warning():
    records = one_gpu_per_process(
        [f"tray{t:02d}" for t in range(16)], 4, lambda h: d.FabricRecord(RACK_A, 7, 3, 0)
    )
    assert [len(g) for g in d.domains_of(records)] == [64]
    assert d.check_against(load("gb200-nvl72"), records) == []


@pytest.mark.parametrize("other", [(RACK_A, 8), (RACK_B, 7)], ids=["clique", "uuid"])
def test_nvl72_job_across_two_racks_warns_once(other):
    uuid, clique = other
    fabric = lambda h: d.FabricRecord(uuid, clique, 3, 0) if h >= 10 else d.FabricRecord(RACK_A, 7, 3, 0)
    records = one_gpu_per_process([f"tray{t:02d}" for t in range(16)], 4, fabric)
    assert [len(g) for g in d.domains_of(records)] == [40, 24]
    warnings = d.check_against(load("gb200-nvl72"), records)
    assert warnings == [
        "gb200-nvl72 job of 16 nodes spans 2 NVLink domains (40+24); "
        "EP groups that cross them run over the network"
    ]


def test_nvl72_with_nvml_broken_on_one_tray_warns_about_mixed_sources():
    fabric = lambda h: None if h == 0 else d.FabricRecord(RACK_A, 7, 3, 0)
    records = one_gpu_per_process([f"tray{t:02d}" for t in range(18)], 4, fabric)
    warnings = d.check_against(load("gb200-nvl72"), records)
    assert any("mixed sources (68 nvml, 4 host)" in w for w in warnings)


def test_domain_bigger_than_preset_warns():
    records = [rec(i, "slurm:s0", host=f"n{i // 8}", source="slurm") for i in range(16)]
    warnings = d.check_against(load("h100-dgx"), records)
    assert warnings == [
        "NVLink domain slurm:s0 has 16 devices, more than h100-dgx's domain_size "
        "8; the cluster preset or the discovery source is wrong"
    ]


def test_devices_per_host_differing_from_preset_warns():
    records = [rec(i, f"host:n{i // 4}", host=f"n{i // 4}") for i in range(8)]
    warnings = d.check_against(load("h100-dgx"), records)
    assert warnings == ["2 of 2 hosts do not have h100-dgx's 8 devices per node: n0 4, n1 4"]


def test_nominal_preset_with_fake_domains_has_no_warning():
    records = d.discover_local(jax.devices(), fake_domains=2)
    assert d.check_against(load("cpu-local"), records) == []


# ---------------------------------------------------------------- JAX, Slurm, host, priority


def test_jax_partition_index():
    assert d.jax_domain(partition_index=2) == "jax:2"


def test_jax_slice_index_older_name():
    assert d.jax_domain(slice_index=1) == "jax:1"


def test_jax_partition_index_wins_over_slice_index():
    assert d.jax_domain(partition_index=0, slice_index=5) == "jax:0"


def test_jax_without_attributes_gives_no_answer():
    assert d.jax_domain(None, None) is None


@pytest.mark.parametrize(
    "addr,pattern,key",
    [
        ("block3.node17", "block.node", "slurm:block3"),
        ("s0.s1.node17", "switch.switch.node", None),  # leaf switches are not NVLink domains
        ("b1.node17.cluster.local", "block.node", "slurm:b1"),
        ("block3.node17", None, None),
        ("node17", "node", None),
        ("block3", "block.node", None),
        (None, None, None),
    ],
)
def test_slurm_address(addr, pattern, key):
    assert d.slurm_domain(addr, pattern) == key


SLURM_ENV = {"SLURM_TOPOLOGY_ADDR": "block3.node17", "SLURM_TOPOLOGY_ADDR_PATTERN": "block.node"}
COMPLETED = reader(d.FabricRecord(RACK_A, 7, 3, 0))
NO_FABRIC = reader(d.FabricRecord(ZERO, 0, 0, 0))


@pytest.mark.parametrize(
    "attrs,nvml,env,source",
    [
        ({"partition_index": 1}, COMPLETED, SLURM_ENV, "nvml"),
        ({"partition_index": 1}, NO_FABRIC, SLURM_ENV, "jax"),
        ({}, NO_FABRIC, SLURM_ENV, "slurm"),
        ({}, NO_FABRIC, {}, "host"),
    ],
    ids=["nvml", "jax", "slurm", "host"],
)
def test_first_source_that_answers_wins(attrs, nvml, env, source):
    [r] = d.discover_local([gpu(0, 0, **attrs)], hostname="n17", env=env, nvml_reader=nvml)
    assert r.source == source
    assert r.domain.startswith(source + ":")


def test_fallback_records_why_nvml_gave_no_answer():
    failing = lambda indices: ([None] * len(indices), ["nvml: init failed: Driver Not Loaded"])
    [r] = d.discover_local([gpu(0, 0)], hostname="n0", env={}, nvml_reader=failing)
    assert (r.domain, r.note) == ("host:n0", "nvml: init failed: Driver Not Loaded")


def test_cpu_devices_skip_nvml():
    def must_not_run(indices):
        raise AssertionError("NVML asked about a CPU device")

    [r] = d.discover_local(
        [SimpleNamespace(id=0, process_index=0, platform="cpu")],
        hostname="laptop",
        env={},
        nvml_reader=must_not_run,
    )
    assert r.domain == "host:laptop"


def test_uuid_cuda_visible_devices_falls_through_to_host():
    [r] = d.discover_local(
        [gpu(0, 0)], hostname="n0", nvml_reader=COMPLETED, env={"CUDA_VISIBLE_DEVICES": "GPU-0b8f2c1e"}
    )
    assert r.source == "host" and "CUDA_VISIBLE_DEVICES" in r.note


def test_discover_local_on_this_process_cpu_devices():
    records = d.discover_local(jax.devices())
    assert [r.device_id for r in records] == [dev.id for dev in jax.devices()]
    assert {(r.source, r.domain) for r in records} == {("host", f"host:{socket.gethostname()}")}


def test_discover_local_with_fake_domains():
    records = d.discover_local(jax.devices(), fake_domains=2)
    assert {r.source for r in records} == {"fake"}
    assert [len(g) for g in d.domains_of(records)] == [4, 4]


# ---------------------------------------------------------------- fake, gather, grouping, text


def test_fake_domain_keys():
    assert d.fake_domain_keys(8, 2) == ["fake:0"] * 4 + ["fake:1"] * 4


@pytest.mark.parametrize("domains", [3, 0])
def test_fake_domain_keys_must_divide(domains):
    with pytest.raises(ValueError, match=f"fake_domains={domains} does not divide the 8 devices"):
        d.fake_domain_keys(8, domains)


def test_gather_one_process_is_identity_sorted():
    local = [rec(1, "host:a"), rec(0, "host:a")]
    assert d.gather(local) == [local[1], local[0]]


def test_encode_decode_round_trip_with_padding():
    records = [
        rec(0, "nvml:ab/7", host="trä-01", source="nvml"),
        rec(9, "host:x", note="nvml: GPU 1: NVMLError_NotSupported: Not Supported"),
    ]
    assert d.decode_records(d.encode_records(records) + b"\0" * 13) == records


def test_gather_pads_to_the_longest_process():
    mine = [rec(3, "host:a", host="a", process_index=1)]
    other = [
        rec(0, "host:long-host-name", host="long-host-name"),
        rec(1, "host:long-host-name", host="long-host-name"),
    ]
    theirs = np.frombuffer(d.encode_records(other), np.uint8)

    def allgather(x):  # process 0 sent ``other``; this is process 1
        if x.dtype == np.int32:
            return np.stack([np.array([theirs.size], np.int32), x])
        return np.stack([np.pad(theirs, (0, x.size - theirs.size)), x])

    assert d.gather(mine, allgather=allgather, process_count=2) == other + mine


def test_domains_of_orders_by_smallest_id():
    records = [rec(5, "b"), rec(3, "a"), rec(1, "b"), rec(4, "a")]
    assert d.domains_of(records) == [[1, 5], [3, 4]]


def test_summary():
    records = [rec(i, f"host:n{i // 8}") for i in range(16)]
    assert d.summary(records) == "16 devices in 2 NVLink domains (8+8) by host"


def test_summary_of_many_domains_and_mixed_sources():
    records = [rec(i, f"host:n{i // 4}") for i in range(64)] + [
        rec(64 + i, "nvml:ab/1", source="nvml") for i in range(4)
    ]
    assert d.summary(records) == "68 devices in 17 NVLink domains (17x4) by nvml+host"
