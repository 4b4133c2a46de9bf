"""Config validation at load: each bad value is a ConfigError naming its key, before any work."""

from __future__ import annotations

import pytest

from sharpclip.config import ConfigError, load_config, to_yaml
from sharpclip.train.optim import build_optimizer


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.batch_size=0", "train.batch_size"),
        ("train.micro_batch_size=0", "train.micro_batch_size"),  # was a ZeroDivisionError
        ("train.lr=0", "train.lr"),
        ("train.lr=-1e-4", "train.lr"),
        ("train.lr=nan", "train.lr"),
        ("train.lr=inf", "train.lr"),
        ("train.keep_last=0", "train.keep_last"),
        ("train.nan_patience=0", "train.nan_patience"),
        ("train.warmup_steps=-1", "train.warmup_steps"),
        ("train.min_lr_ratio=2", "train.min_lr_ratio"),
        ("train.best_metric=mean_R1", "train.best_metric"),  # a typo used to mean: no best.json, ever
        ("train.module_lr={backbone.text_model: 0}", "train.module_lr.backbone.text_model"),
        ("train.lr=1e38", "train.lr"),  # was AdamW's 50-line overflow traceback
        ("train.lr=2e6", "train.lr"),
        ("train.module_lr={backbone.text_model: 1e38}", "train.module_lr.backbone.text_model"),
        ("train.dist_timeout_min=1e38", "train.dist_timeout_min"),  # was an OverflowError of timedelta
        ("data.max_image_pixels=0", "data.max_image_pixels"),
        ("train.seed=99999999999999999999999", "train.seed"),  # was "Overflow when unpacking long long", no key
        ("model.logit_scale_init=1e308", "model.logit_scale_init"),  # was fill_'s 26-line overflow traceback
        ("model.logit_scale_init=-1e308", "model.logit_scale_init"),
    ],
)
def test_a_bad_value_names_its_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_best_metric_lists_the_validation_metrics():
    with pytest.raises(ConfigError, match=r"t2i_R@1.*mean_R@1"):
        load_config(None, ["train.best_metric=R@1"])
    assert load_config(None, ["train.best_metric=i2t_R@5"]).train.best_metric == "i2t_R@5"


@pytest.mark.parametrize("text, kind", [("- train\n- lr\n", "list"), ("42\n", "int")])
def test_a_yaml_file_whose_top_level_is_not_a_mapping_is_refused(tmp_path, text, kind):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"recipe.yaml: the top level must be a mapping.*not a {kind}"):
        load_config(path)


def test_a_module_lr_prefix_that_matches_no_parameter_is_refused_when_the_model_exists():
    from _support.tiny_run import toy_model

    model = toy_model()
    with pytest.raises(ConfigError, match=r"train\.module_lr\.backbone\.txt_model: matches no parameter"):
        build_optimizer(model, 1e-4, 0.1, {"backbone.txt_model": 1e-5})
    build_optimizer(model, 1e-4, 0.1, {"backbone.text_model": 1e-5})  # a real prefix is fine


@pytest.mark.parametrize(
    "key, value, instead",
    [
        ("image_size", "32", "model.tiny.image_size"),
        ("image_mean", "[0.5, 0.5, 0.5]", "model.processor"),
        ("image_std", "[0.5, 0.5, 0.5]", "model.processor"),
        ("context_length", "248", "model.context_length"),
    ],
)
def test_a_removed_preprocessing_key_says_the_model_decides_and_what_to_set(tmp_path, key, value, instead):
    """The model's preprocessing replaced these data keys everywhere; an old config must not load as if they worked."""
    path = tmp_path / "old.yaml"
    path.write_text(f"data:\n  format: generic\n  {key}: {value}\n")
    for source, load in ((f"override 'data.{key}", lambda: load_config(None, [f"data.{key}={value}"])),
                         ("old.yaml", lambda: load_config(path))):  # fmt: skip
        removed = rf"{source}.*data\.{key}' is no longer a setting: the model decides"
        with pytest.raises(ConfigError, match=removed) as err:
            load()
        assert instead in str(err.value)
    assert f"{key}:" not in to_yaml(load_config(None)).split("data:")[1].split("loss:")[0]  # not in `sharpclip config`


