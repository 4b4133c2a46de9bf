"""build_loader end to end on fixtures (multi-caption, short captions), and `sharpclip validate-data`."""

from __future__ import annotations

import json

import torch
from data_helpers import FIXTURES, cfg_for, copy_fixture, prep

from sharpclip.cli import main
from sharpclip.data import build_loader
from sharpclip.data.validate import detect_format, validate
from sharpclip.models.tokenizer import build_word_tokenizer

TOK = build_word_tokenizer(["a cat number caption red blue green square circle round thing seen from above"])


def test_karpathy_caption_choice_all_keeps_an_images_captions_in_one_batch():
    loader = build_loader(cfg_for("karpathy", caption_choice="all"), "test", prep(TOK, 8), batch_size=10)
    (batch,) = list(loader)
    assert batch.ids[:5] == [f"1002#{k}" for k in range(5)] and len(batch) == 10
    assert batch.groups.tolist() == [0] * 5 + [1] * 5


def test_random_caption_choice_is_deterministic_per_epoch_and_varies_across_epochs():
    cfg = cfg_for("karpathy")
    loader = build_loader(cfg, "test", prep(TOK, 8), batch_size=2, seed=3)
    draws = []
    for epoch in range(6):
        loader.set_epoch(epoch)
        draws.append(tuple(next(iter(loader)).input_ids[:, 7].tolist()))
    loader.set_epoch(2)
    assert tuple(next(iter(loader)).input_ids[:, 7].tolist()) == draws[2]
    assert len(set(draws)) > 1


def test_short_captions_are_tokenised_beside_long_ones_and_fall_back_to_the_caption():
    batch = next(iter(build_loader(cfg_for("generic"), "train", prep(TOK, 8), batch_size=3, train=False)))
    assert batch.short_input_ids.shape == batch.input_ids.shape
    a = batch.ids.index("a")
    b = batch.ids.index("b")
    assert batch.short_attention_mask[a].sum() == 3  # bos "red" eos
    assert batch.short_input_ids[b].tolist() == batch.input_ids[b].tolist()
    assert batch.groups[a] == batch.groups[b]  # group g1


def test_detect_format_from_release_files():
    expected = {
        "docci": "docci",
        "dci": "dci",
        "long_dci": "long_dci",
        "urban1k": "urban1k",
        "sharegpt4v": "sharegpt4v",
        "vg": "vg",
        "ultraedit": "ultraedit",
        "karpathy": "karpathy",
        "generic": "generic",
    }
    assert {name: detect_format(FIXTURES / name) for name in expected} == expected


def test_validate_counts_duplicates_and_truncation(tmp_path):
    root = tmp_path / "pairs"
    root.mkdir()
    copy_fixture("generic", tmp_path)
    long = " ".join(["word"] * 100)
    rows = [
        {"image": "../generic/img/a.jpg", "caption": "same text"},
        {"image": "../generic/img/a.jpg", "caption": "same text"},
        {"image": "../generic/img/b.jpg", "caption": long},
        {"image": "../generic/img/c.jpg", "caption": "x"},
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rep = validate(cfg_for("generic", root), "train")
    assert (rep.samples, rep.images, rep.ok) == (4, 4, True)
    assert rep.duplicate_captions == 2 and rep.duplicate_images == 2
    assert rep.token_lengths["max"] == 102 and rep.truncated_share == {"77": 0.25, "248": 0.0}


def test_cli_exit_code_summary_and_json_on_errors(tmp_path, capsys):
    root = copy_fixture("docci", tmp_path)
    (root / "images" / "test_00000.jpg").unlink()
    (root / "images" / "test_00001.jpg").write_bytes(b"garbage")
    out = tmp_path / "report.json"
    assert main(["validate-data", str(root), "--split", "test", "--json", str(out)]) == 1
    text = capsys.readouterr().out
    assert "1 missing file" in text and "1 unreadable image" in text and "FAILED: 2 errors" in text
    report = json.loads(out.read_text())
    assert (
        report["ok"] is False
        and report["samples"] == 3
        and report["error_counts"] == {"missing file": 1, "unreadable image": 1}
    )
    assert main(["validate-data", str(FIXTURES / "urban1k")]) == 0
    assert '"ok": true' in capsys.readouterr().out


def test_cli_validates_a_recipe_and_reports_a_bad_path(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"data:\n  format: vg\n  root: {FIXTURES / 'vg'}\n")
    assert main(["validate-data", str(recipe), "--split", "val"]) == 0
    assert "vg val" in capsys.readouterr().out
    assert main(["validate-data", str(tmp_path / "nowhere")]) == 2
    assert "no such config file or data folder" in capsys.readouterr().err


def test_the_workers_base_seed_differs_per_rank_and_repeats_per_epoch():
    """Workers draw augmentation from a base seed the loader's own generator gives: never the same on two ranks."""
    cfg = cfg_for("karpathy")
    loaders = [build_loader(cfg, "test", prep(TOK, 8), batch_size=2, seed=3, rank=r, world_size=2) for r in (0, 1)]

    def base_seed(loader, epoch):
        loader.set_epoch(epoch)
        return int(torch.empty((), dtype=torch.int64).random_(generator=loader.generator))

    assert base_seed(loaders[0], 1) != base_seed(loaders[1], 1)
    assert base_seed(loaders[0], 1) == base_seed(loaders[0], 1) != base_seed(loaders[0], 2)
