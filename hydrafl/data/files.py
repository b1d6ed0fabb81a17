"""A researcher's own data: a CSV or JSONL table (tabular or text), a folder of labelled images, or a folder of
DICOM studies with a `labels.csv` (`hydrafl.data.dicom`).

Files come from hospital exports, so every problem is reported as a DataError that names the file, the
1-based line and the column, and says how to fix it: a training run should never fail deep inside a model
because of one empty cell.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from hydrafl.catalog import TABLE_SUFFIXES
from hydrafl.data.csv_table import (
    LABELS_FILE,
    Rows,
    encode_labels,
    is_finite_number,
    is_number,
    read_csv,
)
from hydrafl.data.image_cohort import IMAGE_SIZE
from hydrafl.data.schema import DataError, TaskSpec
from hydrafl.data.tokenizer import SEQ_LEN, VOCAB_SIZE, tokenize

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif")


def read_dataset(path: Path, label_column: str | None) -> tuple[TaskSpec, np.ndarray, np.ndarray]:
    """The task, raw features and int64 labels of a file or image folder (features not yet standardised).

    Tables: tabular if every non-label column is numeric, text if there is exactly one other (text) column.
    Image folders take their labels from sub-folder names, so `label_column` does not apply to them; a folder
    holding a `labels.csv` is a DICOM folder, labelled by that file's `label_column` (default "label").
    """
    if not path.exists():
        raise DataError(f"{path}: no such file or folder; check --data")
    if path.is_dir():
        if (path / LABELS_FILE).is_file():
            from hydrafl.data.dicom import (
                read_dicom_folder,
            )  # pydicom is loaded only for DICOM data

            return read_dicom_folder(path, label_column)
        return _read_image_folder(path)
    suffix = path.suffix.lower()
    if suffix not in TABLE_SUFFIXES:
        raise DataError(
            f"{path}: unsupported file type {suffix!r}; use {', '.join(TABLE_SUFFIXES)} "
            "or a folder with one sub-folder of images per class"
        )
    try:
        columns, rows = read_csv(path) if suffix == ".csv" else _read_jsonl(path)
    except UnicodeDecodeError as err:
        raise DataError(
            f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); re-export it as UTF-8"
        ) from err
    return _table_task(path, columns, rows, label_column)


def _read_jsonl(path: Path) -> tuple[list[str], Rows]:
    columns: list[str] = []
    rows: Rows = []
    with path.open(encoding="utf-8-sig") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{path}, line {line_number}: malformed JSON ({err.msg} at character {err.colno}); "
                    "each line must be one complete JSON object"
                ) from err
            if not isinstance(record, dict):
                raise DataError(
                    f'{path}, line {line_number}: expected a JSON object like {{"column": value}}, '
                    f"got {type(record).__name__}"
                )
            if not columns:
                columns = list(record)
            unexpected = [key for key in record if key not in columns]
            if unexpected:
                raise DataError(
                    f"{path}, line {line_number}: column {unexpected[0]!r} is not in the first record "
                    f"({', '.join(columns)}); every line needs the same keys"
                )
            rows.append(
                (
                    line_number,
                    [_json_cell(path, line_number, key, record.get(key)) for key in columns],
                )
            )
    if not rows:
        raise DataError(f"{path}: the file has no JSON records; write one JSON object per line")
    return columns, rows


def _json_cell(path: Path, line_number: int, column: str, value: object) -> str:
    """A JSON value as the text a CSV cell would hold, so both formats share one validation path."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float | str):
        return str(value).strip()
    raise DataError(
        f"{path}, line {line_number}, column {column!r}: nested {type(value).__name__} values are not supported; "
        "use a number or a string"
    )


