"""The feature table: every loss input has a producer, the encoder produces each feature as declared, and an
objective reading what does not exist, or what the data cannot provide, is refused before training starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _support.tiny_files import tiny_config, write_generic
from _support.tiny_run import ToyLoader, toy_model
from sharpclip.config import ConfigError, LossConfig, TermConfig
from sharpclip.losses import registry
from sharpclip.train.features import FEATURES, FeatureEncoder, build_objective
from sharpclip.train.run import run_train
from sharpclip.train.step import objective_inputs


@pytest.mark.parametrize("loss", registry.names())
def test_every_input_of_every_registered_loss_has_a_producer(loss):
    """Required inputs are read by their own name, so the table must produce each; an optional one either has a
    producer or keeps the loss's default (None) unless a config maps it to a feature."""
    spec = registry.get(loss)
    missing = [arg for arg in spec.inputs if arg not in FEATURES]
    assert not missing, f"{loss} reads {missing}, which no feature produces"
    objective = build_objective(LossConfig(terms={"t": TermConfig(loss)}), monitor=False)
    bound = objective.terms[0].inputs
    assert set(spec.inputs) <= bound.keys()
    assert {a for a in spec.optional_inputs if a in FEATURES} <= bound.keys()


def test_the_encoder_produces_every_feature_with_its_declared_shape():
    model = toy_model()
    batch = next(iter(ToyLoader(model.tokenizer, n=8, batch_size=8, edits=True)))
    batch.short_input_ids, batch.short_attention_mask = batch.input_ids.flip(0), batch.attention_mask.flip(0)
    names = [n for n, f in FEATURES.items() if f.kind in ("row", "edit") and f.name != "teacher"]
    encoder = FeatureEncoder(model, names, teacher=None)
    feats = objective_inputs(encoder, encoder(batch), batch)
    sizes = {"B": len(batch), "E": len(batch.edit_source), "D": feats["image"].shape[1]}
    for name in names:
        feature, value = FEATURES[name], feats[name]
        assert value.ndim == len(feature.dims), name
        for dim, n in zip(feature.dims, value.shape, strict=True):
            assert sizes.setdefault(dim, n) == n, (name, dim)
        assert (value.dtype == torch.bool) is feature.mask, name
    assert sizes["E"] == 4 and torch.equal(feats["source_text"], feats["text"][batch.edit_source])
    assert not torch.allclose(feats["text_short"], feats["text"])  # the short caption, not the long one
    assert torch.allclose(feats["text_frozen"], feats["text"], atol=1e-6)  # the initial weights, frozen
    assert not feats["text_frozen"].requires_grad and torch.equal(feats["student"], feats["text"])
    assert feats["logit_scale"] is model.logit_scale and feats["logit_bias"] is None


def test_the_encoder_computes_only_what_the_objective_reads():
    model = toy_model()
    objective = build_objective(LossConfig(terms={"c": TermConfig("infonce")}))
    encoder = FeatureEncoder(model, objective.feature_keys)
    batch = next(iter(ToyLoader(model.tokenizer, n=8, batch_size=8)))
    assert set(encoder(batch)) == {"image", "text"} and not encoder.towers
    frozen = build_objective(LossConfig(terms={"hn": TermConfig("hn_clip", inputs={"reference_text": "text_frozen"})}))
    assert set(FeatureEncoder(model, frozen.feature_keys).towers) == {"frozen_text_tower"}


def test_a_feature_needing_a_teacher_without_one_is_refused():
    objective = build_objective(LossConfig(terms={"d": TermConfig("distill_cosine")}), monitor=False)
    with pytest.raises(ValueError, match="teacher"):
        FeatureEncoder(toy_model(), objective.feature_keys)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_generic(tmp_path_factory.mktemp("data"))  # captions, no short captions, no edit pairs


