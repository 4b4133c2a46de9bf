"""The open_clip-interface losses on one process: at γ = 0 they are open_clip's ClipLoss / SigLipLoss (value and
gradients, fp64), at γ > 0 they are sharpclip's own HN-CLIP losses with the scale given exponentiated."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import CLIPConfig, CLIPModel, SiglipConfig, SiglipModel

from _support import open_clip_reference as ref
from sharpclip.losses import edit_negatives, hn_clip, sigmoid
from sharpclip.losses.drop_in import EditNegativesLoss, HNClipLoss, SigLipMarginLoss, hf_hn_loss

B, D = 6, 5


def _unit(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1)


def _inputs(seed=0, bias=None):
    img, txt = _unit(B, D, seed=seed).requires_grad_(), _unit(B, D, seed=seed + 1).requires_grad_()
    scale = torch.tensor(14.0, dtype=torch.float64, requires_grad=True)
    leaves = [img, txt, scale]
    if bias is not None:
        leaves.append(torch.tensor(bias, dtype=torch.float64, requires_grad=True))
    return leaves


def _value_and_grads(fn, leaves):
    loss = fn(*leaves)
    grads = torch.autograd.grad(loss, leaves)
    return loss.detach(), grads


def _assert_same(a, b, tol=1e-10):
    (va, ga), (vb, gb) = a, b
    assert abs(float(va - vb)) <= tol
    for x, y in zip(ga, gb, strict=True):
        assert torch.allclose(x, y, atol=tol, rtol=0)


@pytest.mark.parametrize("bias", [None, -1.5])
@pytest.mark.parametrize(
    ("local_loss", "gather_with_grad"), [(False, False), (False, True), (True, False), (True, True)]
)
def test_gamma_zero_is_open_clips_clip_loss(bias, local_loss, gather_with_grad):
    leaves = _inputs(bias=bias)
    loss = HNClipLoss(local_loss=local_loss, gather_with_grad=gather_with_grad, gamma=0.0)
    mine = _value_and_grads(lambda *a: loss(*a), leaves)
    theirs = _value_and_grads(lambda *a: ref.clip_loss(*a), leaves)
    _assert_same(mine, theirs)


def test_gamma_positive_is_sharpclips_hn_clip_with_the_scale_exponentiated():
    leaves = _inputs()
    mine = _value_and_grads(lambda i, t, s: HNClipLoss(gamma=0.5)(i, t, s), leaves)
    own = _value_and_grads(lambda i, t, s: hn_clip(i, t, s.log(), gamma=0.5), leaves)
    _assert_same(mine, own)
    assert float(mine[0]) > float(_value_and_grads(lambda *a: ref.clip_loss(*a), leaves)[0])  # the margin adds


def test_margin_is_the_detached_caption_similarity_with_a_zero_diagonal():
    img, txt, scale = _inputs()
    per_image, per_text = HNClipLoss(gamma=0.5).get_logits(img, txt, scale)
    expected = scale * (img @ txt.T + 0.5 * (txt @ txt.T).detach() * (1 - torch.eye(B, dtype=torch.float64)))
    assert torch.allclose(per_image, expected, atol=1e-12) and torch.allclose(per_text, expected.T, atol=1e-12)


def test_a_frozen_reference_as_tensor_callable_or_per_call_argument():
    img, txt, scale = _inputs()
    frozen = _unit(B, D, seed=9)
    expected = hn_clip(img, txt, scale.log(), reference_text=frozen, gamma=0.5)
    assert torch.allclose(HNClipLoss(reference=frozen)(img, txt, scale), expected, atol=1e-12)
    assert torch.allclose(HNClipLoss(reference=lambda t: frozen)(img, txt, scale), expected, atol=1e-12)
    assert torch.allclose(HNClipLoss()(img, txt, scale, reference_text=frozen), expected, atol=1e-12)
    with pytest.raises(ValueError, match="one reference row per text row"):
        HNClipLoss(reference=frozen[:2])(img, txt, scale)


def test_output_dict_and_label_cache_behave_as_open_clips():
    img, txt, scale = _inputs()
    loss = HNClipLoss(cache_labels=True)
    out = loss(img, txt, scale, output_dict=True)
    assert set(out) == {"contrastive_loss"} and out["contrastive_loss"].ndim == 0
    assert loss.prev_num_logits == B and torch.equal(loss.labels[img.device], torch.arange(B))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"use_horovod": True}, "use_horovod=True is not supported"),
        ({"gamma": -0.1}, "must be a finite number >= 0"),
    ],
)
def test_unsupported_settings_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        HNClipLoss(**kwargs)
    assert "\n" not in str(err.value)


def test_a_world_size_without_a_process_group_is_an_error():
    img, txt, scale = _inputs()
    with pytest.raises(ValueError, match=r"initialise torch\.distributed first"):
        HNClipLoss(world_size=2, rank=1)(img, txt, scale)


def test_siglip_gamma_zero_is_open_clips_siglip_loss_and_gamma_positive_is_sharpclips_sigmoid():
    leaves = _inputs(bias=-2.0)
    mine = _value_and_grads(lambda *a: SigLipMarginLoss(gamma=0.0)(*a), leaves)
    _assert_same(mine, _value_and_grads(lambda *a: ref.siglip_loss(*a), leaves))
    margin = _value_and_grads(lambda *a: SigLipMarginLoss(gamma=0.5)(*a), leaves)
    own = _value_and_grads(lambda i, t, s, b: sigmoid(i, t, s.log(), b, gamma=0.5), leaves)
    _assert_same(margin, own)
    with pytest.raises(ValueError, match="choose one of bidir"):
        SigLipMarginLoss(dist_impl="ring")


def test_edit_negatives_loss_is_clip_ins_term_with_the_scale_exponentiated():
    pairs = [_unit(4, D, seed=s).requires_grad_() for s in range(4)]
    scale = torch.tensor(20.0, dtype=torch.float64, requires_grad=True)
    leaves = [*pairs, scale]
    mine = _value_and_grads(lambda *a: EditNegativesLoss()(*a), leaves)
    own = _value_and_grads(lambda *a: edit_negatives(*a[:4], a[4].log()), leaves)
    _assert_same(mine, own)
    assert set(EditNegativesLoss()(*pairs, scale, output_dict=True)) == {"edit_negatives_loss"}


def _tiny(kind):
    tower = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    text = {**tower, "vocab_size": 40, "max_position_embeddings": 8, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0}  # fmt: skip
    vision = {**tower, "image_size": 8, "patch_size": 4}
    torch.manual_seed(0)
    if kind == "clip":
        return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)).eval()
    return SiglipModel(SiglipConfig(text_config=text, vision_config=vision)).eval()


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_hf_loss_reads_a_clipmodel_or_siglipmodel_forward(kind):
    model = _tiny(kind)
    ids = torch.tensor([[1, 5, 6, 2], [1, 7, 2, 0], [1, 9, 9, 2]])
    out = model(input_ids=ids, attention_mask=(ids > 0).long(), pixel_values=torch.randn(3, 3, 8, 8))
    bias = getattr(model, "logit_bias", None)
    got = hf_hn_loss(out, model.logit_scale, bias, gamma=0.5)
    img, txt = out.image_embeds, out.text_embeds
    if kind == "clip":
        expected = hn_clip(img, txt, model.logit_scale, gamma=0.5)
    else:
        expected = sigmoid(img, txt, model.logit_scale.squeeze(), bias.squeeze(), gamma=0.5)
    assert torch.allclose(got, expected, atol=1e-6)
    got.backward()
    assert model.logit_scale.grad is not None and math.isfinite(float(model.logit_scale.grad.sum()))


@pytest.mark.gpu
def test_on_cuda_the_losses_run_where_their_inputs_are_and_match_the_cpu():
    cuda = torch.device("cuda")
    for loss in (HNClipLoss(gamma=0.5, cache_labels=True), SigLipMarginLoss(gamma=0.5)):
        leaves = _inputs(bias=-1.0)
        on_gpu = [x.detach().to(cuda).requires_grad_() for x in leaves]
        value, grads = _value_and_grads(loss, on_gpu)
        assert value.device.type == "cuda" and all(g.device.type == "cuda" for g in grads)
        _assert_same((value.cpu(), [g.cpu() for g in grads]), _value_and_grads(loss, leaves))


@pytest.mark.parametrize("gamma", [float("nan"), float("inf"), -float("inf"), -1, "0.5", True])
@pytest.mark.parametrize("build", [
    lambda g: HNClipLoss(gamma=g),
    lambda g: SigLipMarginLoss(gamma=g),
    lambda g: hf_hn_loss(SimpleNamespace(image_embeds=torch.ones(2, 4), text_embeds=torch.ones(2, 4)),
                         torch.tensor(0.0), gamma=g),
], ids=["HNClipLoss", "SigLipMarginLoss", "hf_hn_loss"])  # fmt: skip
def test_a_gamma_that_is_not_a_finite_number_at_least_0_is_refused_at_construction(build, gamma):
    with pytest.raises(ValueError, match=r"gamma=.* must be a finite number >= 0") as err:
        build(gamma)
    assert "\n" not in str(err.value)


def test_a_0_d_tensor_gamma_is_a_number():
    assert HNClipLoss(gamma=torch.tensor(0.25)).gamma == 0.25
