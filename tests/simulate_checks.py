"""Checks of the simulator against what this machine can measure (test support: tests/test_simulate.py).

`live_vs_rss`: the trace's live-tensor accounting (DeviceTrace on real CPU tensors) against the
RSS growth of the same forward pass in a fresh process (nblib.measure.encoder_peak, glibc's mmap
threshold pinned so freed buffers leave the RSS). `live_vs_memtracker`: the simulated T4's live
peak against torch.distributed._tools.mem_tracker.MemTracker over the same fake-CUDA forward
pass (both in 512 B granules). The allocator model itself is checked rule by rule in the tests.
"""
from __future__ import annotations

from dataclasses import dataclass

from nblib.config import PipelineConfig


@dataclass(frozen=True)
class Agreement:
    """Two figures of one quantity and what each is."""

    what: str
    batch_size: int
    simulated: int
    reference: int
    reference_is: str

    @property
    def ratio(self) -> float:
        return self.simulated / self.reference if self.reference else float("inf")

    def __str__(self) -> str:
        return (f"{self.what} at batch {self.batch_size}: traced {self.simulated / 1e6:,.2f} MB vs "
                f"{self.reference_is} {self.reference / 1e6:,.2f} MB (ratio {self.ratio:.4f}, "
                f"difference {(self.simulated - self.reference) / 1e6:+.2f} MB)")


def live_vs_rss(config: PipelineConfig, batch_size: int, timeout_s: float = 900) -> Agreement:
    """The traced live-bytes increase of a CPU forward pass vs its measured RSS increase."""
    import json
    import subprocess
    import sys

    from nblib.measure import encoder_peak

    measured = encoder_peak(config, batch_size, "cpu", timeout_s=timeout_s)
    payload = json.dumps({"config": config.to_dict(), "batch_size": batch_size})
    proc = subprocess.run([sys.executable, __file__, payload],
                          capture_output=True, text=True, timeout=timeout_s, check=True)
    traced = json.loads(proc.stdout.strip().splitlines()[-1])["delta"]
    return Agreement("forward-pass peak (CPU)", batch_size, traced, measured["rss_delta"],
                     "measured RSS growth")


def live_vs_memtracker(config: PipelineConfig, batch_size: int, precision: str = "fp16") -> Agreement:
    """The simulated T4's peak live tensor bytes vs MemTracker's over the same fake forward pass.

    MemTracker sits inside the trace, so both see the same kernels (attention as a T4 runs it);
    MemTracker sees composite operators' outputs only, the trace their kernels' temporaries too.
    The cuBLAS workspace is left out: no tensor holds it, so MemTracker cannot see it.
    """
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from nblib.budget.trace import DeviceTrace, fake_cuda
    from nblib.trm import TRMVisionEncoder

    m = config.model
    shape = (batch_size, m.image_size, m.image_size, 3)
    peaks = []
    for use_tracker in (False, True):
        encoder = TRMVisionEncoder(m, seed=config.run.seed).eval().set_inference(precision=precision)
        with fake_cuda():
            trace = DeviceTrace()
            tracker = MemTracker()
            with trace:                   # both see the same kernels (attention routed as on a T4)
                device = torch.device("cuda", 0)
                encoder.to(device)
                images = torch.empty(shape, dtype=torch.uint8).to(device)
                if use_tracker:
                    tracker.track_external(encoder, images)
                    with tracker:
                        del encoder.encode(images)["sketches"]
                    peaks.append(sum(tracker.get_tracker_snapshot("peak")[device].get(k, 0)
                                     for k in ("Total",)))
                else:
                    del encoder.encode(images)["sketches"]
                    peaks.append(trace.max_tensor_rounded)
    return Agreement("peak live bytes (fake cuda:0)", batch_size, peaks[0], peaks[1], "MemTracker")


def _traced_cpu_delta(payload: str) -> dict:
    """In a fresh process: the peak live-bytes increase of a second CPU forward pass."""
    import json

    import torch

    from nblib.budget.trace import DeviceTrace
    from nblib.trm import TRMVisionEncoder

    args = json.loads(payload)
    cfg = PipelineConfig.from_dict(args["config"])
    m = cfg.model
    model = TRMVisionEncoder(m, seed=cfg.run.seed).eval()
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (args["batch_size"], m.image_size, m.image_size, 3),
                           dtype=torch.uint8, generator=gen)
    model.encode(images)
    trace = DeviceTrace(device="cpu")
    for t in (*model.parameters(), *model.buffers(), images):    # made outside the trace: allocated now
        trace._record(t, "external")
    before = trace.live
    with trace:
        out = model.encode(images)
    del out
    return {"delta": trace.max_live - before}


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(_traced_cpu_delta(sys.argv[1])))
