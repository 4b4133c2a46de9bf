"""open_clip folders → CLIPModel: checked against an independent open_clip-style forward, with both activations."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor

from sharpclip.config import ModelConfig
from sharpclip.models import ModelNotFoundError, create_model, tiny_model
from sharpclip.models.open_clip import UnsupportedOpenClipModel

WIDTH, VWIDTH, HEAD_WIDTH, TEXT_HEADS, EMBED, VOCAB, PATCH, GRID, LAYERS, CONTEXT = 96, 96, 16, 4, 32, 90, 4, 3, 2, 12


def _rnd(gen: torch.Generator, *shape: int, scale: float = 0.08) -> Tensor:
    return torch.randn(*shape, generator=gen) * scale


def _block(sd: dict, p: str, w: int, gen: torch.Generator) -> None:
    sd |= {f"{p}attn.in_proj_weight": _rnd(gen, 3 * w, w), f"{p}attn.in_proj_bias": _rnd(gen, 3 * w),
           f"{p}attn.out_proj.weight": _rnd(gen, w, w), f"{p}attn.out_proj.bias": _rnd(gen, w),
           f"{p}ln_1.weight": 1 + _rnd(gen, w), f"{p}ln_1.bias": _rnd(gen, w),
           f"{p}ln_2.weight": 1 + _rnd(gen, w), f"{p}ln_2.bias": _rnd(gen, w),
           f"{p}mlp.c_fc.weight": _rnd(gen, 4 * w, w), f"{p}mlp.c_fc.bias": _rnd(gen, 4 * w),
           f"{p}mlp.c_proj.weight": _rnd(gen, w, 4 * w), f"{p}mlp.c_proj.bias": _rnd(gen, w)}  # fmt: skip


def open_clip_state_dict(seed: int = 0) -> dict[str, Tensor]:
    """The keys open_clip's CLIP.state_dict() has for a ViT + text transformer (the OpenAI layout)."""
    gen = torch.Generator().manual_seed(seed)
    sd = {"token_embedding.weight": _rnd(gen, VOCAB, WIDTH), "positional_embedding": _rnd(gen, CONTEXT, WIDTH),
          "ln_final.weight": 1 + _rnd(gen, WIDTH), "ln_final.bias": _rnd(gen, WIDTH),
          "text_projection": _rnd(gen, WIDTH, EMBED), "logit_scale": torch.tensor(math.log(1 / 0.07)),
          "visual.conv1.weight": _rnd(gen, VWIDTH, 3, PATCH, PATCH), "visual.class_embedding": _rnd(gen, VWIDTH),
          "visual.positional_embedding": _rnd(gen, GRID * GRID + 1, VWIDTH),
          "visual.ln_pre.weight": 1 + _rnd(gen, VWIDTH), "visual.ln_pre.bias": _rnd(gen, VWIDTH),
          "visual.ln_post.weight": 1 + _rnd(gen, VWIDTH), "visual.ln_post.bias": _rnd(gen, VWIDTH),
          "visual.proj": _rnd(gen, VWIDTH, EMBED)}  # fmt: skip
    for i in range(LAYERS):
        _block(sd, f"transformer.resblocks.{i}.", WIDTH, gen)
        _block(sd, f"visual.transformer.resblocks.{i}.", VWIDTH, gen)
    return sd


def model_cfg(quick_gelu: bool, **vision) -> dict:
    return {"embed_dim": EMBED, "quick_gelu": quick_gelu,
            "vision_cfg": {"image_size": GRID * PATCH, "layers": LAYERS, "width": VWIDTH, "head_width": HEAD_WIDTH,
                           "patch_size": PATCH, **vision},
            "text_cfg": {"context_length": CONTEXT, "vocab_size": VOCAB, "width": WIDTH, "heads": TEXT_HEADS,
                         "layers": LAYERS}}  # fmt: skip


def write_folder(tmp_path, cfg: dict, preprocess: dict | None = None, bin_file: bool = False):
    folder = tmp_path / "oc"
    folder.mkdir(exist_ok=True)
    preprocess = preprocess or {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25], "interpolation": "bicubic",
                                "resize_mode": "shortest"}  # fmt: skip
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": preprocess}))
    sd = open_clip_state_dict()
    if bin_file:
        torch.save(sd, folder / "open_clip_pytorch_model.bin")
    else:
        save_file(sd, str(folder / "open_clip_model.safetensors"))
    return folder, sd


