"""The offline word tokenizer: whole words are single tokens, eos is the last id, and it round-trips on disk."""

from __future__ import annotations

from transformers import AutoTokenizer, CLIPTokenizer

from sharpclip.models.tokenizer import build_word_tokenizer

WORDS = ["a red square left of a blue circle.", "tree", "three", "green", "large small striped"]


def test_every_listed_word_is_one_token_and_eos_is_the_largest_id() -> None:
    tok = build_word_tokenizer(WORDS)
    for word in ["a", "red", "square", "left", "of", "blue", "circle", ".", "tree", "three", "green", "striped"]:
        assert len(tok(word, add_special_tokens=False)["input_ids"]) == 1, word
    assert tok.eos_token_id == len(tok) - 1 and tok.bos_token_id == len(tok) - 2
    assert tok.pad_token_id == tok.eos_token_id and tok.unk_token_id not in (tok.eos_token_id, tok.bos_token_id)


def test_unknown_words_spell_out_and_unknown_characters_are_unk_not_eos() -> None:
    tok = build_word_tokenizer(WORDS)
    ids = tok("the é", add_special_tokens=False)["input_ids"]
    assert len(ids) > 2 and tok.eos_token_id not in ids and tok.unk_token_id in ids
    assert tok.decode(tok("a red tree")["input_ids"], skip_special_tokens=True) == "a red tree"


def test_truncation_keeps_eos_last_and_pads_with_eos() -> None:
    tok = build_word_tokenizer(WORDS, model_max_length=6)
    batch = tok(["a red square left of a blue circle", "tree"], padding="max_length", truncation=True)
    long_ids, short_ids = batch["input_ids"]
    assert len(long_ids) == 6 and long_ids[0] == tok.bos_token_id and long_ids[-1] == tok.eos_token_id
    assert short_ids[:3] == [tok.bos_token_id, tok.convert_tokens_to_ids("tree</w>"), tok.eos_token_id]
    assert batch["attention_mask"][1] == [1, 1, 1, 0, 0, 0]


def test_same_words_give_same_ids_and_save_load_round_trips(tmp_path) -> None:
    tok = build_word_tokenizer(WORDS, model_max_length=12)
    assert build_word_tokenizer(list(reversed(WORDS)), model_max_length=12).get_vocab() == tok.get_vocab()
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert isinstance(again, CLIPTokenizer) and again.model_max_length == 12
    text = ["a blue circle left of three green trees"]
    assert again(text)["input_ids"] == tok(text)["input_ids"]
