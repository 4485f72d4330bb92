"""``torch_dad.data.word_token_streams``: texts as word-id streams for a language model, offline."""

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
