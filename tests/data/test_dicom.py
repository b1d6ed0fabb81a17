"""DICOM folders as a site's data: the pixels and labels read back as written (rescale, MONOCHROME1, colour,
resizing), every error names the file or labels.csv line and the fix, and a federation learns from them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pydicom
import pytest
from dicom_files import pattern_folder, write_dicom, write_labels
from helpers import SMALL_RUN

from hydrafl.data import DataError, load_cohort
from hydrafl.data.files import read_dataset
from hydrafl.simulation.compare import run_strategy


def _minmax(values: np.ndarray) -> np.ndarray:
    values = values.astype(np.float64)
    return (values - values.min()) / (values.max() - values.min())


def test_pixels_and_labels_read_back_as_written(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    plain = rng.integers(0, 4096, size=(32, 32)).astype(np.uint16)
    inverted = rng.integers(0, 4096, size=(32, 32)).astype(np.uint16)
    colour = rng.integers(0, 256, size=(32, 32, 3)).astype(np.uint8)
    ct = rng.integers(0, 4096, size=(32, 32)).astype(np.uint16)
    write_dicom(tmp_path / "a.dcm", plain)
    write_dicom(tmp_path / "b.dcm", inverted, photometric="MONOCHROME1")
    write_dicom(tmp_path / "study 2" / "c.dcm", colour, photometric="RGB")
    write_dicom(
        tmp_path / "IM0004", ct, rescale=(-1.0, 3000.0)
    )  # no suffix: a DICOM by its content
    header = ("patient", "file", "finding")
    rows = [
        ("p1", "a.dcm", "normal"),
        ("p2", "b.dcm", "effusion"),
        ("p3", "study 2/c.dcm", "normal"),
        ("p4", "IM0004", "effusion"),
    ]
    write_labels(tmp_path, rows, header)

    task, x, y = read_dataset(tmp_path, "finding")

    assert (task.modality, task.image_size, task.channels, task.class_names) == (
        "image",
        32,
        1,
        ("effusion", "normal"),
    )
    assert x.shape == (4, 1, 32, 32) and x.dtype == np.float32
    np.testing.assert_allclose(x[0, 0], _minmax(plain), atol=1e-6)
    np.testing.assert_allclose(
        x[1, 0], 1.0 - _minmax(inverted), atol=1e-6
    )  # 0 is white in MONOCHROME1
    np.testing.assert_allclose(
        x[2, 0], _minmax(colour @ np.array([0.299, 0.587, 0.114])), atol=1e-6
    )
    np.testing.assert_allclose(
        x[3, 0], _minmax(3000.0 - ct.astype(np.float64)), atol=1e-6
    )  # slope -1: flipped
    assert y.tolist() == [1, 0, 1, 0]


def test_other_sizes_are_resized_to_the_image_task(tmp_path: Path) -> None:
    image = np.zeros((96, 64), dtype=np.uint16)
    image[:, :32] = 1000  # bright left half
    write_dicom(tmp_path / "wide.dcm", image)
    write_dicom(tmp_path / "small.dcm", np.arange(16 * 16, dtype=np.uint16).reshape(16, 16))
    write_labels(tmp_path, [("wide.dcm", "0"), ("small.dcm", "1")])

    _, x, _ = read_dataset(tmp_path, None)

    assert x.shape == (2, 1, 32, 32)
    np.testing.assert_allclose(x[0, 0, :, :15], 1.0, atol=1e-6)
    np.testing.assert_allclose(x[0, 0, :, 17:], 0.0, atol=1e-6)
    assert np.all(np.diff(x[1, 0, :, 0]) >= 0) and x[1, 0].min() == 0.0 and x[1, 0].max() == 1.0


HEADER_EDITS = {
    "palette": {"PhotometricInterpretation": "PALETTE COLOR"},
    "truncated-pixels": {"PixelData": bytes(20)},
    "three-samples-as-grey": {
        "SamplesPerPixel": 3,
        "PlanarConfiguration": 0,
        "Rows": 8,
        "Columns": 8,
    },
}
"""Header edits that break file 1.dcm (32 x 32 x 16 bits): an unsupported encoding, pixel data too short for its
header, and a header whose sample count turns one grey image into a colour-shaped array."""


def _folder_with(tmp_path: Path, breakage: str) -> Path:
    """A valid two-class DICOM folder, then broken in one way."""
    folder = tmp_path / "studies"
    image = np.arange(32 * 32, dtype=np.uint16).reshape(32, 32)
    rows = [(f"{k}.dcm", ("normal", "effusion")[k % 2]) for k in range(4)]
    for name, _ in rows:
        write_dicom(folder / name, image)
    if breakage == "not-dicom":
        (folder / "1.dcm").write_text("patient,finding\n")
    elif breakage == "no-pixels":
        write_dicom(folder / "1.dcm", None)
    elif breakage in HEADER_EDITS:
        dataset = pydicom.dcmread(folder / "1.dcm")
        for keyword, value in HEADER_EDITS[breakage].items():
            setattr(dataset, keyword, value)
        dataset.save_as(folder / "1.dcm")
    elif breakage == "multi-frame":
        write_dicom(folder / "1.dcm", np.zeros((3, 8, 8), dtype=np.uint16))
    elif breakage == "missing-file":
        rows.append(("5.dcm", "normal"))
    elif breakage == "outside":
        rows.append(("../elsewhere.dcm", "normal"))
        write_dicom(tmp_path / "elsewhere.dcm", image)
    elif breakage == "unlabelled":
        write_dicom(folder / "extra" / "9.dcm", image)
    elif breakage == "duplicate":
        rows.append(("0.dcm", "effusion"))
    elif breakage == "empty-label":
        rows[1] = ("1.dcm", "")
    elif breakage == "no-rows":
        rows = []
    write_labels(
        folder, rows, ("path", "label") if breakage == "no-file-column" else ("file", "label")
    )
    return folder


@pytest.mark.parametrize(
    ("breakage", "fragments"),
    [
        ("not-dicom", ["1.dcm", "labels.csv, line 3", "not a DICOM file", "re-export it as DICOM"]),
        ("no-pixels", ["1.dcm", "labels.csv, line 3", "no pixel data", "list image files only"]),
        (
            "palette",
            [
                "1.dcm",
                "line 3",
                "'PALETTE COLOR' is not supported",
                "re-export it as one of MONOCHROME1",
            ],
        ),
        (
            "truncated-pixels",
            ["1.dcm", "line 3", "cannot decode the pixel data", "replace the file or drop its row"],
        ),
        (
            "three-samples-as-grey",
            ["1.dcm", "line 3", "not one 2-D image", "fix SamplesPerPixel/Photometric"],
        ),
        (
            "multi-frame",
            ["1.dcm", "labels.csv, line 3", "3 frames", "export the frame that carries the label"],
        ),
        (
            "missing-file",
            ["labels.csv, line 6", "'5.dcm' does not exist", "fix the path", "or drop the row"],
        ),
        (
            "outside",
            ["labels.csv, line 6", "'../elsewhere.dcm' is outside", "relative to the folder"],
        ),
        (
            "unlabelled",
            [
                "9.dcm",
                "a DICOM file with no row in",
                "add a row 'extra/9.dcm,LABEL'",
                "or move the file",
            ],
        ),
        (
            "duplicate",
            ["labels.csv, line 6", "'0.dcm' is already listed on line 2", "keep one row per file"],
        ),
        ("empty-label", ["labels.csv, line 3", "column 'label'", "empty cell", "fill it in"]),
        ("no-rows", ["labels.csv", "no rows", "add one line per DICOM file"]),
        (
            "no-file-column",
            ["labels.csv, line 1", "no column 'file'", "available columns: 'path', 'label'"],
        ),
    ],
)
def test_errors_name_the_file_or_line_and_the_fix(
    tmp_path: Path, breakage: str, fragments: list[str]
) -> None:
    with pytest.raises(DataError) as raised:
        read_dataset(_folder_with(tmp_path, breakage), None)
    for fragment in fragments:
        assert fragment in str(raised.value)


def test_a_label_column_that_is_not_there_is_named(tmp_path: Path) -> None:
    folder = _folder_with(tmp_path, "none")
    with pytest.raises(
        DataError, match="no column 'finding'.*label_column.*available columns: 'file', 'label'"
    ):
        read_dataset(folder, "finding")


def test_a_federation_learns_from_dicom_folders(tmp_path: Path) -> None:
    folder = pattern_folder(tmp_path / "studies", per_class=30)
    cohort = load_cohort(data_path=folder, num_sites=2)
    assert (
        cohort.task.class_names == ("left", "right")
        and sum(len(site.train_y) for site in cohort.sites) == 48
    )

    cfg = SMALL_RUN.replace(data=str(folder), sites=2, rounds=3, local_steps=8, batch_size=16)
    history = run_strategy(cfg, "inprocess")

    assert history[0]["accuracy"] < 0.8  # the initial model has not seen the pattern
    assert history[-1]["accuracy"] >= 0.9  # chance is 0.5
