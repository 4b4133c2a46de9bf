"""Every demo arm is a valid config whose objective builds, the arms differ only where they should, and the arm
selection refuses unknown names."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from sharpclip.demo import DemoOptions, profile_for, select
from sharpclip.demo.plan import PROFILES, arms
from sharpclip.demo.stages import a2_config, arm_config, corpus, init_config, init_key, validation_corpus
from sharpclip.train.features import build_objective


@pytest.mark.parametrize("arm", arms(full=True), ids=lambda a: a.name)
def test_every_arm_is_a_valid_config(arm, tmp_path):
    p = PROFILES["default"]
    cfg = arm_config(p, arm, tmp_path / "init", tmp_path / "data", tmp_path / "run", seed=3, progress=False)
    objective = build_objective(cfg.loss)
    assert cfg.train.max_steps == p.steps and cfg.train.seed == 3 and cfg.train.batch_size == p.batch_size
    assert cfg.model.context_length == p.context_length  # the init's 32 positions stretched to the dense captions'
    learnable = arm.name == "hn_learn_s"
    assert cfg.model.logit_scale_learnable is learnable
    assert (cfg.model.adapter.method == "lora") is arm.name.startswith("lora")
    assert ("text_frozen" in objective.feature_keys) is (arm.name == "hn_frozen")
    assert (cfg.data.train_split == "train+edits") is arm.name.startswith("clipin")
    assert (cfg.train.diagnostics_every > 0) is (arm.name == "infonce")
    exact = arm.name.endswith("_exact") or arm.name.startswith("clipin")  # edit pairs need one matrix
    assert cfg.train.accumulation == ("exact" if exact else "per_micro_batch")
    assert p.micro_batch_size == 16 and p.batch_size == 128  # the paper's 16 × 8
    if exact:  # one 128 × 128 matrix, encoded in one pass (speed only)
        assert (cfg.train.micro_batch_size, cfg.train.encode_batch_size) == (128, 0)
    else:  # a matrix per micro-batch of 16, four micro-batches encoded a pass (speed only)
        assert (cfg.train.micro_batch_size, cfg.train.encode_batch_size) == (16, 64)
    assert cfg.data.preload  # decoded once for the 10 epochs
    assert cfg.data.synthdense.test_variants == "details" and cfg.data.synthdense.test_families >= 300


def test_test_changed_objects_reaches_the_test_and_validation_families_but_not_the_init():
    p = profile_for(DemoOptions(sizes=("test_changed_objects=3",)))
    assert corpus(p).test_changed_objects == validation_corpus(p).test_changed_objects == 3
    assert corpus(p).train_detail_pairs == PROFILES["default"].train_detail_pairs  # the training pairs stay one detail
    assert init_key(p) == init_key(profile_for(DemoOptions()))  # a cached init is reused on the new test families


def test_init_config_and_key():
    p = PROFILES["default"]
    cfg = init_config(p, Path("/tmp/x"), progress=False)
    assert cfg.data.train_split == "coarse_colours" and cfg.model.tiny.context_length == p.init_context_length
    assert cfg.train.max_steps == p.init_steps and cfg.model.logit_scale_learnable
    assert init_key(p) == init_key(PROFILES["default"]) != init_key(PROFILES["quick"])


def test_stage_a2_stretches_stage_a_and_reads_captions_with_random_details():
    p = PROFILES["default"]
    cfg = a2_config(p, Path("/tmp/x"), progress=False)
    assert cfg.model.name == "/tmp/x/stage_a/model" and cfg.model.context_length == p.context_length
    assert cfg.data.train_split == "pretrain_noisy" and cfg.model.logit_scale_learnable
    assert cfg.train.max_steps == p.a2_steps and cfg.train.output_dir == "/tmp/x/stage_a2/run"
    assert init_key(replace(p, a2_steps=p.a2_steps + 1)) != init_key(p)  # both stages are under the one key
    assert init_key(replace(p, a2_split="pretrain_layout")) != init_key(p)


def test_select_arms():
    names = [a.name for a in select(DemoOptions(only=("hn_frozen",)))]
    assert names == ["infonce", "hn_frozen"]
    assert [a.name for a in select(DemoOptions())] == ["infonce", "hn"]  # HN-CLIP's comparison, ≤ 5 min cached
    assert [a.name for a in select(DemoOptions(quick=True))] == ["infonce", "hn", "clipin"]  # CI: both papers
    with pytest.raises(ValueError, match="unknown nope"):
        select(DemoOptions(only=("nope",)))


def test_set_changes_one_size_of_the_mode_and_refuses_unknown_fields():
    from sharpclip.demo import profile_for

    p = profile_for(DemoOptions(steps=40, sizes=("lr=3e-4", "train_detail_pairs=0", "a2_split=pretrain_layout")))
    assert (p.lr, p.train_detail_pairs, p.a2_split, p.steps) == (3e-4, 0, "pretrain_layout", 40)
    assert profile_for(DemoOptions(quick=True, task="unseen-details")) == PROFILES["quick"]
    with pytest.raises(ValueError, match=r"FIELD one of .*train_detail_pairs"):
        profile_for(DemoOptions(sizes=("nope=1",)))
    with pytest.raises(ValueError, match="train_detail_pairs takes a int"):
        profile_for(DemoOptions(sizes=("train_detail_pairs=many",)))


def test_unseen_details_is_the_profile_as_it_was_and_keeps_its_cache_key():
    from sharpclip.demo import profile_for

    for quick in (False, True):
        assert profile_for(DemoOptions(quick=quick, task="unseen-details")) == PROFILES["quick" if quick else "default"]
    # the keys of the inits cached before the task variants existed: a cache made then is still found
    assert (init_key(PROFILES["default"]), init_key(PROFILES["quick"])) == ("be1816d95ee5", "b5e106fde98b")
    cfg = a2_config(PROFILES["default"], Path("/tmp/x"), progress=False)
    assert cfg.data.synthdense.detail_random_p == 1.0 and cfg.model.logit_scale_init is None
    assert cfg.data.synthdense.pretrain_detail_pairs == 0 and cfg.data.root == "/tmp/x/synthdense"


def test_paper_geometry_is_the_default_changes_stage_a2_and_the_arms_scale_and_has_its_own_cache_key():
    from sharpclip.demo import profile_for
    from sharpclip.demo.plan import DEFAULT_TASK

    assert DEFAULT_TASK == "paper-geometry"
    for quick in (False, True):
        base, paper = PROFILES["quick" if quick else "default"], profile_for(DemoOptions(quick=quick))
        changed = {k: getattr(paper, k) for k in base.__dataclass_fields__ if getattr(base, k) != getattr(paper, k)}
        assert set(changed) == {"a2_detail_random_p", "a2_scale", "a2_detail_pairs", "a2_steps", "scale"}
        assert init_key(paper) != init_key(base)
        # the mode's sizes scale: a quarter as many pairs as scenes, twice A2's steps
        assert (paper.a2_detail_pairs, paper.a2_steps) == (base.pretrain_scenes // 4, 2 * base.a2_steps)
        assert (paper.a2_detail_random_p, paper.a2_scale) == (0.0, 500.0)
        assert paper.scale == paper.a2_scale  # the arms fine-tune at the init's own scale
    assert (profile_for(DemoOptions()).a2_detail_pairs, profile_for(DemoOptions()).a2_steps) == (2048, 384)
    paper = profile_for(DemoOptions())
    cfg = a2_config(paper, Path("/tmp/x"), progress=False)
    assert cfg.data.synthdense.detail_random_p == 0.0 and cfg.data.train_split == "pretrain_noisy"
    # A2's detail pairs live in a corpus of their own, which stage A never reads
    assert cfg.data.synthdense.pretrain_detail_pairs == 2048 and cfg.data.root == "/tmp/x/synthdense-a2"
    assert init_config(paper, Path("/tmp/x"), progress=False).data.synthdense.pretrain_detail_pairs == 0
    assert not cfg.model.logit_scale_learnable and cfg.model.logit_scale_init == pytest.approx(math.log(500), abs=1e-9)
    assert cfg.train.max_steps == 384
    # --set comes after the task's changes
    p = profile_for(DemoOptions(task="paper-geometry", sizes=("a2_detail_random_p=0.25", "a2_steps=48")))
    assert (p.a2_detail_random_p, p.a2_steps, p.a2_scale) == (0.25, 48, 500.0)
    with pytest.raises(ValueError, match="--task 'nope': unknown; known: paper-geometry, unseen-details"):
        profile_for(DemoOptions(task="nope"))


def test_an_a2_scale_above_100_is_not_served_from_a_cache_made_while_the_losses_cut_it_to_100():
    from sharpclip.demo import profile_for

    above = profile_for(DemoOptions(sizes=("a2_scale=300",)))
    # the key this profile had while a frozen scale above 100 was used as 100 (that cache holds an init trained at 100)
    assert init_key(above) != "308f8a4d09d4"
    assert init_key(replace(above, a2_scale=100.0)) == "4f1289050141"  # at 100 nothing changed: that cache is found


def test_the_demo_command_line_takes_a_task(capsys):
    from sharpclip.cli import build_parser
    from sharpclip.demo.plan import DEFAULT_TASK

    assert build_parser().parse_args(["demo"]).task == DEFAULT_TASK == "paper-geometry"
    args = build_parser().parse_args(["demo", "--task", "nope"])
    assert args.handler(args) == 2  # refused before anything runs
    assert "unknown; known: paper-geometry, unseen-details" in capsys.readouterr().err


def test_the_paper_spread_arm_gets_its_gamma_from_the_init_and_only_it_changes():
    from sharpclip.demo import paper_spread_plan
    from sharpclip.demo.plan import PAPER_SPREAD_ARM, at_paper_spread

    plan = select(DemoOptions(only=(PAPER_SPREAD_ARM,)))
    assert [a.name for a in plan] == ["infonce", PAPER_SPREAD_ARM]
    set_plan = at_paper_spread(plan, 0.041666)
    assert set_plan[0] == plan[0]
    arm = set_plan[1]
    assert arm.label == "(i) HN-CLIP, paper's spread (γ=0.0417)"
    cfg = arm_config(PROFILES["default"], arm, Path("init"), Path("data"), Path("run"), seed=0, progress=False)
    assert cfg.loss.terms["hn"].params["gamma"] == pytest.approx(0.0417)
    # from the init's measured geometry: γ = 3.67 / (s · (h̄ − p̄)), the rule fixed in demo.plan
    init = {"geometry": {"margin": {"gamma_for_paper_spread": 11 / 3 / (500 * (0.95 - 0.85)), "per_gamma": {}}}}
    init["geometry"]["margin"].update(scale=500.0, paper_spread=11 / 3)
    init["geometry"]["margin"]["per_gamma"] = {
        "0.5": {"spread": 5.0, "uniform": 212.5, "unreachable_share": 1.0},
        "0.07333": {"spread": 11 / 3, "uniform": 31.2, "unreachable_share": 0.25},
    }
    got = paper_spread_plan(plan, init)[1]
    assert got.terms["hn"] == "{loss: hn_clip, params: {gamma: 0.0733}}"
