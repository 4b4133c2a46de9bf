"""SynthDense: determinism, families of near-duplicates, caption levels, edits, MMVP patterns, vocabulary, loaders."""

from __future__ import annotations

import json
import random
from dataclasses import astuple, replace

import numpy as np
import pytest

from sharpclip.config import DataConfig, SynthDenseConfig
from sharpclip.data import build_loader, read_samples
from sharpclip.data.images import load_image
from sharpclip.data.synthdense.captions import coarse_caption, dense_caption, family, noisy_details, vocabulary
from sharpclip.data.synthdense.corpus import ZEROSHOT_PROMPTS, _records, _rng, ensure, generate, manifest
from sharpclip.data.synthdense.edits import EDIT_KINDS, MMVP_PATTERNS, make_edit, mmvp_pair
from sharpclip.data.synthdense.scene import COLOURS, DETAILS, SIZES, TEXTURES, Obj, Scene, random_scene
from sharpclip.data.transforms import ClipImageTransform, Preprocessing, TextTokenizer
from sharpclip.models.tokenizer import synthdense_tokenizer

SMALL = SynthDenseConfig(
    train_families=12,
    train_family_size=1,
    test_families=4,
    test_family_size=6,
    pretrain_scenes=10,
    edits=12,
    mmvp_pairs=2,
    resolution=48,
    workers=1,
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("synth"), SMALL)


def _attribute_diff(a: Scene, b: Scene) -> int:
    """Attributes changed, for scenes that differ in one object."""
    (x,) = set(a.objects) - set(b.objects)
    (y,) = set(b.objects) - set(a.objects)
    return sum(u != v for u, v in zip(astuple(x), astuple(y), strict=True)) + (a.background != b.background)


def test_families_differ_in_one_or_two_attributes_of_one_object():
    changes = []
    for i in range(200):
        base, *variants = family(random.Random(i), 6, 3, 5)
        for v in variants:
            assert len(set(base.objects) - set(v.objects)) == 1 and len(v.objects) == len(base.objects)
            changes.append(_attribute_diff(base, v))
    assert set(changes) == {1, 2}
    assert 0.45 < changes.count(1) / len(changes) < 0.75  # 60 % one change


def test_dense_captions_are_long_and_name_every_object_and_relation():
    rng = random.Random(0)
    for _ in range(500):
        scene = random_scene(rng, 3, 5)
        text = dense_caption(scene)
        assert len(text.split()) >= 80
        for o in scene.objects:
            assert f"there is a {o.size} {o.texture} {o.colour} {o.shape}." in text
        for a, b in zip(scene.objects, scene.objects[1:], strict=False):
            assert f"the {a.colour} {a.shape} is " in text.lower() and f" the {b.colour} {b.shape}." in text
        assert f"on a {scene.background} background" in text


def test_coarse_captions_at_two_levels():
    scene = Scene("gray", (Obj("circle", "red", "small", "solid", 0), Obj("star", "blue", "large", "dotted", 4)))
    assert coarse_caption(scene, "shapes") == "a picture of a circle and a star."
    assert coarse_caption(scene, "colours") == "a picture of a red circle and a blue star."


@pytest.mark.parametrize("kind", EDIT_KINDS)
def test_edits_change_what_the_instruction_says(kind):
    rng = random.Random(kind)
    source = random_scene(rng, 3, 4)
    target, instruction = make_edit(source, rng, kind)
    assert target != source and dense_caption(target) != dense_caption(source)
    delta = len(target.objects) - len(source.objects)
    assert delta == {"add": 1, "remove": -1}.get(kind, 0)
    assert instruction.split()[0] in {"change", "turn", "make", "move", "add", "remove"}


@pytest.mark.parametrize("pattern", MMVP_PATTERNS)
def test_mmvp_pairs_differ_in_their_pattern_with_one_statement_each(pattern):
    a, b, text_a, text_b = mmvp_pair(pattern, random.Random(pattern), 3, 5)
    assert a != b and text_a != text_b
    assert a.background == b.background
    if pattern == "count":
        shape = text_b.split()[-1]
        n = lambda s: sum(o.shape in (shape, shape[:-1], shape[:-2]) for o in s.objects)  # noqa: E731
        assert n(b) == n(a) + 1
    if pattern == "presence":
        assert len(b.objects) == len(a.objects) - 1


