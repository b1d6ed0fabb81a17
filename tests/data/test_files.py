"""User files: CSV / JSONL tables and image folders, and the error messages that point at the bad cell."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hydrafl.data import Cohort, DataError, load_cohort, tokenize


def _all_rows(cohort: Cohort) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.cat([torch.cat([s.train_x, s.test_x]) for s in cohort.sites])
    y = torch.cat([torch.cat([s.train_y, s.test_y]) for s in cohort.sites])
    return x, y


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --- tables ---------------------------------------------------------------------------------------------------


def test_numeric_csv_round_trips_as_a_standardised_tabular_task(tmp_path: Path) -> None:
    labels = ["low", "mid", "high"]
    lines = ["id,lactate, outcome ,hr"] + [
        f"{i},{2 * i + 1.5},{labels[i % 3]},{60 + i % 7}" for i in range(30)
    ]
    cohort = load_cohort(
        data_path=_write(tmp_path / "vitals.csv", lines),
        label_column="outcome",
        num_sites=3,
        seed=1,
    )
    task = cohort.task
    assert (task.name, task.modality, task.num_features) == ("file:vitals.csv", "tabular", 3)
    assert task.class_names == ("high", "low", "mid") and task.num_classes == 3
    assert [len(s.train_y) + len(s.test_y) for s in cohort.sites] == [10, 10, 10]  # iid by default
    x, y = _all_rows(cohort)
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    # Standardisation is affine per column, so sorting by the id column recovers the file order.
    order = torch.argsort(x[:, 0])
    expected = [task.class_names.index(labels[i % 3]) for i in range(30)]
    assert y[order].tolist() == expected
    assert np.corrcoef(x[:, 0].numpy(), x[:, 1].numpy())[0, 1] == pytest.approx(1.0, abs=1e-6)
    train = torch.cat([s.train_x for s in cohort.sites]).double()
    assert train.mean(0).abs().max() < 1e-5


def test_numeric_labels_sort_numerically(tmp_path: Path) -> None:
    lines = ["x,grade"] + [f"{i},{[2, 10, 1][i % 3]}" for i in range(12)]
    cohort = load_cohort(
        data_path=_write(tmp_path / "g.csv", lines), label_column="grade", num_sites=2
    )
    assert cohort.task.class_names == ("1", "2", "10")


def test_text_csv_with_quoted_commas_becomes_a_text_task(tmp_path: Path) -> None:
    notes = [
        f'"patient {i}, {"febrile" if i % 2 else "no fever"}, ""quoted"" note"' for i in range(20)
    ]
    lines = ["note,label"] + [f"{note},{i % 2}" for i, note in enumerate(notes)]
    cohort = load_cohort(
        data_path=_write(tmp_path / "notes.csv", lines), label_column="label", num_sites=2
    )
    task = cohort.task
    assert (task.modality, task.vocab_size, task.seq_len, task.class_names) == (
        "text",
        2048,
        48,
        ("0", "1"),
    )
    texts = [f'patient {i}, {"febrile" if i % 2 else "no fever"}, "quoted" note' for i in range(20)]
    expected = tokenize(texts, 2048, 48)
    x, y = _all_rows(cohort)
    row_label = {tuple(row.tolist()): i % 2 for i, row in enumerate(expected)}
    assert sorted(row_label[tuple(row.tolist())] for row in x) == sorted(i % 2 for i in range(20))
    assert all(
        row_label[tuple(row.tolist())] == label for row, label in zip(x, y.tolist(), strict=True)
    )


@pytest.mark.parametrize("suffix", [".jsonl", ".ndjson"])
def test_jsonl_text_and_tabular(tmp_path: Path, suffix: str) -> None:
    records = [
        {"text": f"note {i} {'wheeze' if i % 2 else 'edema'}", "dx": ["copd", "hf"][i % 2]}
        for i in range(16)
    ]
    lines = (
        [json.dumps(r) for r in records[:8]] + [""] + [json.dumps(r) for r in records[8:]]
    )  # blank line is fine
    cohort = load_cohort(
        data_path=_write(tmp_path / f"notes{suffix}", lines), label_column="dx", num_sites=2
    )
    task = cohort.task
    assert (task.name, task.modality, task.class_names) == (
        f"file:notes{suffix}",
        "text",
        ("copd", "hf"),
    )
    x, y = _all_rows(cohort)
    assert x.shape == (16, 48) and (x[:, 0] == 1).all()
    wheeze = tokenize(["wheeze"], 2048, 2)[0, 1]
    assert ((x == wheeze).any(1) == (y == 1)).all()

    rows = [{"a": i, "b": 0.5 * i, "y": i % 2} for i in range(10)]
    table = _write(tmp_path / f"t{suffix}", [json.dumps(r) for r in rows])
    tab = load_cohort(data_path=table, label_column="y", num_sites=2)
    assert (tab.task.modality, tab.task.num_features, tab.task.class_names) == (
        "tabular",
        2,
        ("0", "1"),
    )


def test_file_partitions_by_label(tmp_path: Path) -> None:
    lines = ["v,y"] + [f"{i},{'abc'[i % 3]}" for i in range(60)]
    path = _write(tmp_path / "p.csv", lines)
    cohort = load_cohort(data_path=path, label_column="y", num_sites=3, partition="pathological:1")
    assert [set(torch.cat([s.train_y, s.test_y]).tolist()) for s in cohort.sites] == [{0}, {1}, {2}]
    with pytest.raises(
        DataError, match=r"partition 'natural'.*p\.csv.*iid, dirichlet:ALPHA or pathological:K"
    ):
        load_cohort(data_path=path, label_column="y", partition="natural")


@pytest.mark.parametrize(
    ("name", "lines", "label", "fragments"),
    [
        (
            "v.csv",
            ["a,b,y", "1,2,x", "3,oops,z", "4,5,x"],
            "y",
            ["v.csv", "line 3", "'b'", "'oops' is not a finite"],
        ),
        (
            "v.csv",
            ["a,b,y", "1,2,x", "3,nan,z"],
            "y",
            ["v.csv", "line 3", "'b'", "not a finite number"],
        ),
        ("v.csv", ["a,b,y", "1,2,x", "3,,z"], "y", ["v.csv", "line 3", "'b'", "empty cell"]),
        ("v.csv", ["a,b,y", "1,2,x", "3,4,"], "y", ["v.csv", "line 3", "'y'", "empty cell"]),
        ("v.csv", ["a,b,y", "1,2,x", "3,4"], "y", ["v.csv", "line 3", "expected 3 fields"]),
        (
            "v.csv",
            ["a,b,y", "1,2,x", "3,4,z"],
            None,
            ["v.csv", "label_column is required", "'a', 'b', 'y'"],
        ),
        (
            "v.csv",
            ["a,b,y", "1,2,x", "3,4,z"],
            "label",
            ["v.csv", "no column 'label'", "'a', 'b', 'y'"],
        ),
        ("v.csv", ["a,b,y", "1,2,x", "3,4,x"], "y", ["v.csv", "'y' has a single class ('x')"]),
        ("v.csv", ["a,b,y"], "y", ["v.csv", "header but no data rows"]),
        ("v.csv", [""], "y", ["v.csv", "empty"]),
        ("v.csv", ["a,a,y", "1,2,x"], "y", ["v.csv", "line 1", "'a' appears twice"]),
        ("v.csv", ["y", "x", "z"], "y", ["v.csv", "only column"]),
        (
            "m.csv",
            ["age,note,y", "40,cough,x", "50,fever,z"],
            "y",
            ["m.csv", "['note']", "['age']"],
        ),
        ("m.csv", ["note,site,y", "cough,a,x", "fever,b,z"], "y", ["m.csv", "['note', 'site']"]),
        (
            "j.jsonl",
            ['{"a": 1, "y": "x"}', "", '{"a": 3, "y": '],
            "y",
            ["j.jsonl", "line 3", "malformed JSON"],
        ),
        (
            "j.jsonl",
            ['{"a": 1, "y": "x"}', "[1, 2]"],
            "y",
            ["j.jsonl", "line 2", "expected a JSON object"],
        ),
        (
            "j.jsonl",
            ['{"a": 1, "y": "x"}', '{"a": 2, "b": 3, "y": "z"}'],
            "y",
            ["j.jsonl", "line 2", "'b'", "first"],
        ),
        (
            "j.jsonl",
            ['{"a": 1, "y": "x"}', '{"y": "z"}'],
            "y",
            ["j.jsonl", "line 2", "'a'", "empty cell"],
        ),
        (
            "j.jsonl",
            ['{"a": 1, "y": "x"}', '{"a": [1], "y": "z"}'],
            "y",
            ["j.jsonl", "line 2", "'a'", "nested list"],
        ),
        (
            "j.jsonl",
            ['{"a": 1, "y": "x"}', '{"a": "high", "y": "z"}'],
            "y",
            ["j.jsonl", "line 2", "'a'", "'high'"],
        ),
        ("j.jsonl", ["", "  "], "y", ["j.jsonl", "no JSON records"]),
        ("t.txt", ["a,y", "1,x"], "y", ["t.txt", "unsupported file type '.txt'", ".csv"]),
        ("few.csv", ["a,y", "1,x", "2,z", "3,x"], "y", ["3 rows are too few for 4 sites"]),
    ],
)
def test_table_errors_name_the_file_line_and_column(
    tmp_path: Path, name: str, lines: list[str], label: str | None, fragments: list[str]
) -> None:
    path = _write(tmp_path / name, lines)
    with pytest.raises(DataError) as error:
        load_cohort(data_path=path, label_column=label, num_sites=4 if name == "few.csv" else 1)
    for fragment in fragments:
        assert fragment in str(error.value)


def test_missing_path_and_non_utf8_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nowhere\.csv: no such file"):
        load_cohort(data_path=tmp_path / "nowhere.csv", label_column="y")
    latin = tmp_path / "latin.csv"
    latin.write_bytes("note,y\ncaf\xe9,x\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin\.csv: not UTF-8"):
        load_cohort(data_path=latin, label_column="y")


# --- image folders --------------------------------------------------------------------------------------------


def _image_folder(root: Path, per_class: int = 6) -> Path:
    for name, value in (("effusion", 40), ("normal", 220)):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            size = (48 + 4 * i, 40)
            if i % 2:
                Image.new("RGB", size, (value, value // 2, value)).save(root / name / f"{i}.png")
            else:
                Image.new("L", size, value).save(root / name / f"{i}.jpg")
    (root / "normal" / "README.txt").write_text("not an image")
    (root / ".hidden").mkdir()
    return root


def test_image_folder_becomes_a_standardised_grayscale_task(tmp_path: Path) -> None:
    cohort = load_cohort(data_path=_image_folder(tmp_path / "xrays"), num_sites=2)
    task = cohort.task
    assert (task.name, task.modality, task.image_size, task.channels) == (
        "file:xrays",
        "image",
        32,
        1,
    )
    assert task.class_names == ("effusion", "normal")
    x, y = _all_rows(cohort)
    assert x.shape == (12, 1, 32, 32) and x.dtype == torch.float32
    assert y.bincount().tolist() == [6, 6]
    assert (
        x[y == 1].mean() > 0.5 > -0.5 > x[y == 0].mean()
    )  # bright normals, dark effusions after standardising


@pytest.mark.parametrize(
    ("breakage", "fragments"),
    [
        ("one_class", ["xrays", "at least 2 classes", "['normal']"]),
        ("empty_class", ["effusion", "has no images"]),
        ("corrupt", ["broken.png", "cannot read the image"]),
    ],
)
def test_image_folder_errors_name_the_folder_or_file(
    tmp_path: Path, breakage: str, fragments: list[str]
) -> None:
    root = _image_folder(tmp_path / "xrays")
    if breakage == "one_class":
        for file in (root / "effusion").iterdir():
            file.unlink()
        (root / "effusion").rmdir()
    elif breakage == "empty_class":
        for file in (root / "effusion").iterdir():
            file.unlink()
        (root / "effusion" / "notes.txt").write_text("no pictures here")
    else:
        (root / "normal" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    with pytest.raises(DataError) as error:
        load_cohort(data_path=root, num_sites=2)
    for fragment in fragments:
        assert fragment in str(error.value)
