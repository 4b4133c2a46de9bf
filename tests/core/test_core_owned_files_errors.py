"""A write that fails (a full disk) names the file it was writing, leaves the old file byte-identical and no
temporary file behind."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from sharpclip import owned_files


def test_a_full_disk_names_the_page_and_keeps_the_old_one(tmp_path: Path) -> None:
    page = owned_files.write_text(tmp_path / "p.html", "<p>old</p>\n", "--html")
    full = pytest.raises(OSError, match=r"cannot write .*p\.html: No space left on device")
    with full as caught, owned_files.writing(page, "--html") as tmp:
        tmp.write_text("<p>half")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert caught.value.errno == errno.ENOSPC
    assert page.read_text() == "<p>old</p>\n" and owned_files.is_ours(page)
    assert sorted(p.name for p in tmp_path.iterdir()) == [owned_files.REGISTRY, "p.html"]
