import pytest
import torch

from hydrafl.data import DataError, tokenize


def test_layout_is_cls_then_words_then_padding() -> None:
    ids = tokenize(["Fever and SOB", ""], vocab_size=2048, seq_len=6)
    assert ids.dtype == torch.int64 and ids.shape == (2, 6)
    assert ids[:, 0].tolist() == [1, 1]
    assert (ids[0, 1:4] >= 3).all() and ids[0, 4:].tolist() == [0, 0]
    assert ids[1, 1:].tolist() == [0] * 5


def test_ids_are_stable_crc32_buckets() -> None:
    # Pinned values: every site and every release must agree on a word's id.
    ids = tokenize(["fever sob dyspnea"], vocab_size=2048, seq_len=4)
    assert ids[0].tolist() == [1, 2047, 649, 1000]


def test_lowercases_and_splits_on_non_alphanumerics() -> None:
    a = tokenize(["No-fever, BP 80/40!"], vocab_size=2048, seq_len=8)
    b = tokenize(["no fever bp 80 40"], vocab_size=2048, seq_len=8)
    assert torch.equal(a, b)
    assert torch.equal(tokenize(["snake_case"], 2048, 4), tokenize(["snake case"], 2048, 4))


def test_truncates_to_seq_len_and_respects_vocab() -> None:
    ids = tokenize([" ".join(f"w{i}" for i in range(100))], vocab_size=16, seq_len=10)
    assert ids.shape == (1, 10)
    assert (ids[0, 1:] >= 3).all() and (ids < 16).all()


@pytest.mark.parametrize(("vocab_size", "seq_len"), [(3, 8), (2048, 0)])
def test_rejects_unusable_sizes(vocab_size: int, seq_len: int) -> None:
    with pytest.raises(DataError):
        tokenize(["x"], vocab_size, seq_len)