def _table_task(
    path: Path, columns: list[str], rows: Rows, label_column: str | None
) -> tuple[TaskSpec, np.ndarray, np.ndarray]:
    available = ", ".join(repr(column) for column in columns)
    if label_column is None:
        raise DataError(
            f"{path}: label_column is required for table files; available columns: {available}"
        )
    if label_column not in columns:
        raise DataError(
            f"{path}: there is no column {label_column!r}; available columns: {available}"
        )
    if not rows:
        raise DataError(f"{path}: the file has a header but no data rows")
    label_at = columns.index(label_column)
    features = [i for i in range(len(columns)) if i != label_at]
    if not features:
        raise DataError(
            f"{path}: {label_column!r} is the only column; add feature columns (numbers or one text)"
        )

    numeric = {i: is_number(_first_value(rows, i)) for i in features}
    text_columns = [columns[i] for i in features if not numeric[i]]
    numeric_columns = [columns[i] for i in features if numeric[i]]
    if text_columns and (numeric_columns or len(text_columns) > 1):
        raise DataError(
            f"{path}: cannot mix text columns {text_columns} with numeric columns {numeric_columns} "
            f"(or use several text columns); keep either only numeric feature columns or exactly one text column "
            f"besides {label_column!r}"
        )
    for line_number, cells in rows:
        for i in [label_at, *features]:
            if not cells[i]:
                raise DataError(
                    f"{path}, line {line_number}, column {columns[i]!r}: empty cell; fill it in or drop the row"
                )
            if numeric.get(i, False) and not is_finite_number(cells[i]):
                raise DataError(
                    f"{path}, line {line_number}, column {columns[i]!r}: {cells[i]!r} is not a finite number, but "
                    "the column is numeric (its first value is); fix the value, or if the column is text make "
                    "sure its first value is not a number"
                )

    labels, class_names = encode_labels(path, label_column, [cells[label_at] for _, cells in rows])
    name = f"file:{path.name}"
    if text_columns:
        texts = [cells[features[0]] for _, cells in rows]
        task = TaskSpec(
            name=name,
            modality="text",
            num_classes=len(class_names),
            class_names=class_names,
            vocab_size=VOCAB_SIZE,
            seq_len=SEQ_LEN,
        )
        return task, tokenize(texts, VOCAB_SIZE, SEQ_LEN).numpy(), labels
    x = np.array([[float(cells[i]) for i in features] for _, cells in rows], dtype=np.float32)
    task = TaskSpec(
        name=name,
        modality="tabular",
        num_classes=len(class_names),
        class_names=class_names,
        num_features=len(features),
    )
    return task, x, labels


def _first_value(rows: Rows, column: int) -> str:
    return next((cells[column] for _, cells in rows if cells[column]), "")


def _read_image_folder(path: Path) -> tuple[TaskSpec, np.ndarray, np.ndarray]:
    """Images float32 [N, 1, 32, 32] in [0, 1] (grayscale, bilinear resize) and labels from sub-folder names."""
    folders = sorted(
        entry for entry in path.iterdir() if entry.is_dir() and not entry.name.startswith(".")
    )
    if len(folders) < 2:
        raise DataError(
            f"{path}: an image folder needs one sub-folder per class and at least 2 classes; "
            f"found {[folder.name for folder in folders]}"
        )
    images: list[np.ndarray] = []
    labels: list[int] = []
    for label, folder in enumerate(folders):
        files = sorted(
            entry
            for entry in folder.iterdir()
            if entry.is_file() and entry.suffix.lower() in IMAGE_SUFFIXES
        )
        if not files:
            raise DataError(
                f"{folder}: class folder {folder.name!r} has no images ({', '.join(IMAGE_SUFFIXES)}); "
                "add images or remove the folder"
            )
        for file in files:
            try:
                with Image.open(file) as image:
                    gray = image.convert("L").resize(
                        (IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BILINEAR
                    )
                    images.append(np.asarray(gray, dtype=np.float32) / 255.0)
            except (OSError, ValueError, Image.DecompressionBombError) as err:
                raise DataError(
                    f"{file}: cannot read the image ({err}); replace or delete the file"
                ) from err
            labels.append(label)
    task = TaskSpec(
        name=f"file:{path.name}",
        modality="image",
        num_classes=len(folders),
        class_names=tuple(folder.name for folder in folders),
        image_size=IMAGE_SIZE,
        channels=1,
    )
    return task, np.stack(images)[:, None], np.array(labels, dtype=np.int64)
