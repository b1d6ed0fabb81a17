"""The CSV reading and label numbering that a table (`hydrafl.data.files`) and a DICOM folder's `labels.csv`
(`hydrafl.data.dicom`) share: every problem a DataError naming the file, line and column."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from hydrafl.data.schema import DataError

LABELS_FILE = "labels.csv"
"""The file that makes a folder a DICOM folder: one row per study (its file and label)."""

Rows = list[tuple[int, list[str]]]  # (1-based line number, one cell per column)


def read_csv(path: Path) -> tuple[list[str], Rows]:
    """The header and the non-blank rows of a CSV file, each row as long as the header (else a DataError)."""
    with path.open(newline="", encoding="utf-8-sig") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if not header:
            raise DataError(
                f"{path}: the file is empty; it needs a header line and at least one data row"
            )
        columns = [name.strip() for name in header]
        for position, name in enumerate(columns, start=1):
            if not name:
                raise DataError(
                    f"{path}, line 1: column {position} has no name; give every column a header"
                )
            if columns.index(name) != position - 1:
                raise DataError(
                    f"{path}, line 1: column {name!r} appears twice; rename one of them"
                )
        rows: Rows = []
        for fields in reader:
            if not fields:  # blank line
                continue
            if len(fields) != len(columns):
                raise DataError(
                    f"{path}, line {reader.line_num}: expected {len(columns)} fields ({', '.join(columns)}) "
                    f"but found {len(fields)}; check delimiters and quoting on that line"
                )
            rows.append((reader.line_num, [field.strip() for field in fields]))
    return columns, rows


def is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def is_finite_number(value: str) -> bool:
    return is_number(value) and math.isfinite(float(value))


def encode_labels(
    path: Path, label_column: str, values: list[str]
) -> tuple[np.ndarray, tuple[str, ...]]:
    """Int64 labels and the class names; class index = rank of the label among the sorted unique labels
    (numerically if all are numbers), so every site that holds the same classes numbers them the same way."""
    unique = set(values)
    if all(is_finite_number(value) for value in unique):
        class_names = tuple(sorted(unique, key=lambda value: (float(value), value)))
    else:
        class_names = tuple(sorted(unique))
    if len(class_names) < 2:
        raise DataError(
            f"{path}: column {label_column!r} has a single class ({class_names[0]!r}); a classifier needs at least 2"
        )
    index = {value: k for k, value in enumerate(class_names)}
    return np.array([index[value] for value in values], dtype=np.int64), class_names
