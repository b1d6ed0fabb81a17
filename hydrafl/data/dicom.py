"""A hospital's DICOM studies as an image task: a folder with a `labels.csv` and the .dcm files it lists.

`labels.csv` has a `file` column (the path of a DICOM file relative to the folder) and a label column
(`label_column`, default "label"); other columns (patient ids, dates) are ignored. Each file must hold one 2-D
image. Its stored values go through RescaleSlope/Intercept, colour (RGB/YBR) becomes luminance as in image
folders, and each image is min-max normalised to [0, 1] on its own: bit depth and windowing differ between
scanners, so absolute levels (Hounsfield units) are not kept. MONOCHROME1 is then inverted, so bright means dense
in every image, and the image is resized bilinearly to IMAGE_SIZE x IMAGE_SIZE (aspect not kept, as for image
folders), so studies of any size mix. Multi-frame files and 3-D volumes are refused: which slice carries the
label is the site's choice, so it exports that frame as its own file.

The folder and the CSV must agree: a row whose file is missing and a DICOM file no row labels are errors, not
skipped, so a site never trains on a silently different set of studies than its operator listed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pydicom
from PIL import Image
from pydicom.errors import InvalidDicomError

from hydrafl.data.csv_table import LABELS_FILE, encode_labels, read_csv
from hydrafl.data.image_cohort import IMAGE_SIZE
from hydrafl.data.schema import DataError, TaskSpec

FILE_COLUMN = "file"
DEFAULT_LABEL_COLUMN = "label"
DICOM_SUFFIX = ".dcm"
GREY = ("MONOCHROME1", "MONOCHROME2")
COLOUR = ("RGB", "YBR_FULL", "YBR_FULL_422", "YBR_RCT", "YBR_ICT")
"""Colour encodings pydicom hands back as RGB; they become luminance like a colour PNG in an image folder."""
LUMINANCE = np.array([0.299, 0.587, 0.114])  # ITU-R BT.601, as PIL's convert("L")


def read_dicom_folder(
    folder: Path, label_column: str | None
) -> tuple[TaskSpec, np.ndarray, np.ndarray]:
    """The image task, float32 images [N, 1, IMAGE_SIZE, IMAGE_SIZE] in [0, 1] and int64 labels of a DICOM
    folder, rows in `labels.csv` order."""
    labels_file = folder / LABELS_FILE
    columns, rows = read_csv(labels_file)
    label_column = label_column or DEFAULT_LABEL_COLUMN
    available = ", ".join(repr(column) for column in columns)
    for needed, fix in (
        (FILE_COLUMN, "the path of each .dcm file relative to the folder"),
        (label_column, "each study's label (or pass the label column's name as label_column)"),
    ):
        if needed not in columns:
            raise DataError(
                f"{labels_file}, line 1: there is no column {needed!r} ({fix}); available columns: {available}"
            )
    if not rows:
        raise DataError(
            f"{labels_file}: no rows; add one line per DICOM file: {FILE_COLUMN},{label_column}"
        )
    file_at, label_at = columns.index(FILE_COLUMN), columns.index(label_column)
    root = folder.resolve()
    listed: dict[Path, int] = {}
    images, values = [], []
    for line_number, cells in rows:
        where = f"{labels_file}, line {line_number}"
        for at in (file_at, label_at):
            if not cells[at]:
                raise DataError(
                    f"{where}, column {columns[at]!r}: empty cell; fill it in or drop the row"
                )
        file = _listed_file(root, cells[file_at], where)
        if file in listed:
            raise DataError(
                f"{where}: {cells[file_at]!r} is already listed on line {listed[file]}; keep one row per file"
            )
        listed[file] = line_number
        images.append(read_dicom_image(file, where))
        values.append(cells[label_at])
    unlisted = sorted(set(_dicom_files(root)) - set(listed))
    if unlisted:
        raise DataError(
            f"{unlisted[0]}: a DICOM file with no row in {labels_file} ({len(unlisted)} such file(s)); add a row "
            f"'{unlisted[0].relative_to(root).as_posix()},LABEL' or move the file out of the folder"
        )
    labels, class_names = encode_labels(labels_file, label_column, values)
    task = TaskSpec(
        name=f"file:{folder.name}",
        modality="image",
        num_classes=len(class_names),
        class_names=class_names,
        image_size=IMAGE_SIZE,
        channels=1,
    )
    return task, np.stack(images)[:, None], labels


def _listed_file(root: Path, name: str, where: str) -> Path:
    """The file a row names, inside the folder: a site reads only the folder its operator pointed at."""
    file = (root / name).resolve()
    if not file.is_relative_to(root):
        raise DataError(
            f"{where}: {name!r} is outside {root}; give the path relative to the folder, inside it"
        )
    if not file.is_file():
        raise DataError(
            f"{where}: {name!r} does not exist under {root}; fix the path (relative to the folder) or drop the row"
        )
    return file


def _dicom_files(root: Path) -> list[Path]:
    """Files under the folder that are DICOM by name (.dcm) or by content (the "DICM" marker at byte 128)."""
    found = []
    for file in root.rglob("*"):
        if not file.is_file() or any(part.startswith(".") for part in file.relative_to(root).parts):
            continue
        if file.suffix.lower() == DICOM_SUFFIX or _has_dicom_marker(file):
            found.append(file.resolve())
    return found


def _has_dicom_marker(file: Path) -> bool:
    with file.open("rb") as handle:
        return handle.read(132)[128:] == b"DICM"


def read_dicom_image(file: Path, where: str) -> np.ndarray:
    """One DICOM file's image as float32 [IMAGE_SIZE, IMAGE_SIZE] in [0, 1]; `where` (the CSV line that lists
    it) goes into every error, so the operator knows which row to fix."""
    try:
        dataset = pydicom.dcmread(file)
    except InvalidDicomError as err:
        raise DataError(
            f"{file} ({where}): not a DICOM file ({err}); re-export it as DICOM Part 10 or drop its row"
        ) from err
    except (OSError, ValueError, EOFError) as err:
        raise DataError(
            f"{file} ({where}): cannot read the DICOM file ({err}); replace it or drop its row"
        ) from err
    if "PixelData" not in dataset:
        modality = dataset.get("Modality", "unknown modality")
        raise DataError(
            f"{file} ({where}): no pixel data ({modality}: a report, a presentation state or a truncated file?); "
            "list image files only"
        )
    frames = int(dataset.get("NumberOfFrames", 1) or 1)
    if frames > 1:
        raise DataError(
            f"{file} ({where}): {frames} frames (a multi-frame or 3-D volume); hydrafl trains on 2-D images: "
            "export the frame that carries the label as its own file and list that"
        )
    photometric = str(dataset.get("PhotometricInterpretation", ""))
    if photometric not in GREY + COLOUR:
        raise DataError(
            f"{file} ({where}): photometric interpretation {photometric!r} is not supported; "
            f"re-export it as one of {', '.join(GREY + COLOUR)}"
        )
    try:
        pixels = np.asarray(dataset.pixel_array, dtype=np.float64)
    except (
        Exception
    ) as err:  # pydicom raises many types for a codec it lacks or a truncated PixelData
        syntax = dataset.file_meta.get("TransferSyntaxUID", "unknown transfer syntax")
        raise DataError(
            f"{file} ({where}): cannot decode the pixel data ({syntax}: {err}); if it is compressed, decompress it "
            "(e.g. gdcmconv --raw) or install the codec pydicom names, else replace the file or drop its row"
        ) from err
    if photometric in COLOUR:
        pixels = pixels @ LUMINANCE
    if pixels.ndim != 2:
        raise DataError(
            f"{file} ({where}): pixel data of shape {pixels.shape} under {photometric}, not one 2-D image; fix "
            "SamplesPerPixel/PhotometricInterpretation or re-export the image"
        )
    pixels = pixels * float(dataset.get("RescaleSlope", 1) or 1) + float(
        dataset.get("RescaleIntercept", 0) or 0
    )
    low, high = pixels.min(), pixels.max()
    image = (pixels - low) / (high - low) if high > low else np.zeros_like(pixels)
    if photometric == "MONOCHROME1":  # 0 is white in MONOCHROME1
        image = 1.0 - image
    resized = Image.fromarray(image.astype(np.float32), mode="F").resize(
        (IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BILINEAR
    )
    return np.clip(np.asarray(resized, dtype=np.float32), 0.0, 1.0)