def test_vocabulary_covers_every_generated_text(corpus):
    vocab = set(vocabulary())
    texts = []
    for name in ("train", "test", "pretrain", "mmvp"):
        for line in (corpus / f"{name}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            texts += [rec["caption"], rec.get("caption_shapes", ""), rec.get("caption_colours", "")]
    for line in (corpus / "edits.jsonl").read_text().splitlines():
        rec = json.loads(line)
        texts += [rec["source_caption"], rec["target_caption"], rec["instruction"]]
    words = {w for t in texts for w in t.lower().replace(".", " . ").replace(",", " , ").split()}
    assert words <= vocab, words - vocab
    assert (corpus / "vocab.txt").read_text().split() == vocabulary()


def test_generation_is_deterministic_and_independent_of_workers(corpus, tmp_path):
    other = generate(tmp_path / "again", SynthDenseConfig(**{**vars(SMALL), "workers": 2}))
    for name in ("train.jsonl", "test.jsonl", "edits.jsonl", "mmvp.jsonl", "manifest.json"):
        assert (corpus / name).read_bytes() == (other / name).read_bytes()
    for rel in ("images/test/test-000003-5.png", "images/edits/edit-000007-edited.png"):
        assert (corpus / rel).read_bytes() == (other / rel).read_bytes()
    different = SynthDenseConfig(**{**vars(SMALL), "seed": 1})
    assert (
        next(iter(_records(different, "test", 0)))[0]["caption"]
        != json.loads((corpus / "test.jsonl").read_text().splitlines()[0])["caption"]
    )


def test_images_have_the_configured_resolution_and_differ_within_a_family(corpus):
    imgs = [load_image(corpus / f"images/test/test-000000-{v}.png") for v in range(6)]
    assert {im.size for im in imgs} == {(48, 48)}
    assert len({im.tobytes() for im in imgs}) == 6


def test_the_generic_loaders_read_every_split(corpus):
    cfg = DataConfig(root=str(corpus), synthdense=SMALL, num_workers=0)
    words = Preprocessing(ClipImageTransform(48), TextTokenizer(synthdense_tokenizer(), 160))
    test = read_samples(cfg, "test")
    assert len(test) == 24 and len({s.group for s in test}) == 4
    assert read_samples(cfg, "coarse_shapes")[0].caption.startswith("a picture of a ")
    assert len(read_samples(cfg, "edits")) == 12
    loader = build_loader(cfg, "test", words, batch_size=12, train=True)
    for batch in loader:
        assert batch.pixel_values.shape == (12, 3, 48, 48)
        assert batch.groups.tolist() == sorted(batch.groups.tolist()) and len(set(batch.groups.tolist())) == 2
    edits = next(iter(build_loader(cfg, "edits", words, batch_size=6, train=True)))
    assert edits.edit_source.numel() == 3 and (edits.edit_target - edits.edit_source).tolist() == [1, 1, 1]


def test_a_different_config_in_the_same_folder_is_an_error(corpus):
    with pytest.raises(ValueError, match="different config"):
        ensure(corpus, SynthDenseConfig(**{**vars(SMALL), "edits": 13}))


def test_layout_captions_leave_out_exactly_size_and_texture():
    rng = random.Random(1)
    words = set(SIZES) | set(TEXTURES)
    for _ in range(300):
        scene = random_scene(rng, 3, 5)
        layout = dense_caption(scene, details=False)
        assert len(layout.split()) >= 80 and not words & set(layout.replace(".", " ").split())
        for o in scene.objects:
            assert f"there is a {o.colour} {o.shape}." in layout
    detailed = dense_caption(random_scene(random.Random(2), 3, 5))
    assert words & set(detailed.replace(".", " ").split())


def test_detail_families_differ_only_in_size_or_texture(tmp_path):
    for i in range(100):
        base, *variants = family(random.Random(i), 6, 3, 5, DETAILS)
        for v in variants:
            (x,) = set(base.objects) - set(v.objects)
            (y,) = set(v.objects) - set(base.objects)
            assert (x.shape, x.colour, x.cell) == (y.shape, y.colour, y.cell) and (x.size, x.texture) != (
                y.size,
                y.texture,
            )
            assert dense_caption(v, details=False) == dense_caption(base, details=False)  # the init can't tell
    cfg = SynthDenseConfig(train_families=0, test_families=2, test_variants="details", pretrain_scenes=3, edits=0,
                           mmvp_pairs=0, resolution=32, workers=1)  # fmt: skip
    root = generate(tmp_path, cfg)
    data = DataConfig(root=str(root), synthdense=cfg)
    test = read_samples(data, "test")
    assert (
        len(test) == 12
        and read_samples(data, "pretrain_layout")[0].caption
        == json.loads((root / "pretrain.jsonl").read_text().splitlines()[0])["caption_layout"]
    )
    with pytest.raises(ValueError, match="test_variants"):
        SynthDenseConfig(test_variants="colours")


def test_test_changed_objects_changes_the_details_of_that_many_objects_of_each_test_sibling(tmp_path):
    for k in (2, 3, 5):
        for i in range(60):
            base, *variants = family(random.Random(i), 6, 3, 5, DETAILS, objects=k)
            for v in variants:
                before, after = (
                    sorted(set(base.objects) - set(v.objects), key=lambda o: o.cell),
                    sorted(set(v.objects) - set(base.objects), key=lambda o: o.cell),
                )
                assert len(before) == len(after) == min(k, len(base.objects))  # all of them when fewer than k
                assert [(o.shape, o.colour, o.cell) for o in before] == [(o.shape, o.colour, o.cell) for o in after]
                assert all((x.size, x.texture) != (y.size, y.texture) for x, y in zip(before, after, strict=True))
    one = SynthDenseConfig(train_families=0, test_families=3, test_variants="details", pretrain_scenes=0, edits=0,
                           mmvp_pairs=0, resolution=32, workers=1)  # fmt: skip
    assert "test_changed_objects" not in manifest(one)["config"]  # at 1, corpora made before the field are valid
    three = replace(one, test_changed_objects=3)
    assert manifest(three)["config"]["test_changed_objects"] == 3
    rows = [json.loads(x) for x in (generate(tmp_path / "three", three) / "test.jsonl").read_text().splitlines()]
    fresh = [dense_caption(s) for f in range(3) for s in
             family(random.Random(f"0:test:{f}"), 6, 3, 5, DETAILS, objects=3)]  # fmt: skip
    assert [r["caption"] for r in rows] == fresh
    with pytest.raises(ValueError, match="test_changed_objects: must be >= 1"):
        SynthDenseConfig(test_changed_objects=0)


def test_detail_pairs_are_extra_training_families_of_two_apart_only_in_size_or_texture(tmp_path):
    cfg = SynthDenseConfig(train_families=3, train_detail_pairs=4, test_families=0, pretrain_scenes=0, edits=0,
                           mmvp_pairs=0, resolution=32, workers=1)  # fmt: skip
    root = generate(tmp_path, cfg)
    rows = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines()]
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r)
    assert sorted(len(g) for g in groups.values()) == [1, 1, 1, 2, 2, 2, 2]
    for pair in (g for g in groups.values() if len(g) == 2):
        a, b = pair
        assert a["caption_layout"] == b["caption_layout"] and a["caption"] != b["caption"]
    train = read_samples(DataConfig(root=str(root), synthdense=cfg), "train")
    assert len(train) == 11 and len({s.group for s in train}) == 7


