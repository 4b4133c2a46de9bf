"""Patch feature maps (analysis.dense, analysis.feature_map, `analyze --feature-map`).

- Known answer: tiny CLIP and SigLIP towers given weights under which one colour is the captioned object: the
  patch embedding reads "red minus green", every block but MaskCLIP's last one (CLIP) is the identity, and the
  projection (CLIP) / the MAP head's output projection (SigLIP) maps the red direction onto the caption's own
  embedding. The patch that holds the red square must score highest, at its (row, column), for both dense paths.
- Parity: on random tiny towers, the value path against independent formulations: CLIP's written out from the
  formula with the raw weights (F.layer_norm, F.linear, quick-GELU), SigLIP's as the MAP head itself run on each
  token alone (attention over one key is the identity on its value), and both differ from the attention-mixed tokens.
- The command: one and two models, the PNG, JSON and a self-contained HTML page whose caption is escaped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from _support.html_pages import check_page
from sharpclip.analysis.dense import dense_features, patch_similarity
from sharpclip.analysis.feature_map import compute_feature_map
from sharpclip.cli import main
from sharpclip.config import ModelConfig
from sharpclip.eval.evaluator import model_embedder
from sharpclip.models import create_model, save_checkpoint
from sharpclip.models.preprocessing import model_transforms
from sharpclip.models.tiny import tiny_model
from sharpclip.train import checkpoint

CAPTION = "a red square"
PATCH = 8  # the tiny towers: 32 px images in 8 px patches, a 4 × 4 grid


def _red_square_image(row: int, col: int) -> Image.Image:
    """32 × 32 white, one patch (row, col) red: the model's own size, so preprocessing neither resizes nor crops."""
    im = Image.new("RGB", (32, 32), (255, 255, 255))
    im.paste((255, 0, 0), (col * PATCH, row * PATCH, (col + 1) * PATCH, (row + 1) * PATCH))
    return im


def _red_minus_green(conv: torch.nn.Conv2d) -> None:
    """Output channel 0 = mean over the patch of (normalised red − normalised green); every other channel 0."""
    with torch.no_grad():
        conv.weight.zero_()
        conv.weight[0, 0] = 1.0 / PATCH**2
        conv.weight[0, 1] = -1.0 / PATCH**2
        if conv.bias is not None:
            conv.bias.zero_()


def _identity_blocks(layers: torch.nn.ModuleList) -> None:
    """Every block adds nothing: its attention output and MLP output projections are zero."""
    with torch.no_grad():
        for layer in layers:
            for lin in (layer.self_attn.out_proj, layer.mlp.fc2):
                lin.weight.zero_()
                lin.bias.zero_()


def _onto(text: torch.Tensor, width: int) -> torch.Tensor:
    """(E, D) rank one: the layer-normed direction of a one-hot channel 0, [D−1, −1, …, −1], onto `text`."""
    u = torch.full((width,), -1.0)
    u[0] = width - 1
    return torch.outer(text, F.normalize(u, dim=0))


def _known_clip(model: torch.nn.Module | None = None) -> tuple[torch.nn.Module, torch.Tensor]:
    model = (model if model is not None else tiny_model("clip")).eval()
    text = model_embedder(model, progress=False).texts([CAPTION])[0]
    vision = model.vision_model
    with torch.no_grad():
        _red_minus_green(vision.embeddings.patch_embedding)
        vision.embeddings.class_embedding.zero_()
        vision.embeddings.position_embedding.weight.zero_()
        _identity_blocks(vision.encoder.layers[:-1])
        last = vision.encoder.layers[-1]
        d = last.self_attn.v_proj.weight.shape[0]
        for lin in (last.self_attn.v_proj, last.self_attn.out_proj):  # value path = identity; attention left random
            lin.weight.copy_(torch.eye(d))
            lin.bias.zero_()
        last.mlp.fc2.weight.zero_()
        last.mlp.fc2.bias.zero_()
        model.hf_model.visual_projection.weight.copy_(_onto(text, d))
    return model, text