# --- open_clip's forward, written from its layout (heads from head_width, activation from the config) -------------


def _ln(x: Tensor, sd: dict, p: str) -> Tensor:
    return F.layer_norm(x, x.shape[-1:], sd[f"{p}.weight"], sd[f"{p}.bias"], eps=1e-5)


def _tower(x: Tensor, sd: dict, prefix: str, heads: int, quick: bool, causal: bool) -> Tensor:
    for i in range(LAYERS):
        p = f"{prefix}transformer.resblocks.{i}."
        attn_in = _ln(x, sd, f"{p}ln_1")
        mask = torch.full((x.shape[1],) * 2, float("-inf")).triu(1) if causal else None
        out, _ = F.multi_head_attention_forward(
            attn_in.transpose(0, 1), attn_in.transpose(0, 1), attn_in.transpose(0, 1), x.shape[-1], heads,
            sd[f"{p}attn.in_proj_weight"], sd[f"{p}attn.in_proj_bias"], None, None, False, 0.0,
            sd[f"{p}attn.out_proj.weight"], sd[f"{p}attn.out_proj.bias"], attn_mask=mask, need_weights=False,
        )  # fmt: skip
        x = x + out.transpose(0, 1)
        h = _ln(x, sd, f"{p}ln_2") @ sd[f"{p}mlp.c_fc.weight"].T + sd[f"{p}mlp.c_fc.bias"]
        h = h * torch.sigmoid(1.702 * h) if quick else F.gelu(h)
        x = x + h @ sd[f"{p}mlp.c_proj.weight"].T + sd[f"{p}mlp.c_proj.bias"]
    return x


def ref_text(sd: dict, ids: Tensor, quick: bool) -> Tensor:
    x = sd["token_embedding.weight"][ids] + sd["positional_embedding"]
    x = _ln(_tower(x, sd, "", TEXT_HEADS, quick, causal=True), sd, "ln_final")
    return F.normalize(x[torch.arange(len(ids)), ids.argmax(-1)] @ sd["text_projection"], dim=-1)


def ref_image(sd: dict, pixels: Tensor, quick: bool) -> Tensor:
    x = F.conv2d(pixels, sd["visual.conv1.weight"], stride=PATCH).flatten(2).transpose(1, 2)
    x = torch.cat([sd["visual.class_embedding"].expand(len(x), 1, -1), x], 1) + sd["visual.positional_embedding"]
    x = _tower(_ln(x, sd, "visual.ln_pre"), sd, "visual.", VWIDTH // HEAD_WIDTH, quick, causal=False)
    return F.normalize(_ln(x[:, 0], sd, "visual.ln_post") @ sd["visual.proj"], dim=-1)


def _ids() -> Tensor:
    ids = torch.zeros(2, CONTEXT, dtype=torch.long)  # open_clip pads with 0 after eot (the largest id)
    ids[0, :4] = torch.tensor([VOCAB - 2, 5, 9, VOCAB - 1])
    ids[1, :] = torch.tensor([VOCAB - 2, *range(10, 10 + CONTEXT - 2), VOCAB - 1])
    return ids


@pytest.mark.parametrize(("quick_gelu", "bin_file"), [(True, False), (False, True)])
def test_open_clip_folder_computes_open_clips_function(tmp_path, quick_gelu: bool, bin_file: bool) -> None:
    folder, sd = write_folder(tmp_path, model_cfg(quick_gelu), bin_file=bin_file)
    model = create_model(ModelConfig(name=str(folder)))
    act = model.hf_model.config.text_config.hidden_act
    assert act == ("quick_gelu" if quick_gelu else "gelu") == model.hf_model.config.vision_config.hidden_act
    assert model.vision_model.config.num_attention_heads == VWIDTH // HEAD_WIDTH != VWIDTH // 64
    assert model.context_length == CONTEXT
    pixels = torch.randn(2, 3, GRID * PATCH, GRID * PATCH, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        txt, img = model.encode_text(_ids()).embedding, model.encode_image(pixels).embedding
    torch.testing.assert_close(txt, ref_text(sd, _ids(), quick_gelu), atol=2e-5, rtol=0)
    torch.testing.assert_close(img, ref_image(sd, pixels, quick_gelu), atol=2e-5, rtol=0)
    with torch.no_grad():  # the other activation is measurably a different function: the check can fail
        wrong = ref_text(sd, _ids(), not quick_gelu)
    assert (txt - wrong).abs().max() > 1e-3


def test_preprocessing_comes_from_preprocess_cfg(tmp_path) -> None:
    preprocess = {"mean": [0.1, 0.2, 0.3], "std": [0.4, 0.5, 0.6], "interpolation": "bilinear", "resize_mode": "squash"}
    folder, _ = write_folder(tmp_path, model_cfg(False), preprocess)
    from sharpclip.models.preprocessing import model_transforms
    from sharpclip.models.tokenizer import build_word_tokenizer

    model = create_model(ModelConfig(name=str(folder)))
    model.tokenizer = build_word_tokenizer(["a"])  # the folder has no tokenizer files (model.processor would give one)
    image, _ = model_transforms(model)
    assert image.mean.ravel().tolist() == pytest.approx([0.1, 0.2, 0.3]) and image.resample == 2
    assert image.crop is False and image.size == GRID * PATCH


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"vision_cfg": {"timm_model_name": "vit_base_patch16_224"}}, "vision_cfg.timm_model_name"),
        ({"text_cfg": {"hf_model_name": "xlm-roberta-base"}}, "text_cfg.hf_model_name"),
        ({"multimodal_cfg": {"width": 64}}, "multimodal_cfg"),
        ({"vision_cfg": {"attentional_pool": True}}, "vision_cfg.attentional_pool"),
        ({"text_cfg": {"pool_type": "last"}}, "text_cfg.pool_type"),
        ({"vision_cfg": {"layers": [3, 4, 6, 3]}}, "vision_cfg.layers"),
    ],
)
def test_unconvertible_towers_are_refused_naming_the_field(tmp_path, change: dict, field: str) -> None:
    cfg = model_cfg(False)
    for section, values in change.items():
        cfg[section] = {**cfg.get(section, {}), **values} if section in cfg else values
    folder, _ = write_folder(tmp_path, cfg)
    with pytest.raises(UnsupportedOpenClipModel, match=f"model_cfg.{field}"):
        create_model(ModelConfig(name=str(folder)))


