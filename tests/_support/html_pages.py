"""Read back an HTML page sharpclip wrote, with the standard library's `html.parser`, and check the rules every page
holds to (analysis/pages.py): a complete document, every `<img src>` a relative link to a file that exists, nothing
fetched from a network (no http(s)/protocol-relative URL in src/href, no external script or style sheet).

    page = check_page(out / "search.html")          # fails the test on a broken rule
    assert page.images == [...]; assert "a red cube" in page.text
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class ParsedPage:
    """What a page holds: its tags in order, image links (as written), the `alt`s, classes and visible text."""

    tags: list[str] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    alts: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    classes: list[str] = field(default_factory=list)
    title: str = ""
    text: str = ""
    open_at_end: list[str] = field(default_factory=list)

    def image_files(self, page: Path) -> list[Path]:
        """The files the `<img src>`s name, resolved against the page's folder."""
        return [page.parent / unquote(src) for src in self.images]


class _Reader(HTMLParser):
    VOID = frozenset({"meta", "img", "br", "hr", "link", "input", "source", "col", "area", "base", "wbr"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.page = ParsedPage()
        self.stack: list[str] = []
        self.mismatched: list[str] = []
        self._text: list[str] = []

    def handle_starttag(self, name: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.page.tags.append(name)
        self.page.classes += (a.get("class") or "").split()
        if name == "img":
            self.page.images.append(a.get("src") or "")
            self.page.alts.append(a.get("alt") or "")
        for key in ("href", "src"):
            if key in a and name != "img":
                self.page.links.append(a[key] or "")
        if name not in self.VOID:
            self.stack.append(name)

    def handle_endtag(self, name: str) -> None:
        if self.stack and self.stack[-1] == name:
            self.stack.pop()
        else:
            self.mismatched.append(name)

    def handle_data(self, data: str) -> None:
        if self.stack and self.stack[-1] == "title":
            self.page.title += data
        elif "style" not in self.stack:
            self._text.append(data)


def parse_page(path: Path) -> ParsedPage:
    """Parse the page without checking it."""
    reader = _Reader()
    reader.feed(Path(path).read_text(encoding="utf-8"))
    reader.close()
    reader.page.text = " ".join(" ".join(reader._text).split())
    reader.page.open_at_end = reader.stack + reader.mismatched
    return reader.page


def _remote(url: str) -> bool:
    return url.startswith("//") or urlparse(url).scheme in ("http", "https", "ftp", "ws", "wss")


def check_page(path: Path) -> ParsedPage:
    """Parse the page and assert the rules: doctype + html/head/title/body, balanced tags, every `<img src>` a
    relative link to an existing file, no remote URL anywhere. Returns the parsed page for further checks."""
    path = Path(path)
    source = path.read_text(encoding="utf-8")
    assert source.lstrip().lower().startswith("<!doctype html>"), f"{path}: no <!DOCTYPE html>"
    page = parse_page(path)
    for name in ("html", "head", "title", "body"):
        assert name in page.tags, f"{path}: no <{name}>"
    assert page.open_at_end == [], f"{path}: unbalanced tags {page.open_at_end}"
    assert "<script" not in source.lower() and "@import" not in source, f"{path}: scripts or imported styles"
    for src in page.images + page.links:
        assert src and not _remote(src), f"{path}: remote or empty link {src!r}"
        assert not Path(unquote(src)).is_absolute(), f"{path}: absolute link {src!r}"
    for src, file in zip(page.images, page.image_files(path), strict=True):
        assert file.is_file(), f"{path}: <img src={src!r}> names no file ({file})"
    return page
