"""CLIP preprocessing parity with transformers' CLIPImageProcessor (PIL backend), and truncation with eos last."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from sharpclip.data.transforms import CLIP_MEAN, CLIP_STD, ClipImageTransform, TextTokenizer
from sharpclip.models.preprocessing import model_transforms
from sharpclip.models.tiny import tiny_model
from sharpclip.models.tokenizer import build_word_tokenizer


def _image(w: int, h: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, size=(h, w, channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)


def _hf(size: int):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


@pytest.mark.parametrize(
    ("w", "h", "mode", "size"),
    [
        (300, 200, "RGB", 224),
        (201, 333, "RGB", 224),
        (640, 481, "RGB", 224),
        (37, 53, "RGBA", 32),
        (64, 64, "RGB", 64),
        (50, 20, "L", 24),
        (100, 30, "RGB", 336),
    ],
)
def test_image_transform_matches_hf_clip_image_processor(w, h, mode, size):
    img = _image(w, h, mode, seed=w + h)
    ours = ClipImageTransform(size, alpha="white")(img)  # HF's processor composites transparency onto white
    theirs = torch.as_tensor(np.asarray(_hf(size)(img, return_tensors="np")["pixel_values"][0]))
    assert ours.shape == (3, size, size) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs.float(), atol=1e-5, rtol=0)


def test_default_alpha_policy_is_pil_convert_rgb_as_openai_clip_and_long_clip():
    img = _image(37, 53, "RGBA", seed=7)
    img.putpixel((18, 26), (10, 200, 30, 0))  # fully transparent: convert("RGB") keeps (10, 200, 30)
    dropped = ClipImageTransform(32)(img)
    theirs = _hf(32)(img.convert("RGB"), return_tensors="np")["pixel_values"][0]
    torch.testing.assert_close(dropped, torch.as_tensor(np.asarray(theirs)).float(), atol=1e-5, rtol=0)
    assert not torch.allclose(dropped, ClipImageTransform(32, alpha="white")(img))
    assert ClipImageTransform(32).alpha == "drop" and model_transforms(tiny_model("clip"))[0].alpha == "drop"


def test_image_transform_normalises_a_constant_image_to_the_formula():
    out = ClipImageTransform(8)(Image.new("RGB", (16, 8), (255, 0, 128)))
    expected = [(v / 255 - m) / s for v, m, s in zip((255, 0, 128), CLIP_MEAN, CLIP_STD, strict=True)]
    torch.testing.assert_close(out[:, 0, 0], torch.tensor(expected), atol=1e-6, rtol=0)


def test_tokeniser_truncates_to_context_and_keeps_eos_last():
    tok = build_word_tokenizer(["one two three four five six seven eight nine ten"])
    ids, mask = TextTokenizer(tok, 6)(["one two three four five six seven", "one two"])
    assert ids.shape == mask.shape == (2, 6)
    words = tok(["one two three four"], add_special_tokens=False)["input_ids"][0]
    assert ids[0].tolist() == [tok.bos_token_id, *words, tok.eos_token_id]  # bos + L-2 tokens + eos
    assert mask[1].tolist() == [1, 1, 1, 1, 0, 0]
    assert ids[1, 3].item() == tok.eos_token_id


class _NoEosOnTruncation:
    """A tokenizer that truncates after adding specials (eos cut off), to check the guard."""

    eos_token_id = 9

    def __call__(self, texts, max_length, **kw):
        rows = [[8, *range(1, len(t.split()) + 1), 9][:max_length] for t in texts]
        pad = [r + [9] * (max_length - len(r)) for r in rows]
        return {
            "input_ids": torch.tensor(pad),
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (max_length - len(r)) for r in rows]),
        }


def test_tokeniser_forces_eos_into_the_last_position_when_a_tokenizer_cuts_it():
    ids, _ = TextTokenizer(_NoEosOnTruncation(), 4)(["a b c d e", "a"])
    assert ids[0].tolist() == [8, 1, 2, 9]
    assert ids[1].tolist() == [8, 1, 9, 9]


def test_untruncated_lengths_include_bos_and_eos():
    tok = build_word_tokenizer(["red circle"])
    assert TextTokenizer(tok, 4).lengths(["red circle red circle red", "red"]) == [7, 3]


@pytest.mark.parametrize("kind", ["clip", "siglip", "siglip2"])
def test_model_transforms_feed_the_model_including_siglip2_naflex(kind):

    model = tiny_model(kind)
    image, text = model_transforms(model)
    pixels = image(_image(50, 40, seed=1)).unsqueeze(0)
    ids, mask = text(["red square"])
    with torch.no_grad():
        assert model.encode_image(pixels).embedding.shape[0] == 1
        assert model.encode_text(ids, mask).embedding.shape[0] == 1


@pytest.mark.parametrize(("w", "h", "mode"), [(300, 200, "RGB"), (37, 53, "RGBA"), (50, 20, "L")])
def test_siglip_models_get_siglips_square_resize_not_clips_crop(w, h, mode):
    from transformers import SiglipImageProcessorPil

    model = tiny_model("siglip")
    preprocess, _ = model_transforms(model, alpha="white")  # HF's processor composites transparency onto white
    assert not preprocess.crop and "no crop" in preprocess.interpolation
    img = _image(w, h, mode, seed=w * h)
    theirs = SiglipImageProcessorPil(size={"height": 32, "width": 32})(img, return_tensors="np")["pixel_values"][0]
    torch.testing.assert_close(preprocess(img), torch.as_tensor(np.asarray(theirs)).float(), atol=1e-5, rtol=0)
    clip_preprocess, _ = model_transforms(tiny_model("clip"))
    assert clip_preprocess.crop and "centre crop" in clip_preprocess.interpolation