def test_config_and_weights_must_agree(tmp_path) -> None:
    cfg = model_cfg(False)
    cfg["text_cfg"]["context_length"] = 77
    folder, _ = write_folder(tmp_path, cfg)
    with pytest.raises(ValueError, match=r"text_cfg\.context_length is 77 but the weights have 12"):
        create_model(ModelConfig(name=str(folder)))


def test_lone_safetensors_says_what_was_assumed_and_honours_model_activation(tmp_path, caplog) -> None:
    path = tmp_path / "weights.safetensors"
    save_file(open_clip_state_dict(), str(path))
    with caplog.at_level(logging.WARNING, logger="sharpclip.models"):
        quick = create_model(ModelConfig(name=str(path)))
    assert "assumed the quick_gelu activation (OpenAI's)" in caplog.text and "model.activation=gelu" in caplog.text
    assert quick.hf_model.config.text_config.hidden_act == "quick_gelu"
    gelu = create_model(ModelConfig(name=str(path), activation="gelu"))
    assert gelu.hf_model.config.vision_config.hidden_act == "gelu"


def test_custom_text_clip_keys_with_a_linear_projection_convert_the_same(tmp_path) -> None:
    """CustomTextCLIP (custom_text: true) stores its own text transformer under `text.`, the projection as a Linear."""
    folder, sd = write_folder(tmp_path, {**model_cfg(False), "custom_text": True})
    text_keys = [k for k in sd if not k.startswith("visual.") and k != "logit_scale"]
    custom = {k: v for k, v in sd.items() if k not in text_keys}
    custom |= {f"text.{k}": v for k, v in sd.items() if k in text_keys and k != "text_projection"}
    custom["text.text_projection.weight"] = sd["text_projection"].T.contiguous()
    save_file(custom, str(folder / "open_clip_model.safetensors"))
    model = create_model(ModelConfig(name=str(folder)))
    with torch.no_grad():
        txt = model.encode_text(_ids()).embedding
    torch.testing.assert_close(txt, ref_text(sd, _ids(), quick=False), atol=2e-5, rtol=0)


