"""GPU-only code paths, shown on a CPU: each test is one bug that only a GPU run would have met."""
from __future__ import annotations

import pytest
import torch

from nblib import budget
from nblib.budget.preflight import preset_of_this_gpu, ram_already_held, vram_needed
from nblib.config import preset
from nblib.encode.offload import HostPart
from nblib.errors import ConfigError
from nblib.models.weights import weights_sha256
from nblib.sdpa import SDPA_BACKENDS, sdpa_context
from nblib.trm import TRMVisionEncoder


def test_a_compiled_encoder_still_moves_evals_and_fingerprints():
    cfg = preset("smoke")
    enc = TRMVisionEncoder(cfg).eval().set_inference(compile_mode="default", compile_backend="eager")
    images = torch.randint(0, 256, (2, 64, 64, 3), dtype=torch.uint8)
    enc.encode(images)
    assert enc._compiled is not None and "_compiled" not in dict(enc.named_children())
    enc.to("cpu").eval()
    assert set(enc.state_dict()) == set(TRMVisionEncoder(cfg).state_dict())
    assert weights_sha256(enc) == weights_sha256(TRMVisionEncoder(cfg))


def test_preflight_never_charges_the_cuda_context_against_free_vram():
    # mem_get_info() reports free memory after the context exists, initialized before or by it
    assert vram_needed(total_vram=10_000, context_bytes=400) == 9_600


def test_ram_preflight_counts_the_cuda_runtime_only_once_cuda_started():
    assert ram_already_held(gpu_job=True, cuda_initialized=False) == budget.RUNTIME_RAM_CPU
    assert ram_already_held(gpu_job=True, cuda_initialized=True) == budget.RUNTIME_RAM_CUDA
    assert ram_already_held(gpu_job=False, cuda_initialized=False) == budget.RUNTIME_RAM_CPU


def test_the_budget_counts_pinned_part_buffers_rounded_to_a_power_of_two():
    cfg = preset("seed_t4")
    part = cfg.run.checkpoint_every * budget.output_bytes_per_batch(cfg)
    held = {ln.name: ln.bytes for ln in budget.predict_budget(cfg, "t4").lines["ram"]}["outputs held until the part"]
    assert held == 2 ** 32 > part > 2 ** 31              # 3.57 GB of outputs pin 4.29 GB
    cpu = {ln.name: ln.bytes for ln in budget.predict_budget(cfg, "cpu").lines["ram"]}["outputs held until the part"]
    assert cpu == part                                   # unpinned on CPU: no rounding


def test_a_part_is_one_host_block_so_rounding_applies_once():
    host = HostPart({"a": (2, 3), "b": (4,)}, 5, "float16", torch.device("cpu"))
    base = host.host["a"].untyped_storage().data_ptr()
    assert host.host["b"].untyped_storage().data_ptr() == base
    assert host.host["a"].shape == (5, 2, 3) and host.host["b"].shape == (5, 4)


class _UnpinnedHostPart(HostPart):
    def _host_buffer(self, shape, dtype):        # a CPU-only torch cannot pin
        return torch.empty(shape, dtype=dtype)


def test_the_offload_event_is_recorded_on_the_parts_own_device(monkeypatch):
    streams, recorded = [], []

    class Event:
        def record(self, stream=None):
            recorded.append(stream)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: streams.append(device) or f"stream of {device}")
    host = _UnpinnedHostPart({"a": (3,)}, 4, "float32", torch.device("cuda", 1))
    host._copy({"a": torch.ones(2, 3)}, 0)          # the code path add() takes in async mode
    assert streams == [torch.device("cuda", 1)] and recorded == ["stream of cuda:1"]


def test_consolidate_keeps_its_own_copy_of_outputs_a_graph_replay_overwrites():
    host = HostPart({"a": (3,)}, 4, "float32", torch.device("cpu"), mode="consolidate", every=2)
    out = {"a": torch.ones(2, 3)}
    host.add(out, 0)
    out["a"].fill_(7.0)                              # a CUDA-graph replay reuses the output buffer
    host.add({"a": torch.zeros(2, 3)}, 2)
    assert (host.arrays(4)["a"][:2] == 1.0).all()


def test_one_set_of_sdpa_names_for_the_encoder_the_budget_and_the_cli():
    from nblib.budget._checks import checked_sdpa_backend

    for name in SDPA_BACKENDS:
        assert checked_sdpa_backend(name) == name
        TRMVisionEncoder(preset("smoke")).set_inference(sdpa_backend=name)
        with sdpa_context(name):
            pass
    with pytest.raises(ConfigError, match="sm_80"):
        budget.predict_budget(preset("seed_t4"), "t4", sdpa_backend="flash")
    assert budget.predict_budget(preset("seed_t4"), "t4").sdpa_backend == "efficient"
    assert budget.predict_budget(preset("seed_t4"), "h100").sdpa_backend == "flash"


def test_devices_know_h100_and_h200_and_their_bandwidth():
    for name in ("h100", "h200"):
        dev = budget.device_preset(name)
        assert dev.compute_capability == 90 and dev.memory_bandwidth > 3e12 and dev.fp16_flops > 900e12
    assert all(d.memory_bandwidth > 0 for d in budget.DEVICES.values())


def test_preflight_budgets_each_gpu_by_its_own_preset():
    assert preset_of_this_gpu("NVIDIA H100 80GB HBM3") == "h100"
    assert preset_of_this_gpu("NVIDIA L4") == "l4"
    assert preset_of_this_gpu("NVIDIA L40S") == "t4"        # no preset: the smallest GPU's limits
    assert preset_of_this_gpu("Tesla T4") == "t4"


def test_peak_memory_never_starts_cuda_around_cpu_work(monkeypatch):
    from nblib.measure import PeakMemory

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)     # a GPU machine, CUDA not started
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: calls.append("reset"))
    with PeakMemory() as pm:
        sum(range(1000))
    assert calls == [] and pm.cuda_allocated_peak is None


def test_the_cuda_timeline_is_read_from_completed_events_not_the_enqueue_clock(monkeypatch):
    from nblib.encode.offload import BatchClock

    gpu_ms = iter([0.0, 1500.0, 4000.0])       # when the device really reached each event

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at, self.waited = None, False

        def record(self, stream=None):
            self.at = next(gpu_ms)

        def synchronize(self):
            self.waited = True

        def elapsed_time(self, other):
            return other.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    clock = BatchClock(torch.device("cuda", 0))
    clock.mark(8)
    clock.mark(16)                               # both enqueued at once: the clock would say ~0 s
    assert clock.series() == [(1.5, 8), (4.0, 16)]
    assert clock._marks[-1][0].waited


def test_the_cpu_timeline_reads_the_clock_at_each_mark():
    from nblib.encode.offload import BatchClock

    clock = BatchClock(torch.device("cpu"))
    clock.mark(8)
    clock.mark(16)
    (t1, n1), (t2, n2) = clock.series()
    assert 0 <= t1 <= t2 and (n1, n2) == (8, 16)


def test_an_explicit_gpu_under_torchrun_is_refused_when_ranks_share_a_host():
    from nblib.encode.distributed import _rank_device

    assert _rank_device(None, 1, True, local_size=2) == "cuda:1"
    assert _rank_device("cuda", 1, True, local_size=2) == "cuda:1"
    assert _rank_device("cuda:0", 0, True, local_size=1) == "cuda:0"      # one rank per host: its GPU
    with pytest.raises(ConfigError, match="every rank on one GPU"):
        _rank_device("cuda:0", 1, True, local_size=2)
