"""The peak-FLOP/s table: specific names before their prefixes, unknown devices report no MFU."""

from __future__ import annotations

import pytest

from hydrafl.kernels.peak_flops import mfu, peak_flops


@pytest.mark.parametrize(
    ("device_name", "bf16", "fp32"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12, 67e12),
        ("NVIDIA H100 PCIe", 756e12, 51e12),
        ("NVIDIA H200", 989e12, 67e12),
        ("NVIDIA A100-SXM4-80GB", 312e12, 19.5e12),
        ("NVIDIA A10G", 70e12, 31.2e12),
        ("NVIDIA A10", 125e12, 31.2e12),
        ("NVIDIA L40S", 362e12, 91.6e12),
        ("NVIDIA L4", 121e12, 30.3e12),
        ("Tesla V100-SXM2-16GB", None, 15.7e12),
        ("Tesla T4", None, 8.1e12),
    ],
)
def test_known_gpus_match_their_own_entry(
    device_name: str, bf16: float | None, fp32: float
) -> None:
    assert peak_flops(device_name, bf16=True) == (pytest.approx(bf16) if bf16 else None)
    assert peak_flops(device_name, bf16=False) == pytest.approx(fp32)


def test_mfu_is_achieved_over_peak_of_all_devices() -> None:
    # 1000 samples/s x 3e9 training FLOPs each = 3e12 FLOP/s over 2 x 312e12 bf16 peak
    assert mfu(
        1000.0, 3e9, device_name="NVIDIA A100-SXM4-40GB", devices=2, bf16=True
    ) == pytest.approx(3e12 / 624e12)
    assert mfu(1000.0, 3e9, device_name="", devices=1, bf16=False) is None  # CPU
    assert mfu(1000.0, 3e9, device_name="Some Future GPU", devices=1, bf16=False) is None
    assert (
        mfu(1000.0, 3e9, device_name="Tesla T4", devices=1, bf16=True) is None
    )  # no bf16 tensor cores
    with pytest.raises(ValueError, match="devices=0"):
        mfu(1.0, 1.0, device_name="NVIDIA L4", devices=0, bf16=False)