def test_model_kind_open_clip_routes_to_the_converter_and_is_refused_without_open_clip_files(tmp_path) -> None:
    """`model.kind=open_clip` has its adapter (models.open_clip): it wins over a transformers config.json in the same
    folder (which `auto` would read), and a folder without open_clip files is refused naming the setting."""
    folder, sd = write_folder(tmp_path, model_cfg(True))
    tiny_model("clip").hf_model.config.save_pretrained(folder)  # a config.json beside it, with no weights for it
    with pytest.raises(OSError, match=r"no file named model\.safetensors"):  # auto: read as a transformers folder
        create_model(ModelConfig(name=str(folder)))
    model = create_model(ModelConfig(name=str(folder), kind="open_clip"))
    with torch.no_grad():
        txt = model.encode_text(_ids()).embedding
    torch.testing.assert_close(txt, ref_text(sd, _ids(), True), atol=2e-5, rtol=0)
    hf = tmp_path / "hf"
    tiny_model("clip").hf_model.save_pretrained(hf)
    with pytest.raises(ModelNotFoundError, match=r"model\.kind=open_clip but .*hf holds no open_clip_config\.json"):
        create_model(ModelConfig(name=str(hf), kind="open_clip"))


# --- every tensor accounted for: open_clip's custom-block options, each with its own tensors ------------------------

HEAD_DIM = VWIDTH // HEAD_WIDTH


def _option_tensors(prefix: str, option: str, width: int, heads: int, head_dim: int) -> dict[str, Tensor]:
    """The tensors open_clip's CustomResidualAttentionBlock adds for `option` (its transformer.py names)."""
    norm = {"weight": torch.ones, "bias": torch.zeros}
    shapes = {
        "qk_norm": {f"attn.ln_{x}.{p}": (head_dim,) for x in "qk" for p in norm},
        "scaled_cosine_attn": {"attn.logit_scale": (heads, 1, 1)},
        "scale_heads": {"attn.head_scale": (heads, 1, 1)},
        "scale_attn_inner": {f"attn.ln_inner.{p}": (width,) for p in norm},
        "scale_attn": {f"ln_attn.{p}": (width,) for p in norm},
        "scale_fc": {f"mlp.ln.{p}": (4 * width,) for p in norm},
        "ls_init_value": {f"ls_{i}.gamma": (width,) for i in (1, 2)},
    }[option]
    return {f"{prefix}transformer.resblocks.{i}.{k}": torch.randn(*s) for i in range(LAYERS) for k, s in shapes.items()}