def _known_siglip() -> tuple[torch.nn.Module, torch.Tensor]:
    model = tiny_model("siglip").eval()
    text = model_embedder(model, progress=False).texts([CAPTION])[0]
    vision = model.vision_model
    with torch.no_grad():
        _red_minus_green(vision.embeddings.patch_embedding)
        vision.embeddings.position_embedding.weight.zero_()
        _identity_blocks(vision.encoder.layers)
        attn = vision.head.attention
        d = attn.embed_dim
        attn.in_proj_weight[2 * d :].copy_(torch.eye(d))  # W_v = I, b_v = 0: the head's value is the token
        attn.in_proj_bias.zero_()
        attn.out_proj.weight.copy_(_onto(text, d))
        attn.out_proj.bias.zero_()
        vision.head.mlp.fc2.weight.zero_()
        vision.head.mlp.fc2.bias.zero_()
    return model, text


@pytest.mark.parametrize("build", [_known_clip, _known_siglip], ids=["clip", "siglip"])
@pytest.mark.parametrize("path", ["maskclip", "value"])
@pytest.mark.parametrize("where", [(1, 2), (3, 0)])
def test_the_patch_holding_the_captioned_object_scores_highest(build, path: str, where: tuple[int, int]) -> None:
    model, _ = build()
    fm = compute_feature_map(model, "known", _red_square_image(*where), CAPTION, path)
    assert fm.cos.shape == (4, 4) and fm.best == where
    assert fm.cos[where] == pytest.approx(1.0, abs=1e-4)  # the red patch is the caption's own direction
    others = torch.cat([fm.cos.flatten()[: where[0] * 4 + where[1]], fm.cos.flatten()[where[0] * 4 + where[1] + 1 :]])
    assert float(others.max()) <= 1e-4  # white patches: the opposite direction (CLIP) or no feature at all (SigLIP)
    assert fm.view.shape == (32, 32, 3) and fm.upsampled().shape == (32, 32)


