"""Typed config: YAML plus dotted overrides; unknown keys and wrong types are errors naming the key and source."""

from __future__ import annotations

import re

import pytest

from sharpclip.cli import main
from sharpclip.config import ConfigError, load_config, to_yaml


def test_defaults_yaml_and_overrides_merge_in_order(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  lr: 2.0e-6\n  epochs: 10\nloss:\n  terms:\n    contrastive: {loss: hn_clip}\n")
    cfg = load_config(recipe, ["train.epochs=3", "loss.terms.contrastive.params.gamma=0.75"])
    assert cfg.train.lr == 2e-6 and cfg.train.epochs == 3
    assert cfg.loss.terms["contrastive"].loss == "hn_clip"
    assert cfg.loss.terms["contrastive"].params == {"gamma": 0.75}
    assert load_config(None, []).train.batch_size == 128  # untouched defaults stay


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.lrr=1", "train.lrr"),
        ("train.lr=fast", "train.lr"),
        ("model.context_length=long", "model.context_length"),
        ("train.accumulation=sometimes", "train.accumulation"),
        ("train.micro_batch_size=48", "train.batch_size"),
        ("train.lr", "key=value"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(None, [override])


def test_a_recipes_terms_replace_the_default_term(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("loss:\n  terms:\n    hn: {loss: hn_clip}\n    tok: {loss: filip, weight: 0.5}\n")
    assert list(load_config(recipe).loss.terms) == ["hn", "tok"]
    assert list(load_config().loss.terms) == ["contrastive"]
    assert list(load_config(None, ["loss.terms.hn.loss=hn_clip"]).loss.terms) == ["hn"]


def test_bad_yaml_names_file_and_key(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("train:\n  lr: 1.0\n  warmup: 5\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*train\.warmup"):
        load_config(recipe)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_resolved_yaml_round_trips(tmp_path):
    cfg = load_config(None, ["loss.terms.contrastive.loss=sigmoid", "train.seed=7"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


def test_cli_help_lists_subcommands_and_config_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "config" in out and "objectives" in out


def test_cli_config_prints_resolved_and_rejects_unknown_keys(capsys, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  lr: 0.5\n")
    assert main(["config", str(recipe), "train.seed=3"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.5" in out and "seed: 3" in out
    assert main(["config", str(recipe), "train.nope=1"]) == 2
    assert "train.nope" in capsys.readouterr().err


def test_cli_objectives_lists_every_registered_loss(capsys):
    assert main(["objectives"]) == 0
    out = capsys.readouterr().out
    for name in ("infonce", "hn_clip", "filip", "edit_negatives", "distill_cosine", "sigmoid"):
        assert name in out
    assert "text_short        (B, D)        the short caption's embedding (CLIP-IN eq. 8)  [needs short captions" in out


def test_a_removed_key_says_what_replaced_it(tmp_path):
    """train.diagnostics_gamma was a second source of HN-CLIP's γ; the diagnostics now read the hn_clip term's."""
    replaced = r"read γ from the objective's hn_clip term \(loss\.terms\.<name>\.params\.gamma"
    with pytest.raises(
        ConfigError, match=r"'train\.diagnostics_gamma' is no longer a setting: the gradient diagnostics " + replaced
    ):
        load_config(None, ["train.diagnostics_gamma=0.25"])
    old = tmp_path / "old.yaml"
    old.write_text("train:\n  diagnostics_every: 10\n  diagnostics_gamma: 0.5\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(old))}: key 'train\.diagnostics_gamma' is no longer"):
        load_config(old)


HN_RECIPE = "loss:\n  terms:\n    hn: {loss: hn_clip, params: {gamma: 0.5}}\n    tok: {loss: filip, weight: 1.0}\n"


def test_an_objective_is_replaced_with_colon_equals_and_a_term_deleted_with_tilde(tmp_path, caplog):
    from sharpclip.config import split_args

    recipe = tmp_path / "r.yaml"
    recipe.write_text(HN_RECIPE)
    with caplog.at_level("WARNING", logger="sharpclip.config"):  # `=` merges, and says what it kept
        merged = load_config(recipe, ["loss.terms={clip: {loss: infonce}}"])
    assert list(merged.loss.terms) == ["hn", "tok", "clip"]
    assert "keeps hn, tok" in caplog.text and "loss.terms:={clip: {loss: infonce}}" in caplog.text
    replaced = load_config(recipe, ["loss.terms:={clip: {loss: infonce}}"])
    assert list(replaced.loss.terms) == ["clip"] and replaced.loss.terms["clip"].loss == "infonce"
    files, overrides = split_args([str(recipe), "~loss.terms.tok", "~/r.yaml"])
    assert overrides == ["~loss.terms.tok"] and files[0] == str(recipe) and not files[1].startswith("~")
    assert list(load_config(recipe, overrides).loss.terms) == ["hn"]
    term = load_config(recipe, ["loss.terms.hn:={loss: infonce}", "~loss.terms.tok"]).loss.terms  # an arm's term
    assert list(term) == ["hn"] and term["hn"].loss == "infonce" and term["hn"].params == {}
    cleared = load_config(recipe, ["~loss.terms.hn.params", "train.lr=0.5", "~train.lr"])  # a setting: its default
    assert cleared.loss.terms["hn"].params == {} and cleared.train.lr == load_config().train.lr
    assert list(load_config(recipe, ["~loss.terms"]).loss.terms) == ["contrastive"]  # none left: the default term


@pytest.mark.parametrize(
    ("override", "message"),
    [("~loss.terms.nope", r"no 'loss\.terms\.nope' to delete \(loss\.terms holds: hn, tok\)"),
     ("loss.terms.tok=null", r"not Optional; to delete an entry of a mapping write ~loss\.terms\.tok")],
)  # fmt: skip
def test_a_deletion_that_cannot_be_made_says_what_to_write(tmp_path, override, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(HN_RECIPE)
    with pytest.raises(ConfigError, match=message):
        load_config(recipe, [override])


def test_cli_config_prints_the_objectives_terms(capsys, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(HN_RECIPE)
    assert main(["config", str(recipe), "loss.terms.tok.weight=0.25"]) == 0
    assert capsys.readouterr().out.startswith("# objective: 1·hn[hn_clip gamma=0.5] + 0.25·tok[filip]\n")
