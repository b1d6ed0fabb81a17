"""Peak dense FLOP/s of common accelerators, for model FLOPs utilisation (MFU) in a site's training report.

Vendor datasheet numbers per GPU, dense (no 2:4 sparsity), tensor cores for bf16, plain fp32 (not TF32: torch
runs fp32 matmuls in full precision by default). A device is matched by a substring of
`torch.cuda.get_device_name`; the first entry that matches wins, so more specific names come first ("A100"
before "A10", "L40S" before "L40" before "L4"). Unknown devices (CPUs included) have no peak and report
throughput only. GPUs without bf16 tensor cores (V100, T4) have no bf16 peak.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PEAK_FLOPS", "PeakFlops", "mfu", "peak_flops"]

TERA = 1e12


@dataclass(frozen=True, kw_only=True, slots=True)
class PeakFlops:
    name: str
    """Substring of the device name that identifies the GPU."""
    bf16: float | None
    fp32: float


PEAK_FLOPS: tuple[PeakFlops, ...] = (
    PeakFlops(name="GH200", bf16=989 * TERA, fp32=67 * TERA),
    PeakFlops(name="H200", bf16=989 * TERA, fp32=67 * TERA),
    PeakFlops(name="H100 PCIe", bf16=756 * TERA, fp32=51 * TERA),
    PeakFlops(name="H100 NVL", bf16=835 * TERA, fp32=60 * TERA),
    PeakFlops(name="H100", bf16=989 * TERA, fp32=67 * TERA),  # SXM
    PeakFlops(name="B200", bf16=2250 * TERA, fp32=75 * TERA),
    PeakFlops(name="A100", bf16=312 * TERA, fp32=19.5 * TERA),
    PeakFlops(name="A10G", bf16=70 * TERA, fp32=31.2 * TERA),
    PeakFlops(name="A30", bf16=165 * TERA, fp32=10.3 * TERA),
    PeakFlops(name="A10", bf16=125 * TERA, fp32=31.2 * TERA),
    PeakFlops(name="L40S", bf16=362 * TERA, fp32=91.6 * TERA),
    PeakFlops(name="L40", bf16=181 * TERA, fp32=90.5 * TERA),
    PeakFlops(name="L4", bf16=121 * TERA, fp32=30.3 * TERA),
    PeakFlops(name="V100", bf16=None, fp32=15.7 * TERA),
    PeakFlops(name="T4", bf16=None, fp32=8.1 * TERA),
)


def peak_flops(device_name: str, *, bf16: bool) -> float | None:
    """Peak dense FLOP/s of one `device_name` GPU for bf16 or fp32 training; None when unknown."""
    for entry in PEAK_FLOPS:
        if entry.name.lower() in device_name.lower():
            return entry.bf16 if bf16 else entry.fp32
    return None


def mfu(
    samples_per_s: float,
    train_flops_per_sample: float,
    *,
    device_name: str,
    devices: int,
    bf16: bool,
) -> float | None:
    """Achieved training FLOP/s over the peak of `devices` GPUs named `device_name`; None when the peak is
    unknown (CPU, an unlisted GPU, bf16 on a GPU without bf16 tensor cores)."""
    if devices < 1 or samples_per_s < 0 or train_flops_per_sample < 0:
        raise ValueError(
            f"devices={devices} must be >= 1, samples_per_s={samples_per_s} and "
            f"train_flops_per_sample={train_flops_per_sample} >= 0"
        )
    peak = peak_flops(device_name, bf16=bf16) if device_name else None
    if peak is None:
        return None
    return samples_per_s * train_flops_per_sample / (peak * devices)