def test_pretrain_detail_pairs_follow_the_pretrain_scenes_and_leave_them_unchanged(tmp_path):
    base = SynthDenseConfig(train_families=0, test_families=0, pretrain_scenes=3, edits=0, mmvp_pairs=0,
                            resolution=32, workers=1, detail_random_p=0.0)  # fmt: skip
    plain = generate(tmp_path / "plain", base)
    paired = generate(tmp_path / "paired", replace(base, pretrain_detail_pairs=2))
    rows = [json.loads(line) for line in (paired / "pretrain.jsonl").read_text().splitlines()]
    alone = [json.loads(line) for line in (plain / "pretrain.jsonl").read_text().splitlines()]
    assert rows[:3] == alone  # the independent scenes are the same scenes, the pairs come after them
    pairs = rows[3:]
    assert [r["group"] for r in pairs] == ["pretrain-000003"] * 2 + ["pretrain-000004"] * 2
    for a, b in (pairs[:2], pairs[2:]):
        assert a["caption_layout"] == b["caption_layout"] and a["caption"] != b["caption"]
        assert a["caption_noisy"] == a["caption"]  # p = 0: the noisy captions are the true ones
    assert "pretrain_detail_pairs" not in manifest(base)["config"]  # corpora made before the field stay valid
    noisy = read_samples(DataConfig(root=str(paired), synthdense=replace(base, pretrain_detail_pairs=2)),
                         "pretrain_noisy")  # fmt: skip
    assert len(noisy) == 7 and len({s.group for s in noisy}) == 5


