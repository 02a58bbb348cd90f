"""The `words` tokenizer kind: the world's tokenizer.json behind the engine's interface."""

import numpy as np
import pytest

from embodied_kv.model.prompt import make_tokenizer, tokenize_prompt
from embodied_kv.model.word_tokenizer import save_tokenizer


def test_words_tokenizer_round_trip_and_errors(tmp_path):
    path = save_tokenizer(tmp_path / "tokenizer.json")
    tok = make_tokenizer("words", path)
    p = tokenize_prompt(tok, "put the red block in the blue bowl", np.full(8, 0.5), 96)
    assert p.ids[0] == tok.bos_id and not p.truncated
    # Task : put ... , State : 8 bins ; Action :  -> one id per word / mark; 0.5 is bin 192
    assert len(p.ids) == 1 + 2 + 8 + 1 + 2 + 8 + 1 + 2
    assert tok.decode(p.ids) == (
        "Task : put the red block in the blue bowl , State : " + " ".join(["192"] * 8)
        + " ; Action :"
    )  # fmt: skip
    assert tok.decode([tok.eos_id, tok.pad_id]) == ""
    with pytest.raises(ValueError, match="needs its tokenizer.json"):
        make_tokenizer("words")
    with pytest.raises(ValueError, match="does not exist"):
        make_tokenizer("words", tmp_path / "missing.json")
