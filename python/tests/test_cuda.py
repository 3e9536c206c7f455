"""CUDA device memory through the Python package on a machine without a GPU:
``Buffer.from_tensor`` reads a tensor duck-typed (importing kvxfer never imports
torch), CUDA buffers go through ``kvxfer_register_kv_desc``, and a missing driver
library, a failing ``cuInit`` or a driver without devices raise the library's clear
error; nothing crashes and host memory registers as ever. The failing driver is the
test double tests/fakecuda/fakecuda.c, built here with ``cc``: it stands in for the
driver's entry points, and says nothing about GPU behaviour (scripts/gpu-check.sh
does, on a GPU). Each case runs in a child process: the driver path is read from the
environment and a loaded driver stays loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvxfer

ROOT = Path(__file__).resolve().parents[2]


class FakeDevice:
    def __init__(self, kind: str, index: int | None) -> None:
        self.type, self.index = kind, index


class FakeTensor:
    """What Buffer.from_tensor reads of a torch.Tensor."""

    def __init__(self, ptr: int, numel: int, esize: int, device: FakeDevice,
                 contiguous: bool = True) -> None:
        self.ptr, self.n, self.esize, self.device, self.contig = ptr, numel, esize, device, contiguous

    def data_ptr(self) -> int:
        return self.ptr

    def numel(self) -> int:
        return self.n

    def element_size(self) -> int:
        return self.esize

    def is_contiguous(self) -> bool:
        return self.contig


def test_importing_kvxfer_does_not_import_torch():
    r = subprocess.run(
        [sys.executable, "-c", "import sys, kvxfer; print('torch' in sys.modules)"],
        capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


def test_buffer_from_a_cuda_tensor_is_device_memory_of_its_index():
    t = FakeTensor(0x7000_0000, 1024, 2, FakeDevice("cuda", 3))
    b = kvxfer.Buffer.from_tensor(t, item_len=256)
    assert (b.base, b.len, b.item_len) == (0x7000_0000, 2048, 256)
    assert (b.kind, b.device) == (kvxfer.MemoryKind.CUDA, 3)
    assert b.owner is t
    cpu = kvxfer.Buffer.from_tensor(FakeTensor(0x1000, 8, 4, FakeDevice("cpu", None)), 8)
    assert (cpu.kind, cpu.device, cpu.len) == (kvxfer.MemoryKind.HOST, 0, 32)
    with pytest.raises(ValueError, match="contiguous"):
        kvxfer.Buffer.from_tensor(FakeTensor(1, 1, 1, FakeDevice("cuda", 0), False), 1)
    with pytest.raises(TypeError):
        kvxfer.Buffer.from_tensor(object(), 1)


@pytest.fixture(scope="module")
def fakecuda(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("fakecuda") / "libfakecuda.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(out),
                    str(ROOT / "tests/fakecuda/fakecuda.c")], check=True)
    return str(out)


CHILD = textwrap.dedent("""
    import kvxfer, sys
    e = kvxfer.Engine(kvxfer.Config(role="decode"))
    dev = kvxfer.Buffer(0x7000000000, 4096, 1024, None, kvxfer.MemoryKind.CUDA, 0)
    try:
        e.register_kv([dev])
    except kvxfer.KvxferError as err:
        print(err.status.name)
        print(err.message)
    else:
        print("REGISTERED")
    host = bytearray(4096)
    e.register_kv_desc([kvxfer.Buffer.of(host, 1024)])
    print("HOST OK")
