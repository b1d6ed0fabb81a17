"""Safetensors files written and read one tensor at a time: the same bytes any safetensors reader sees."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array
from safetensors import safe_open
from safetensors.numpy import save_file

from hydrafl.arrays import array_view, record_nbytes
from hydrafl.tensor_files import (
    TensorFileError,
    TensorFileWriter,
    layout_of,
    open_tensors,
    removed_when_unused,
    save_tensors,
)


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((5, 3)).astype(np.float32),
        "b": rng.standard_normal(7).astype(np.float64),
        "steps": np.array([3, -2], dtype=np.int64),
        "mask": np.array([True, False, True]),
        "empty": np.zeros((0, 4), np.float32),
    }


def test_written_in_any_order_safetensors_reads_the_same_values(tmp_path) -> None:
    tensors = _tensors()
    writer = TensorFileWriter(tmp_path / "m.safetensors", layout_of(tensors), {"kind": "test"})
    for name in reversed(tensors):
        writer.write(name, torch.from_numpy(tensors[name]) if name == "w" else tensors[name])
    mapped = writer.close()
    with safe_open(tmp_path / "m.safetensors", "np") as handle:
        assert handle.metadata() == {"kind": "test"}
        assert sorted(handle.keys()) == sorted(tensors)
        for name, values in tensors.items():
            np.testing.assert_array_equal(handle.get_tensor(name), values)
    for name, values in tensors.items():
        np.testing.assert_array_equal(mapped[name].numpy(), values)
        assert mapped[name].numpy().dtype == values.dtype


def test_a_file_safetensors_wrote_opens_mapped_and_reads_like_a_flower_array(tmp_path) -> None:
    tensors = _tensors()
    save_file(tensors, tmp_path / "theirs.safetensors")
    mapped = open_tensors(tmp_path / "theirs.safetensors")
    for name, values in tensors.items():
        flower = Array(values)
        array = mapped[name]
        assert (array.dtype, array.shape) == (flower.dtype, flower.shape)
        assert array.data == flower.data  # the same serialised bytes Flower's encoders see
        assert array.serialised_nbytes == len(flower.data)
        view = array_view(array)
        np.testing.assert_array_equal(view, values)
        assert not view.flags.writeable
    fresh = mapped["w"].numpy()
    fresh += 1  # the caller owns what numpy() gives: the file is untouched
    np.testing.assert_array_equal(mapped["w"].numpy(), tensors["w"])
    assert record_nbytes(mapped) == sum(len(Array(v).data) for v in tensors.values())


def test_mapped_arrays_copy_to_another_file_one_at_a_time(tmp_path) -> None:
    tensors = _tensors()
    first = save_tensors(tmp_path / "a.safetensors", tensors)
    second = save_tensors(tmp_path / "b.safetensors", first)
    for name, values in tensors.items():
        np.testing.assert_array_equal(second[name].numpy(), values)


def test_a_file_removed_when_unused_stays_while_any_of_its_arrays_lives(tmp_path) -> None:
    path = tmp_path / "reply.safetensors"
    arrays = removed_when_unused(save_tensors(path, _tensors()))
    kept = arrays["b"]
    del arrays
    assert path.exists()  # one array still reads it
    np.testing.assert_array_equal(kept.numpy(), _tensors()["b"])
    del kept
    assert not path.exists()


def test_the_writer_refuses_what_its_layout_does_not_say(tmp_path) -> None:
    writer = TensorFileWriter(tmp_path / "m.safetensors", {"w": ("float32", (2, 2))})
    with pytest.raises(TensorFileError, match="layout says float32"):
        writer.write("w", np.zeros((2, 3), np.float32))
    with pytest.raises(TensorFileError, match="layout says float32"):
        writer.write("w", np.zeros((2, 2), np.float64))
    with pytest.raises(TensorFileError, match="no tensor 'v'"):
        writer.write("v", np.zeros((2, 2), np.float32))
    with pytest.raises(TensorFileError, match="'w' was never written"):
        writer.close()
    with pytest.raises(TensorFileError, match="no safetensors form"):
        TensorFileWriter(tmp_path / "c.safetensors", {"z": ("complex64", (1,))})


def test_a_damaged_file_is_refused_with_its_name(tmp_path) -> None:
    path = tmp_path / "m.safetensors"
    save_tensors(path, _tensors())
    whole = path.read_bytes()
    path.write_bytes(whole[:-8])
    with pytest.raises(TensorFileError, match="does not fit the file"):
        open_tensors(path)
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(TensorFileError, match="not a safetensors file"):
        open_tensors(path)
    path.write_bytes(whole[:4])
    with pytest.raises(TensorFileError, match="not a readable safetensors file"):
        open_tensors(path)
