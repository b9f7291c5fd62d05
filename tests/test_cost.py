"""The cost table's key (eagle_backbone/cost.py): what makes a table apply to a machine, and its file name."""

from pathlib import Path

import torch

import eagle_backbone.runtime as runtime
from eagle_backbone.cost import cost_key, table_path


def test_the_cost_key_tells_cpus_of_one_name_apart_by_what_changes_costs(monkeypatch):
    """Two CPUs sold under one name, one with bf16 matmuls and AVX-512 and one without, get different keys and
    different file names."""
    monkeypatch.setattr("eagle_backbone.cost.processor_name", lambda device: "Same Marketing Name")
    keys = {}
    for kind, flags in (("bf16", {"avx512f", "avx512_bf16", "avx2"}), ("plain", {"avx2"})):
        monkeypatch.setattr(runtime, "cpu_flags", lambda flags=flags: flags)
        keys[kind] = cost_key("m", torch.float32, "cpu", 1)
    assert keys["bf16"]["cpu"] == keys["plain"]["cpu"]
    assert keys["bf16"]["cpu_caps"]["bf16"] and keys["bf16"]["cpu_caps"]["avx512"]
    assert not keys["plain"]["cpu_caps"]["bf16"] and not keys["plain"]["cpu_caps"]["avx512"]
    a, b = table_path("c", keys["bf16"]), table_path("c", keys["plain"])
    assert a != b and "avx512-bf16" in a.name and "bf16" not in b.name
    if Path("/proc/cpuinfo").is_file():
        assert {"cpu_family", "model"} <= set(keys["plain"]["cpu_caps"])
