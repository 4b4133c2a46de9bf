"""The manifest's digests: the image digest names the set of images, not the order a reader met them in; the weights
digest is cached by the files' path, size and mtime; zip members are read through one open archive."""

from __future__ import annotations

from pathlib import Path

from sharpclip.eval.manifest import dataset_record


def test_image_digest_is_independent_of_reading_order(tmp_path):
    paths = []
    for i in range(3):
        path = tmp_path / f"{i}.jpg"
        path.write_bytes(bytes([i]) * (i + 10))
        paths.append(path)
    forward = dataset_record([], images=paths, hash_images=True)["images"]
    backward = dataset_record([], images=paths[::-1], hash_images=True)["images"]
    assert forward == backward and forward["count"] == 3 and forward["bytes"] == 10 + 11 + 12
    paths[0].write_bytes(b"changed")
    assert (
        dataset_record([], images=paths, hash_images=True)["images"]["sha256_of_sorted_list"]
        != forward["sha256_of_sorted_list"]
    )


def test_weights_digest_is_cached_by_path_size_and_mtime(tmp_path, monkeypatch):
    import os

    import torch

    from sharpclip.eval import manifest

    model = torch.nn.Linear(4, 3)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x" * 10)
    calls = []
    real = manifest.weights_sha256
    monkeypatch.setattr(manifest, "weights_sha256", lambda m: calls.append(1) or real(m))
    first = manifest.cached_weights_sha256(model, [weights], "cfg", tmp_path / "cache")
    assert first == real(model) and len(calls) == 1
    assert manifest.cached_weights_sha256(model, [weights], "cfg", tmp_path / "cache") == first and len(calls) == 1
    manifest.cached_weights_sha256(model, [weights], "other settings", tmp_path / "cache")
    assert len(calls) == 2  # another config: hashed again
    stamp = weights.stat().st_mtime_ns
    os.utime(weights, ns=(stamp + 10**9, stamp + 10**9))
    manifest.cached_weights_sha256(model, [weights], "cfg", tmp_path / "cache")
    assert len(calls) == 3  # the file changed (mtime): hashed again
    manifest.cached_weights_sha256(model, [], "cfg", tmp_path / "cache")
    assert len(calls) == 4  # no files to key it by (a tiny preset): hashed every time
    (tmp_path / "cache" / manifest.DIGEST_CACHE).write_text("not json")
    assert manifest.cached_weights_sha256(model, [weights], "cfg", tmp_path / "cache") == first  # a damaged cache


def test_zip_members_are_read_through_one_open_archive(tmp_path, monkeypatch):
    import io
    import zipfile

    from PIL import Image

    from sharpclip.eval import embed

    archive = tmp_path / "images.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for i in range(5):
            buf = io.BytesIO()
            Image.new("RGB", (4, 4), (40 * i, 0, 0)).save(buf, format="PNG")
            z.writestr(f"images/{i}.png", buf.getvalue())
    opened = []
    real = zipfile.ZipFile

    def counted(file, *a, **k):  # the reader's opens (of a file object), not this test's own writes (of a path)
        opened.extend([1] * (not isinstance(file, str | Path)))
        return real(file, *a, **k)

    monkeypatch.setattr(embed.zipfile, "ZipFile", counted)
    pixels = [
        embed.load_image(embed.ImageRef(str(archive), member=f"images/{i}.png")).getpixel((0, 0)) for i in range(5)
    ]
    assert pixels == [(40 * i, 0, 0) for i in range(5)] and len(opened) == 1
    with zipfile.ZipFile(archive, "a") as z:  # the archive changed: opened again, the new member found
        buf = io.BytesIO()
        Image.new("RGB", (4, 4), (0, 9, 0)).save(buf, format="PNG")
        z.writestr("images/new.png", buf.getvalue())
    assert embed.load_image(embed.ImageRef(str(archive), member="images/new.png")).getpixel((0, 0)) == (0, 9, 0)
    assert len(opened) == 2
    try:
        embed.load_image(embed.ImageRef(str(archive), member="images/missing.png"))
    except FileNotFoundError as err:
        assert "images.zip!images/missing.png" in str(err)
    else:
        raise AssertionError("a missing member must be a one-line FileNotFoundError")
