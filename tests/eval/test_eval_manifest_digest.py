"""The manifest's image digest names the set of images, not the order a reader met them in."""

from __future__ import annotations

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
