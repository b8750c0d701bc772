"""One lookup from a GPU's name to nblib.budget's device preset (issue 21: "l4" matched inside "L40S")."""
from __future__ import annotations

import pytest

from nblib import budget


@pytest.mark.parametrize("gpu_name, preset", [
    ("NVIDIA L4", "l4"), ("Tesla T4", "t4"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA L40S", None), ("NVIDIA L40", None), ("NVIDIA A100-SXM4-80GB", None), ("NVIDIA A100 80GB PCIe", None),
    ("NVIDIA T400", None), ("NVIDIA RTX A4000", None), ("", None), (None, None),
])
def test_gpu_names_map_to_their_preset_and_no_other(gpu_name, preset):
    assert budget.device_preset_name(gpu_name) == preset


def test_every_preset_named_by_the_lookup_exists_or_is_skipped():
    named = {name for name, _ in budget.devices.GPU_PRESET_PATTERNS}
    gpu_presets = {name for name, device in budget.DEVICES.items() if device.is_gpu}
    assert gpu_presets <= named, gpu_presets - named   # every GPU preset can be found by its name
    for name in named - set(budget.DEVICES):           # a pattern without a preset never answers
        assert budget.device_preset_name(name.upper()) is None
