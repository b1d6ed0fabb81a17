"""Small real DICOM files for the tests, written with pydicom: greyscale or RGB, rescaled or not, single or
multi-frame, with or without pixel data, and folders of labelled studies around them."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid


def write_dicom(
    path: Path,
    pixels: np.ndarray | None,
    *,
    photometric: str = "MONOCHROME2",
    rescale: tuple[float, float] | None = None,
) -> Path:
    """`pixels` (uint16 [rows, cols] or [frames, rows, cols], or uint8 [rows, cols, 3] for RGB) as a DICOM
    Part 10 file in Explicit VR Little Endian; None writes a file without pixel data, as a structured report."""
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    dataset = Dataset()
    dataset.file_meta = meta
    dataset.SOPClassUID, dataset.SOPInstanceUID = (
        meta.MediaStorageSOPClassUID,
        meta.MediaStorageSOPInstanceUID,
    )
    dataset.Modality = "CR" if pixels is not None else "SR"
    if pixels is not None:
        colour = photometric == "RGB"
        dataset.SamplesPerPixel = 3 if colour else 1
        dataset.PhotometricInterpretation = photometric
        if colour:
            dataset.PlanarConfiguration = 0
        dataset.BitsAllocated = dataset.BitsStored = 8 if colour else 16
        dataset.HighBit = dataset.BitsStored - 1
        dataset.PixelRepresentation = 0
        frames = pixels.shape[0] if pixels.ndim == 3 and not colour else 1
        if frames > 1:
            dataset.NumberOfFrames = frames
        dataset.Rows, dataset.Columns = pixels.shape[-3:-1] if colour else pixels.shape[-2:]
        dataset.PixelData = pixels.astype(np.uint8 if colour else "<u2").tobytes()
        if rescale is not None:
            dataset.RescaleSlope, dataset.RescaleIntercept = rescale
    path.parent.mkdir(parents=True, exist_ok=True)
    dataset.save_as(path, enforce_file_format=True)
    return path


def write_labels(
    folder: Path, rows: list[tuple[str, ...]], header: tuple[str, ...] = ("file", "label")
) -> Path:
    """`labels.csv` in `folder`: the header, then one line per row."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "labels.csv").open("w", newline="") as handle:
        csv.writer(handle).writerows([header, *rows])
    return folder / "labels.csv"


def pattern_folder(folder: Path, per_class: int, seed: int = 0, rare: int = 0) -> Path:
    """Two classes any image model can tell apart: a bright left half ("left") or right half ("right"), under
    noise, at mixed sizes (so the loader must resize) and with one class in MONOCHROME1 half the time; `rare`
    more studies of a third class ("rare", bright on the right) make a small cell."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(2 * per_class + rare):
        label = ("left", "right")[k % 2] if k < 2 * per_class else "rare"
        height, width = (48, 40) if k % 3 else (32, 32)
        image = rng.normal(1000.0, 150.0, size=(height, width))
        half = slice(0, width // 2) if label == "left" else slice(width // 2, width)
        image[:, half] += 1500.0
        photometric = "MONOCHROME1" if k % 4 == 1 else "MONOCHROME2"
        if photometric == "MONOCHROME1":
            image = 4095.0 - image  # stored inverted: the loader turns it back
        name = f"{label}/{k:03d}.dcm"
        write_dicom(
            folder / name, np.clip(image, 0, 4095).astype(np.uint16), photometric=photometric
        )
        rows.append((name, label))
    write_labels(folder, rows)
    return folder