def test_zeroshot_split_is_an_image_folder_of_single_objects_one_class_per_colour_and_shape(tmp_path):
    from sharpclip.eval.zeroshot import read_image_folder

    cfg = SynthDenseConfig(train_families=0, test_families=0, pretrain_scenes=0, edits=0, mmvp_pairs=0,
                           zeroshot_per_class=2, resolution=32, workers=1)  # fmt: skip
    root = generate(tmp_path, cfg)
    classes = read_image_folder(root / "images" / "zeroshot")
    assert len(classes.classnames) == 64 and "red circle" in classes.classnames and len(classes.images) == 128
    assert (root / ZEROSHOT_PROMPTS).read_text().strip() == "a picture of a {}."
    for index in (0, 9, 127):
        ((record, scene),) = _records(cfg, "zeroshot", index)
        (obj,) = scene.objects
        assert record["label"] == f"{obj.colour}_{obj.shape}" and (root / record["image"]).is_file()
    image = np.asarray(load_image(root / "images" / "zeroshot" / "red_circle" / "000000.png"))
    pixels = {tuple(p) for p in image.reshape(-1, 3)}
    assert COLOURS["red"] in pixels  # the object is drawn in its class colour


# ---------------------------------------------------------------- caption_noisy's detail words, random with p

NOISY = SynthDenseConfig(train_families=0, test_families=0, pretrain_scenes=60, edits=0, mmvp_pairs=0, workers=1)


def _pretrain(cfg: SynthDenseConfig) -> list[tuple[dict, Scene]]:
    return [rs for i in range(cfg.pretrain_scenes) for rs in _records(cfg, "pretrain", i)]


def _every_detail_drawn(scene: Scene, rng: random.Random) -> Scene:
    """The rule caption_noisy followed before it had a probability: each object's size, then texture, from `rng`."""
    objects = [replace(o, size=rng.choice(SIZES), texture=rng.choice(TEXTURES)) for o in scene.objects]
    return scene.with_objects(objects)


def test_detail_random_p_0_gives_the_true_captions_and_1_every_detail_drawn_at_random():
    for record, _ in _pretrain(replace(NOISY, detail_random_p=0.0)):
        assert record["caption_noisy"] == record["caption"]
    assert NOISY.detail_random_p == 1.0  # the default: every detail word random
    for i, (record, scene) in enumerate(_pretrain(NOISY)):
        drawn = _every_detail_drawn(scene, _rng(NOISY.seed, "pretrain-noisy", i * 8))
        assert record["caption_noisy"] == dense_caption(drawn)


def test_intermediate_p_randomises_each_detail_word_independently_at_rate_p():
    scenes = [random_scene(random.Random(f"scene{i}"), 3, 5) for i in range(3000)]

    def noisy(p: float) -> list[Scene]:
        return [noisy_details(s, random.Random(f"d{i}"), p, random.Random(f"c{i}")) for i, s in enumerate(scenes)]

    drawn = [_every_detail_drawn(s, random.Random(f"d{i}")) for i, s in enumerate(scenes)]
    for p in (0.3, 0.7):
        got = noisy(p)
        assert got == noisy(p)  # seeded
        flags: dict[str, list[bool]] = {"size": [], "texture": []}
        both = []
        for true, draw, out in zip(scenes, drawn, got, strict=True):
            for o, d, n in zip(true.objects, draw.objects, out.objects, strict=True):
                assert n.size in (o.size, d.size) and n.texture in (o.texture, d.texture)
                assert (n.shape, n.colour, n.cell) == (o.shape, o.colour, o.cell)
                # where the draw differs from the truth, the word shows whether it was randomised
                for name in ("size", "texture"):
                    if getattr(d, name) != getattr(o, name):
                        flags[name].append(getattr(n, name) == getattr(d, name))
                if d.size != o.size and d.texture != o.texture:
                    both.append(n.size == d.size and n.texture == d.texture)
        for name, f in flags.items():
            assert sum(f) / len(f) == pytest.approx(p, abs=0.03), name
        assert sum(both) / len(both) == pytest.approx(p * p, abs=0.03)  # size and texture decided independently
    low, high = noisy(0.3), noisy(0.7)  # the same draws and coins: a word random at 0.3 is random at 0.7
    for true, a, b in zip(scenes, low, high, strict=True):
        for o, x, y in zip(true.objects, a.objects, b.objects, strict=True):
            assert x.size == o.size or y.size == x.size
            assert x.texture == o.texture or y.texture == x.texture


def test_detail_random_p_is_in_the_manifest_only_when_it_changes_the_corpus():
    assert "detail_random_p" not in manifest(NOISY)["config"]  # corpora generated before the field stay valid
    assert manifest(replace(NOISY, detail_random_p=0.5))["config"]["detail_random_p"] == 0.5
    with pytest.raises(ValueError, match="detail_random_p: must be <= 1"):
        SynthDenseConfig(detail_random_p=1.5)
