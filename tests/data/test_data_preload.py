"""data.preload: every training image decoded once and kept; batches equal those of the decoding loader, no file is
opened after preloading, bad images keep their policy, and the settings that cannot preload are refused."""

from __future__ import annotations

import pytest
import torch
from data_helpers import cfg_for, copy_fixture, prep

import sharpclip.data.dataset as dataset_module
from sharpclip.config import AugmentConfig, ConfigError, DataConfig
from sharpclip.data import BadSampleError, build_loader
from sharpclip.models.tokenizer import build_word_tokenizer

TOK = build_word_tokenizer(["a close-up of a red mailbox number on wooden post daytime"])


def _epochs(cfg, epochs=2):
    loader = build_loader(cfg, "train", prep(TOK, size=32), batch_size=2, seed=1)
    out = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        out.append([(b.ids, b.pixel_values, b.input_ids) for b in loader])
    return loader, out


def _count_opens(monkeypatch) -> list[int]:
    opened = [0]
    real = dataset_module.load_image

    def counting(*args, **kwargs):
        opened[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(dataset_module, "load_image", counting)
    return opened


def test_preloaded_batches_equal_decoded_ones_and_open_no_file_after_preloading(monkeypatch):
    _, decoded = _epochs(cfg_for("docci"))
    opened = _count_opens(monkeypatch)
    loader, preloaded = _epochs(cfg_for("docci", preload=True))
    rows = len(loader.dataset)
    assert opened[0] == rows  # once each, at build time; neither epoch opened a file
    assert loader.num_workers == 0  # data.num_workers auto: nothing left for workers to decode
    assert len(preloaded) == len(decoded) == 2 and preloaded[0]
    for ours, theirs in zip(preloaded, decoded, strict=True):
        assert [b[0] for b in ours] == [b[0] for b in theirs]  # same order, same rows
        for (_, pixels, ids), (_, pixels_ref, ids_ref) in zip(ours, theirs, strict=True):
            assert torch.equal(pixels, pixels_ref) and torch.equal(ids, ids_ref)


def test_explicit_workers_are_kept_with_preload():
    loader = build_loader(cfg_for("docci", preload=True, num_workers=1), "train", prep(TOK, size=32), batch_size=2)
    assert loader.num_workers == 1


def test_evaluation_loaders_do_not_preload(monkeypatch):
    opened = _count_opens(monkeypatch)
    loader = build_loader(cfg_for("docci", preload=True), "test", prep(TOK, size=32), batch_size=2)
    assert opened[0] == 0 and loader.dataset.preloaded is None  # read as it is iterated


def test_a_bad_image_keeps_its_policy_when_preloaded(tmp_path):
    root = copy_fixture("docci", tmp_path)
    path = root / "images" / "train_00000.jpg"
    path.write_bytes(path.read_bytes()[:40])  # truncated JPEG
    with pytest.raises(BadSampleError, match=r"record train_00000: unreadable image"):
        _epochs(cfg_for("docci", root, preload=True), epochs=1)  # raised when its row is read, as without preload
    loader, (epoch,) = _epochs(cfg_for("docci", root, preload=True, on_bad_sample="skip"), epochs=1)
    assert [i for ids, _, _ in epoch for i in ids] == ["train_00001"]
    assert [b.record for b in loader.report.items] == ["train_00000"]


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"augment": AugmentConfig(enabled=True)}, "data.augment draws new crops every epoch"),
        ({"format": "webdataset"}, "webdataset shards stream"),
    ],
)
def test_settings_that_cannot_preload_are_refused(values, says):
    with pytest.raises(ConfigError, match=says):
        DataConfig(preload=True, **values)


@pytest.mark.parametrize("case", ["right", "left", "pad_to_context"])
def test_memo_tokenizer_batches_equal_the_tokenizers(case):
    """Captions tokenised once and reassembled: the same ids and masks as tokenising each batch, for batches that
    mix stored and new captions, truncated ones (eos kept) and either padding side."""
    from sharpclip.data.transforms import MemoTokenizer, TextTokenizer

    tok = build_word_tokenizer(["a red circle left of a small blue square with stripes"], model_max_length=12)
    tok.padding_side = "left" if case == "left" else "right"
    direct = TextTokenizer(tok, context_length=12, pad_to_context=case == "pad_to_context")
    memo = MemoTokenizer(direct)
    words = ["a", "red", "circle", "left", "of", "a", "small", "blue", "square", "with", "stripes"]
    captions = [" ".join(words[: 1 + (7 * i) % len(words)]) for i in range(9)] + [" ".join(words * 2)]  # one truncated
    batches = [captions[:4], captions[2:8], captions[::-1], captions[5:6] * 3]
    for batch in batches:
        ids, mask = memo(batch)
        ids_ref, mask_ref = direct(batch)
        assert torch.equal(ids, ids_ref) and torch.equal(mask, mask_ref), batch
    assert len(memo.rows) == len(set(captions))
    ids, mask = memo(captions[-1:])  # the truncated caption: the whole context, eos kept last
    assert int(mask.sum()) == 12 and int(ids[0, -1]) == tok.eos_token_id