OPTIONS = ("qk_norm", "scaled_cosine_attn", "scale_heads", "scale_attn_inner", "scale_attn", "scale_fc",
           "ls_init_value")  # fmt: skip


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("tower", ["vision_cfg", "text_cfg"])
@pytest.mark.parametrize("in_config", [True, False], ids=["in-config", "tensors-only"])
def test_every_tensor_is_used_or_the_option_is_named(tmp_path, option: str, tower: str, in_config: bool) -> None:
    """A tensor the conversion would leave out is an error naming the option, whether or not the config says it."""
    cfg = model_cfg(False)
    if in_config:
        cfg[tower][option] = 1e-4 if option == "ls_init_value" else True
    folder, sd = write_folder(tmp_path, cfg)
    prefix, heads = ("visual.", VWIDTH // HEAD_WIDTH) if tower == "vision_cfg" else ("", TEXT_HEADS)
    extra = _option_tensors(prefix, option, VWIDTH, heads, VWIDTH // heads)
    save_file({**sd, **extra}, str(folder / "open_clip_model.safetensors"))
    with pytest.raises(UnsupportedOpenClipModel, match=rf"model_cfg\.{tower}\.{option}:") as err:
        create_model(ModelConfig(name=str(folder)))
    assert "\n" not in str(err.value) and str(folder) in str(err.value)
    if not in_config:  # found from the tensors alone: the message names them
        assert next(iter(extra)) in str(err.value) and f"{len(extra)} tensors" in str(err.value)


def test_a_tensor_of_no_known_option_is_refused_too(tmp_path) -> None:
    folder, sd = write_folder(tmp_path, model_cfg(False))
    save_file({**sd, "visual.extra_head.weight": torch.zeros(3)}, str(folder / "open_clip_model.safetensors"))
    with pytest.raises(UnsupportedOpenClipModel, match=r"1 tensors have no place .*visual\.extra_head\.weight"):
        create_model(ModelConfig(name=str(folder)))


# --- open_clip_train's epoch_N.pt: no config inside, the architecture by name or JSON -------------------------------


def write_epoch_checkpoint(
    tmp_path, sd: dict, name: str = "2026_12_01-10_00_00-model_tiny-oc-lr_0.0001-b_8-j_2-p_fp32"
):
    """What open_clip_train's `main.py` saves: a DDP-prefixed state dict beside the epoch, run name and optimiser."""
    params = [torch.nn.Parameter(v.clone()) for v in list(sd.values())[:3]]
    opt = torch.optim.AdamW(params, lr=1e-4)
    sum(p.sum() for p in params).backward()
    opt.step()
    path = tmp_path / "epoch_2.pt"
    torch.save({"epoch": 2, "name": name, "state_dict": {f"module.{k}": v for k, v in sd.items()},
                "optimizer": opt.state_dict()}, path)  # fmt: skip
    return path


def test_epoch_checkpoint_without_a_config_is_refused_naming_the_setting(tmp_path) -> None:
    path = write_epoch_checkpoint(tmp_path, open_clip_state_dict())
    with pytest.raises(ValueError, match=r"epoch 2\).*--model tiny-oc\. Set model\.open_clip_config=tiny-oc") as err:
        create_model(ModelConfig(name=str(path)))
    assert "ViT-B-32" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("wrapped", [True, False], ids=["open_clip_config.json", "bare-model-json"])
def test_epoch_checkpoint_with_its_json_config_computes_open_clips_function(tmp_path, wrapped: bool) -> None:
    sd = open_clip_state_dict()
    path = write_epoch_checkpoint(tmp_path, sd)
    config = tmp_path / "tiny-oc.json"
    config.write_text(json.dumps({"model_cfg": model_cfg(False)} if wrapped else model_cfg(False)))
    model = create_model(ModelConfig(name=str(path), open_clip_config=str(config)))
    assert model.vision_model.config.num_attention_heads == VWIDTH // HEAD_WIDTH  # not width / 64 = 1
    assert model.text_model.config.num_attention_heads == TEXT_HEADS
    pixels = torch.randn(2, 3, GRID * PATCH, GRID * PATCH, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        txt, img = model.encode_text(_ids()).embedding, model.encode_image(pixels).embedding
    torch.testing.assert_close(txt, ref_text(sd, _ids(), quick=False), atol=2e-5, rtol=0)
    torch.testing.assert_close(img, ref_image(sd, pixels, quick=False), atol=2e-5, rtol=0)


def test_a_shipped_config_that_does_not_describe_the_weights_is_refused(tmp_path) -> None:
    path = write_epoch_checkpoint(tmp_path, open_clip_state_dict())
    with pytest.raises(
        ValueError, match=r"ViT-B-32\.json: model_cfg\.vision_cfg\.width is 768 but the weights have 96"
    ):
        create_model(ModelConfig(name=str(path), open_clip_config="ViT-B-32"))
    with pytest.raises(FileNotFoundError, match=r"model\.open_clip_config='ViT-X-1': neither a shipped config"):
        create_model(ModelConfig(name=str(path), open_clip_config="ViT-X-1"))


# what the transformers conversions of these architectures say (text heads, vision heads): head_width 80/88/104
HEADS = {"ViT-B-32": (8, 12), "ViT-B-16": (8, 12), "ViT-L-14": (12, 16), "ViT-L-14-336": (12, 16),
         "ViT-H-14": (16, 16), "ViT-g-14": (16, 16), "ViT-bigG-14": (20, 16)}  # fmt: skip


def test_shipped_configs_are_convertible_vits_with_the_published_heads() -> None:
    from sharpclip.models import open_clip

    names = open_clip.bundled_configs()
    assert set(HEADS) <= set(names)
    for name in names:
        model_cfg_, preprocess = open_clip.read_config_file(open_clip.find_config(name))
        open_clip.check_convertible(model_cfg_)
        vision, text = model_cfg_["vision_cfg"], model_cfg_["text_cfg"]
        assert text["context_length"] == 77 and text["vocab_size"] == 49408 and preprocess == {}
        assert vision["image_size"] % vision["patch_size"] == 0 and vision["width"] % vision.get("head_width", 64) == 0
        base = name.removesuffix("-quickgelu")
        assert open_clip._heads(model_cfg_) == HEADS[base]
        if base != name:  # the QuickGELU variant is its base architecture plus the activation
            base_cfg, _ = open_clip.read_config_file(open_clip.find_config(base))
            assert model_cfg_ == {**base_cfg, "quick_gelu": True}