@pytest.mark.parametrize(
    ("term", "key", "what"),
    [
        ("{loss: infonce, inputs: {text: text_short}}", "loss.terms.s.inputs.text", "short captions"),
        ("{loss: edit_negatives}", "loss.terms.s.inputs.source_image", "instruction-edit pairs"),
    ],
)
def test_an_input_the_data_cannot_provide_is_an_error_before_the_first_step(data, tmp_path, term, key, what):
    run = tmp_path / "run"
    cfg = tiny_config(data, run, f"loss.terms.s={term}")
    with pytest.raises(ConfigError, match=rf"^{key}: feature '\w+' needs {what} in the data, but "
                                          r"data.format=generic \(split 'train'\) has none; "):  # fmt: skip
        run_train(cfg)
    assert not (run / "metrics.jsonl").exists()  # refused before step 1


def test_a_misspelt_feature_fails_at_start_naming_the_key(data, tmp_path):
    """HN-CLIP Table 3c with one letter missing used to train recomputed-Ḡ HN-CLIP without a word."""
    cfg = tiny_config(data, tmp_path / "run", "loss.terms.hn={loss: hn_clip, inputs: {reference_text: text_frozn}}")
    with pytest.raises(ConfigError, match=r"^loss\.terms\.hn\.inputs\.reference_text: 'text_frozn' is no feature"):
        run_train(cfg)


def test_short_captions_in_the_data_train(tmp_path):
    """The same term on data with short captions trains (the check reads what the loader provides)."""
    root = write_generic(tmp_path / "data")
    for split in ("train", "test"):
        path = root / f"{split}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**r, "short_caption": r["caption"][:20]}) + "\n" for r in rows))
    run = tmp_path / "run"
    run_train(tiny_config(root, run, "loss.terms.s={loss: infonce, inputs: {text: text_short}}", "train.max_steps=1"))
    steps = [json.loads(line) for line in Path(run / "metrics.jsonl").read_text().splitlines()]
    assert "s" in steps[0] and "infonce_monitor" in steps[0]


def test_optimiser_betas_eps_and_schedule_shape_are_keys() -> None:
    from sharpclip.config import ConfigError, load_config
    from sharpclip.train.optim import build_optimizer, build_scheduler, lr_factor

    cfg = load_config(None, ["train.beta1=0.8", "train.beta2=0.95", "train.eps=1e-8", "train.schedule=linear"])
    model = torch.nn.Linear(3, 2)
    opt = build_optimizer(model, 1.0, 0.0, None, (cfg.train.beta1, cfg.train.beta2), cfg.train.eps)
    assert opt.param_groups[0]["betas"] == (0.8, 0.95) and opt.param_groups[0]["eps"] == 1e-8
    sched = build_scheduler(opt, 2, 10, 0.1, cfg.train.schedule)
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[:2] == [0.5, 1.0]  # warmup, then straight down towards 0.1 at step 10
    assert seen[2:] == pytest.approx([1 - 0.9 * k / 8 for k in range(8)])
    assert [lr_factor(s, 2, 10, 0.1, "constant") for s in (0, 1, 5, 9)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor(6, 2, 10, 0.0, "cosine") == pytest.approx(0.5)
    with pytest.raises(ConfigError, match=r"train\.schedule"):
        load_config(None, ["train.schedule=step"])
    with pytest.raises(ConfigError, match=r"train\.beta2"):
        load_config(None, ["train.beta2=1.0"])


def test_trainer_builds_adamw_and_schedule_from_the_new_keys(tmp_path: Path) -> None:
    from _support.tiny_run import train_config
    from sharpclip.config import LossConfig as _Loss
    from sharpclip.train.trainer import Trainer

    model = toy_model()
    cfg = train_config(str(tmp_path / "run"), beta1=0.7, beta2=0.9, eps=1e-7, schedule="constant", warmup_steps=0)
    objective = build_objective(_Loss(terms={"contrastive": TermConfig("infonce")}))
    trainer = Trainer(model, objective, ToyLoader(model.tokenizer), cfg, tmp_path / "run", lambda d: None)
    group = trainer.optimizer.param_groups[0]
    assert group["betas"] == (0.7, 0.9) and group["eps"] == 1e-7
    assert trainer.scheduler.lr_lambdas[0](trainer.total_steps - 1) == 1.0  # constant: no decay at the end