def _pixels(model: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    noise = (torch.rand(32, 32, 3, generator=g) * 255).to(torch.uint8).numpy()
    return model_transforms(model).image(Image.fromarray(noise))[None]


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


@pytest.mark.parametrize("path", ["maskclip", "value"])
def test_clip_value_path_matches_the_formula_written_out(path: str) -> None:
    model = tiny_model("clip", seed=3).eval()
    vision, pixels = model.vision_model, _pixels(model)
    assert vision.config.hidden_act == "quick_gelu"
    with torch.no_grad():
        x = vision(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]  # the last block's input
        blk = vision.encoder.layers[-1]
        d, eps = x.shape[-1], blk.layer_norm1.eps
        y = F.layer_norm(x, (d,), blk.layer_norm1.weight, blk.layer_norm1.bias, eps)
        v = F.linear(F.linear(y, blk.self_attn.v_proj.weight, blk.self_attn.v_proj.bias),
                     blk.self_attn.out_proj.weight, blk.self_attn.out_proj.bias)  # fmt: skip
        if path == "maskclip":
            v = x + v
            z = F.layer_norm(v, (d,), blk.layer_norm2.weight, blk.layer_norm2.bias, eps)
            v = v + F.linear(_quick_gelu(F.linear(z, blk.mlp.fc1.weight, blk.mlp.fc1.bias)), blk.mlp.fc2.weight,
                             blk.mlp.fc2.bias)  # fmt: skip
        post = vision.post_layernorm
        z = F.layer_norm(v[:, 1:], (d,), post.weight, post.bias, post.eps)
        expected = F.normalize(z @ model.hf_model.visual_projection.weight.T, dim=-1).reshape(1, 4, 4, -1)
        got = dense_features(model, pixels, path)
        mixed = model.encode_image(pixels, tokens=True).tokens.reshape(1, 4, 4, -1)  # with the attention
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (got - mixed).abs().max() > 1e-2


@pytest.mark.parametrize("kind", ["siglip", "siglip2"])
def test_siglip_value_path_is_the_pooling_head_run_on_each_token_alone(kind: str) -> None:
    model = tiny_model(kind, seed=5).eval()
    pixels = _pixels(model, seed=1)
    with torch.no_grad():
        tokens = model.encode_image(pixels, tokens=True).tokens  # post-layernormed, normalised; the raw ones:
        out, _ = model._vision(pixels)
        x = out.last_hidden_state
        alone = torch.stack([model.vision_model.head(x[:, i : i + 1]) for i in range(x.shape[1])], dim=1)
        expected = F.normalize(alone, dim=-1).reshape(1, 4, 4, -1)
        got = dense_features(model, pixels, "maskclip")
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (got.reshape(1, 16, -1) - tokens).abs().max() > 1e-2  # not the tower's own tokens


def test_patch_similarity_is_the_cosine_with_the_caption() -> None:
    model = tiny_model("clip", seed=2).eval()
    pixels, text = _pixels(model), F.normalize(torch.randn(model.hf_model.visual_projection.out_features), dim=0)
    sim = patch_similarity(model, pixels, text)
    torch.testing.assert_close(sim, dense_features(model, pixels) @ text)
    with pytest.raises(ValueError, match="dense path 'clear' is unknown"):
        dense_features(model, pixels, "clear")


def test_analyze_feature_map_writes_png_json_and_a_self_contained_page(tmp_path: Path) -> None:
    image = tmp_path / "red.png"
    _red_square_image(1, 2).save(image)
    caption = "a red <b>square</b> & more"
    out = tmp_path / "maps"
    argv = ["analyze", "--feature-map", str(image), "--text", caption, "--model", "tiny-clip", "--model", "tiny-siglip"]
    assert main([*argv, "--out", str(out)]) == 0
    numbers = json.loads((out / "feature_map.json").read_text())
    assert list(numbers["models"]) == ["tiny-clip", "tiny-siglip"] and numbers["path"] == "maskclip"
    assert all(len(m["grid"]) == 4 and len(m["grid"][0]) == 4 for m in numbers["models"].values())
    with Image.open(out / "feature_map.png") as im:
        assert im.size[0] > 2.5 * im.size[1]  # three panels side by side
    parsed = check_page(out / "feature_map.html")  # structure, every image present, nothing remote
    page = (out / "feature_map.html").read_text(encoding="utf-8")
    assert "b" not in parsed.tags and "a red &lt;b&gt;square&lt;/b&gt; &amp; more" in page
    assert parsed.images == ["feature_map.png"]


def test_a_run_directory_resolves_as_eval_resolves_it_and_keeps_the_known_answer(tmp_path: Path) -> None:
    """The known CLIP saved as a training run's checkpoint: `--model RUN` loads its newest checkpoint."""
    cfg = ModelConfig()
    model, _ = _known_clip(create_model(cfg))
    run = tmp_path / "run"
    checkpoint.save(run / "checkpoints", 3, lambda d: save_checkpoint(model, d, cfg), {}, {"step": 3})
    image = tmp_path / "red.png"
    _red_square_image(2, 3).save(image)
    argv = ["analyze", "--feature-map", str(image), "--text", CAPTION, "--model", str(run), "--dense", "value"]
    assert main([*argv, "--out", str(tmp_path / "maps")]) == 0
    numbers = json.loads((tmp_path / "maps" / "feature_map.json").read_text())
    (record,) = numbers["models"].values()
    assert record["best_patch"] == [2, 3] and record["max"] == pytest.approx(1.0, abs=1e-4)
    assert numbers["path"] == "value" and list(numbers["models"]) == [f"{tmp_path.name}/run"]


def test_analyze_feature_map_refuses_without_text_or_with_three_models(tmp_path, capsys) -> None:
    image = tmp_path / "red.png"
    _red_square_image(0, 0).save(image)
    assert main(["analyze", "--feature-map", str(image), "--model", "tiny-clip", "--out", str(tmp_path)]) == 2
    assert "needs --text" in capsys.readouterr().err
    three = ["--model", "tiny-clip"] * 3
    assert main(["analyze", "--feature-map", str(image), "--text", "red", *three, "--out", str(tmp_path)]) == 2
    assert "one or two models" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_feature_map_on_cuda_matches_cpu(kind: str) -> None:
    """The map is computed where the model is (pixels and caption moved there) and comes back on the CPU."""
    image = _red_square_image(2, 1)
    cpu = compute_feature_map(tiny_model(kind, seed=4).eval(), "cpu", image, CAPTION)
    gpu = compute_feature_map(tiny_model(kind, seed=4).eval().cuda(), "cuda", image, CAPTION)
    assert gpu.cos.device.type == "cpu"
    torch.testing.assert_close(gpu.cos, cpu.cos, atol=1e-4, rtol=1e-4)
