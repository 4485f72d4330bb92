"""``torch_dad.data.word_token_streams`` and ``word_id_documents``: texts as word ids, offline."""

from __future__ import annotations

import pytest
import torch

from torch_dad import data


def test_word_token_streams_vocabulary_and_ids() -> None:
    train = ["b a b", "c b a d"]
    test = ["a e", "b"]
    words, train_ids, test_ids = data.word_token_streams(train, test, vocab_size=5)
    # b (3) before a (2); c and d tie at 1, c seen first
    assert words == ["<unk>", "<eos>", "b", "a", "c"]
    assert train_ids.tolist() == [2, 3, 2, 1, 4, 2, 3, 0, 1]
    assert test_ids.tolist() == [3, 0, 1, 2, 1]
    assert train_ids.dtype == torch.int64 and (data.UNKNOWN_WORD, data.END_OF_TEXT) == (0, 1)


@pytest.mark.parametrize("vocab_size", [2, 3.0, True])
def test_word_token_streams_rejects_a_bad_vocab_size(vocab_size: object) -> None:
    with pytest.raises(ValueError, match="vocab_size=.* must be an int >= 3"):
        data.word_token_streams(["a"], ["a"], vocab_size)  # type: ignore[arg-type]


def test_word_id_documents_rows_of_a_tab_folder(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.test_data import _newsgroups_folder

    (train, y_train), (test, y_test) = data.twenty_newsgroups(_newsgroups_folder(tmp_path))
    words, train_ids, test_ids = data.word_id_documents(train, test, vocab_size=5, length=3)
    # orbit and moon (2 each, orbit seen first), then god: the first of the words seen once
    assert words == ["<unk>", "<eos>", "orbit", "moon", "god"] == data.word_token_streams(train, test, 5)[0]
    # one row per document in file order (labels index them): first 3 words, then <eos> padding
    assert train_ids.tolist() == [[2, 3, 2], [4, 0, 1], [0, 3, 1], [0, 1, 1]] and y_train.tolist() == [2, 0, 1, 2]
    assert test_ids.tolist() == [[0, 0, 0], [3, 1, 1]] and y_test.tolist() == [1, 2]
    assert train_ids.dtype == test_ids.dtype == torch.int64


def test_word_id_documents_truncates_pads_and_keeps_empty_texts() -> None:
    words, ids, empty = data.word_id_documents(["a b c d e", "b"], ["", "e d"], vocab_size=8, length=2)
    assert words[2:] == ["b", "a", "c", "d", "e"]
    assert ids.tolist() == [[3, 2], [2, data.END_OF_TEXT]]
    assert empty.tolist() == [[data.END_OF_TEXT] * 2, [6, 5]]
    assert data.word_id_documents(["a"], [], vocab_size=3, length=4)[2].shape == (0, 4)


@pytest.mark.parametrize("length", [0, -1, 2.0, True])
def test_word_id_documents_rejects_a_bad_length(length: object) -> None:
    with pytest.raises(ValueError, match="length=.* must be a positive int"):
        data.word_id_documents(["a"], ["a"], vocab_size=3, length=length)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="vocab_size=2 must be an int >= 3"):
        data.word_id_documents(["a"], ["a"], vocab_size=2, length=4)