def _schema_fields(node=None, prefix=""):
    """(dotted key, declared type) of every leaf of the schema, nested sections walked."""
    import dataclasses
    import typing

    from sharpclip.config import Config

    node = node or Config
    hints = typing.get_type_hints(node)
    for f in dataclasses.fields(node):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from _schema_fields(kind, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", kind


def _holds(kind, *types) -> bool:
    import typing

    args = typing.get_args(kind)
    return kind in types or any(_holds(a, *types) for a in args if typing.get_origin(kind) is not dict)


def test_every_number_of_the_schema_has_a_declared_range():
    """New numeric settings must say which values they accept (config.RANGES); mappings of numbers by `key.*`."""
    import typing

    from sharpclip.config import declared_range

    missing = []
    for key, kind in _schema_fields():
        if key.startswith("loss.") or key == "train.guards":  # checked by the objective / GuardConfig
            continue
        if typing.get_origin(kind) is dict and typing.get_args(kind)[1] is float:
            key += ".x"
        elif typing.get_origin(kind) in (list, dict) or not _holds(kind, int, float) or kind is bool:
            continue
        if declared_range(key) is None:
            missing.append(key)
    assert missing == []


NOT_PATHS = {
    "model.kind", "model.activation", "model.text_encoder", "model.adapter.method", "model.adapter.towers",
    "model.adapter.modules", "data.format", "data.train_split", "data.eval_split", "data.num_workers",
    "data.on_bad_sample", "data.caption_choice", "data.docci_test", "data.dci_caption", "data.list_split",
    "data.overlap", "data.image_alpha", "data.coco_flickr_protocol", "data.image_field", "data.caption_field",
    "data.short_caption_field", "data.id_field", "data.group_field", "data.synthdense.test_variants",
    "data.edits_format", "data.edits_split", "train.accumulation", "train.device", "train.precision", "train.layout",
    "train.schedule",
    "train.best_metric", "train.wandb_project", "train.wandb_name", "train.stop_signals", "eval.suites", "eval.split",
    "eval.image_alpha",
    "eval.device", "eval.precision", "eval.num_workers",
}  # fmt: skip


def test_every_string_setting_is_classified_as_a_path_or_not():
    """A new string setting must be put in config.PATH_KEYS (its `~` expanded) or in NOT_PATHS here."""
    from sharpclip.config import PATH_KEYS

    strings = {k + (".*" if "dict" in str(t) else "") for k, t in _schema_fields() if _holds(t, str)}
    strings -= {"loss.terms.*", "eval.data_options.*"}  # term names, per-suite DataConfig values
    assert strings - set(PATH_KEYS) - NOT_PATHS == set()
    assert set(PATH_KEYS) & NOT_PATHS == set()


@pytest.mark.parametrize(
    "override, key, says",
    [
        ("data.synthdense.resolution=0", "data.synthdense.resolution", "must be >= 1, got 0"),
        ("data.synthdense.resolution=-8", "data.synthdense.resolution", "must be >= 1, got -8"),
        ("data.synthdense.max_objects=10", "data.synthdense.max_objects", "must be <= 9, got 10: a scene is a 3×3"),
        ("data.synthdense.workers=0", "data.synthdense.workers", "must be >= 1"),
        ("model.tiny.width=0", "model.tiny.width", "must be >= 1"),
        ("model.tiny.image_size=-32", "model.tiny.image_size", "must be >= 1"),
        ("model.rope_theta=0", "model.rope_theta", "must be > 0"),
        ("model.adapter.dropout=1", "model.adapter.dropout", "must be < 1"),
        ("model.logit_scale_init=nan", "model.logit_scale_init", "must be a finite number, got nan"),
        ("model.context_length=0", "model.context_length", "must be >= 1"),
        ("train.lr=1e-12", "train.lr", "must be >= 1e-10, got 1e-12: an AdamW step"),
        ("train.module_lr={backbone.text_model: 1e-11}", "train.module_lr.backbone.text_model", "must be >= 1e-10"),
        ("train.grad_clip=inf", "train.grad_clip", "must be a finite number, got inf"),
        ("train.weight_decay=nan", "train.weight_decay", "must be a finite number"),
        ("train.dist_timeout_min=inf", "train.dist_timeout_min", "must be a finite number"),
        ("data.augment.gray_scale_prob=1.5", "data.augment.gray_scale_prob", "must be <= 1"),
        ("data.prefetch_factor=0", "data.prefetch_factor", "must be >= 1"),
        ("eval.chunk_size=0", "eval.chunk_size", "must be >= 1"),
        ("model.freeze.text_unlocked_layers=-1", "model.freeze.text_unlocked_layers", "must be >= 0"),
    ],
)
def test_a_number_out_of_its_declared_range_is_an_error_naming_the_key(override, key, says):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value).startswith(f"{key}: {says}") and "\n" not in str(err.value)


