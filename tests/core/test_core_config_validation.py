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
        ("data.max_image_pixels=0", "data.max_image_pixels"),
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