""")


def child(env: dict[str, str]) -> list[str]:
    full = {k: v for k, v in os.environ.items()
            if k not in ("KVXFER_CUDA_LIBRARY", "FAKECUDA_INIT_ERROR", "FAKECUDA_DEVICES")}
    full.update(env)
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                       env=full, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def test_a_missing_driver_library_raises_transport_unavailable_naming_it():
    out = child({"KVXFER_CUDA_LIBRARY": "/nonexistent/libcuda-py.so.1"})
    assert out[0] == "TRANSPORT_UNAVAILABLE", out
    assert "/nonexistent/libcuda-py.so.1" in out[1] and "KVXFER_CUDA_LIBRARY" in out[1]
    assert out[-1] == "HOST OK"


def test_a_failing_cu_init_and_no_device_are_named(fakecuda):
    out = child({"KVXFER_CUDA_LIBRARY": fakecuda, "FAKECUDA_INIT_ERROR": "100"})
    assert out[0] == "TRANSPORT_UNAVAILABLE", out
    assert "cuInit" in out[1] and "no CUDA-capable device" in out[1]
    out = child({"KVXFER_CUDA_LIBRARY": fakecuda, "FAKECUDA_DEVICES": "0"})
    assert out[0] == "TRANSPORT_UNAVAILABLE", out
    assert "sees no CUDA device" in out[1]
    # A device, but an address the driver does not know.
    out = child({"KVXFER_CUDA_LIBRARY": fakecuda})
    assert out[0] == "INVALID_ARGUMENT", out
    assert "not memory the CUDA driver knows" in out[1]
    assert out[-1] == "HOST OK"


def test_the_vllm_worker_registers_gpu_kv_caches_as_device_memory(monkeypatch):
    from kvxfer.vllm.worker import ConnectorWorker, LayerBuffer

    monkeypatch.setenv("KVXFER_CUDA_LIBRARY", "/nonexistent/libcuda-vllm.so.1")
    w = ConnectorWorker("decode", {})
    layers = [LayerBuffer(f"model.layers.{i}.self_attn.attn", i, 0x7000_0000 + i * 8192, 8192,
                          1024, device=0) for i in range(2)]
    with pytest.raises(kvxfer.TransportUnavailableError, match="libcuda-vllm"):
        w.register(layers)
    mixed = [layers[0], LayerBuffer("model.layers.1.self_attn.attn", 1, 0x1000, 8192, 1024)]
    with pytest.raises(ValueError, match="GPU memory and some in CPU"):
        ConnectorWorker("decode", {}).register(mixed)


def test_the_vllm_connector_declares_its_kv_cache_access_and_no_sleep_mode():
    pytest.importorskip("vllm", reason="vLLM is not installed here (make test-vllm has it)")
    from kvxfer.vllm.connector import KvxferConnector

    assert KvxferConnector.supports_sleep_mode() is False
    access = KvxferConnector.kv_cache_access()
    assert "cuda" in access.memory and not access.in_forward


def test_the_sglang_backend_takes_kv_data_ptrs_as_device_memory_where_told(monkeypatch):
    from kvxfer.sglang.conn import KV_MEMORY_ENV, _kv_device

    class Args:
        gpu_id = 2

    monkeypatch.setenv(KV_MEMORY_ENV, "host")
    assert _kv_device(Args()) is None
    monkeypatch.setenv(KV_MEMORY_ENV, "cuda")
    if "torch" not in sys.modules:
        assert _kv_device(Args()) == 2
    monkeypatch.setenv(KV_MEMORY_ENV, "auto")
    if "torch" not in sys.modules:
        assert _kv_device(Args()) is None, "no torch, no CUDA: host memory"
    monkeypatch.setenv(KV_MEMORY_ENV, "gpu")
    with pytest.raises(ValueError, match="auto, cuda or host"):
        _kv_device(Args())


@pytest.mark.parametrize("path", ["staging", "ipc"])
@pytest.mark.parametrize("case", ["scattered", "heads", "layers", "abort"])
def test_the_gpu_check_cases_pass_on_the_drivers_test_double(fakecuda, case, path):
    """scripts/gpu/pair.py, the cases of scripts/gpu-check.sh, run here on the driver's
    test double so that the script cannot rot before a GPU runs it, over TCP staging and
    over CUDA IPC (each checks the path its rooms took). Proves the script and the
    engine's device paths, not the GPU."""
    env = dict(os.environ, KVXFER_CUDA_LIBRARY=fakecuda)
    r = subprocess.run([sys.executable, str(ROOT / "scripts/gpu/pair.py"), "--mem", "fake", case,
                        "--path", path], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["case"] == case, result


@pytest.mark.parametrize("case", ["vllm", "sglang"])
def test_the_gpu_check_server_cases_pass_on_the_drivers_test_double(fakecuda, case):
    """scripts/gpu/servers.py: the vLLM worker half and the SGLang backend with KV caches
    in (the test double's) device memory, byte-exact."""
    env = dict(os.environ, KVXFER_CUDA_LIBRARY=fakecuda)
    r = subprocess.run([sys.executable, str(ROOT / "scripts/gpu/servers.py"), "--mem", "fake",
                        case], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["case"] == case, result