def test_the_learning_rate_floor_is_where_an_update_still_moves_a_weight():
    """At lr = 1e-10 an fp32 weight of magnitude 1e-3 still changes (half its spacing is 5.8e-11) and one of 1e-2
    does not (4.7e-10): the floor refuses only rates that move no weight of the usual magnitudes."""
    import torch

    assert load_config(None, ["train.lr=1e-10"]).train.lr == 1e-10
    w = torch.tensor([1e-3, 1e-2], dtype=torch.float32)
    assert (w + 1e-10 != w).tolist() == [True, False]


@pytest.mark.parametrize("overrides", [["train.weight_decay=1e300"], ["train.lr=0.5", "train.weight_decay=2"],
                                       ["train.module_lr={backbone: 1.0}", "train.weight_decay=1"]])  # fmt: skip
def test_a_weight_decay_that_erases_the_weights_in_a_step_is_refused_naming_both_knobs(overrides):
    """AdamW multiplies each decayed weight by 1 − lr·weight_decay per step: at lr·weight_decay ≥ 1 (the largest of
    train.lr and train.module_lr) every weight is zeroed or flipped. 1e300 used to be stopped mid-run with only
    "lower train.lr"."""
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    message = str(err.value)
    assert message.startswith("train.weight_decay: ") and "lower train.weight_decay" in message and "\n" not in message
    assert "or the learning rate (typically 1e-6-1e-3)" in message
    assert load_config(None, ["train.lr=0.5", "train.weight_decay=1.9"]).train.weight_decay == 1.9  # 0.95 < 1


def test_a_yaml_recipe_out_of_range_is_refused_by_sharpclip_config_in_one_line(tmp_path, capsys):
    from sharpclip.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  synthdense:\n    resolution: 0\n")
    assert main(["config", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "data.synthdense.resolution: must be >= 1, got 0" in err


def test_a_loss_parameter_out_of_range_is_an_error_naming_the_key():
    from sharpclip.train.run import check_config

    for params, key in (
        ("{chunk_size: 0}", "chunk_size"),
        ("{gamma: .nan}", "gamma"),
        ("{duplicate_threshold: .inf}", "duplicate_threshold"),
    ):
        loss = "filip" if key == "chunk_size" else "hn_clip"
        cfg = load_config(None, [f"loss.terms={{t: {{loss: {loss}, params: {params}}}}}"])
        with pytest.raises(ConfigError, match=rf"^loss\.terms\.t\.params\.{key}: must be a finite number"):
            check_config(cfg)


def test_a_tilde_is_the_home_folder_in_every_path_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  output_dir: ~/runs/x\ndata:\n  root: ~/data\n  shards: [~/s-0.tar, s-1.tar]\n")
    suite = "eval.data_options={dci: {list_file: ~/DCI_test.json}}"
    cfg = load_config(recipe, ["eval.roots={a: ~/r}", "model.name=~/ckpt", "eval.output_dir=~", suite])
    home = str(tmp_path / "home")
    assert cfg.train.output_dir == f"{home}/runs/x" and cfg.data.root == f"{home}/data"
    assert cfg.data.shards == [f"{home}/s-0.tar", "s-1.tar"] and cfg.eval.roots == {"a": f"{home}/r"}
    assert cfg.model.name == f"{home}/ckpt" and cfg.eval.output_dir == home
    assert cfg.eval.data_options["dci"]["list_file"] == f"{home}/DCI_test.json"
    assert "~" not in to_yaml(cfg)


def test_a_bare_tilde_in_yaml_is_null_and_the_error_says_so(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  output_dir: ~\n")
    with pytest.raises(ConfigError, match=r"r\.yaml: key 'train\.output_dir'.*a bare ~ is YAML's null"):
        load_config(recipe)


@pytest.mark.parametrize(
    "override, meant",
    [
        ("train.learning_rate=1e-4", "train.lr"),  # transformers' name
        ("train.batchsize=8", "train.batch_size"),
        ("data.batch_size=8", "train.batch_size"),  # the right leaf in another section
        ("trian.lr=1e-4", "train.lr"),  # an unknown section
        ("train.lr_min_ratio=0", "train.min_lr_ratio"),
        ("train.epoch=3", "train.epochs"),
        ("loss.terms.hn.wieght=2", "loss.terms.hn.weight"),
    ],
)
def test_a_near_miss_key_suggests_the_real_one(override, meant):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    key = override.split("=")[0]
    assert f"'{key}' is not a setting; did you mean {meant}" in str(err.value)


def test_a_near_miss_key_in_a_yaml_recipe_names_the_file_and_the_real_key(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  learning_rate: 1e-4\n")
    with pytest.raises(ConfigError, match=r"r\.yaml: 'train\.learning_rate' is not a setting; did you mean train\.lr"):
        load_config(recipe)
