"""Self-contained HTML pages for people to read: search results, qualitative retrieval, caption pairs, feature maps.

Every page sharpclip writes goes through `Page`, so that each one holds to the same rules:

- **self-contained**: one `.html` file; its images are files in a folder beside it (`<page stem>_files/`), named by
  relative links; the style sheet is inline. Nothing is fetched from a network (no CDN, no web fonts, no scripts),
  so the page opens the same from a laptop, a cluster's shared disk or a copied zip.
- **escaped**: every piece of text (captions, file names, titles) passes `html.escape`; only `Markup` (HTML this
  module built) is inserted as it is. A caption holding `<b>` or `&` shows those characters.
- **thumbnails**: `Page.thumbnail(image)` writes a downscaled copy (longest side `thumb_size`, PNG) into the folder
  and returns its relative link; the same `key` is written once.
- **owned**: the page and its thumbnails are written by `sharpclip.owned_files`' rule: a page's name ends in
  `.html`; an existing file there, or a thumbnail's name in `<page stem>_files/`, is replaced only when sharpclip wrote
  it; a `_files` symbolic link or file is refused, before anything is written (`flag` names the option in the
  refusal, e.g. `--html`). The page carries `<meta name="generator" content="sharpclip">`.

A page is built top to bottom and written at the end::

    page = Page(out / "search.html", "Search: a red cube")
    page.heading("Top 5")
    cells = [page.figure(page.thumbnail(path, key=path), caption=f"#{i + 1} 0.812", mark=i == 0) for i, path in ...]
    page.add(page.row(cells))
    page.write()

Markup helpers return `Markup` (a `str` known to be HTML) so they nest: `page.table(["query", "rank"], rows)` takes
plain strings (escaped) or `Markup` cells.
"""

from __future__ import annotations

import difflib
import html
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from PIL import Image

from sharpclip import owned_files
from sharpclip.data.images import load_image
from sharpclip.eval.embed import ImageRef
from sharpclip.eval.embed import load_image as load_ref

THUMB_SIZE = 192  # pixels, the longest side of a thumbnail: four or five to a row at 1280 px

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5em; color: #222; max-width: 1400px; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
h3 { font-size: 1em; margin: 1em 0 0.3em; }
p.note { color: #555; font-size: 0.9em; }
.row { display: flex; flex-wrap: wrap; gap: 10px; align-items: flex-start; }
figure { margin: 0; width: %(w)dpx; border: 3px solid transparent; padding: 2px; }
figure.mark { border-color: #1a9850; background: #e9f7ef; }
figure img { display: block; width: %(w)dpx; height: %(w)dpx; object-fit: contain; image-rendering: pixelated; }
figcaption { font-size: 0.8em; line-height: 1.25; word-wrap: break-word; margin-top: 3px; }
table { border-collapse: collapse; font-size: 0.9em; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
.query { font-size: 1em; background: #f6f6f6; padding: 6px 10px; border-left: 4px solid #4575b4; }
.cols { display: flex; gap: 28px; flex-wrap: wrap; } .cols > div { flex: 1 1 0; min-width: 320px; }
.bad { color: #b2182b; } .good { color: #1a9850; }
"""


class Markup(str):
    """A string that is already HTML (built by this module): inserted as it is, never escaped again. `+` with plain
    text escapes the text and stays Markup."""

    def __add__(self, other: Any) -> Markup:
        return Markup(str.__add__(self, escape(other)))

    def __radd__(self, other: Any) -> Markup:
        return Markup(str.__add__(escape(other), self))


def escape(text: Any) -> Markup:
    """`text` as HTML-safe characters (`html.escape`, quotes included); `Markup` passes unchanged."""
    return text if isinstance(text, Markup) else Markup(html.escape(str(text), quote=True))


def tag(name: str, body: Any = "", **attrs: Any) -> Markup:
    """`<name attrs>body</name>`; attribute values and a non-Markup body are escaped. `class_` sets `class`."""
    spelled = "".join(f' {k.rstrip("_")}="{escape(v)}"' for k, v in attrs.items() if v is not None)
    return Markup(f"<{name}{spelled}>{escape(body)}</{name}>")


def join(parts: Iterable[Any]) -> Markup:
    """Concatenate escaped parts into one piece of Markup."""
    return Markup("".join(escape(p) for p in parts))


def load_any(image: Any) -> Image.Image:
    """A PIL image from a PIL image, an eval ImageRef (zip members, ARO's boxes) or any data.schema.ImageSource."""
    if isinstance(image, Image.Image):
        return image
    return load_ref(image) if isinstance(image, ImageRef) else load_image(image)


def marked_differences(reference: str, text: str) -> Markup:
    """`text` escaped, its words that are not in `reference` at the aligned place wrapped in `<mark>` (difflib over
    whitespace-separated words): what a near-duplicate caption changes."""
    ref, words = reference.split(), text.split()
    out = []
    for op, _, _, j1, j2 in difflib.SequenceMatcher(a=ref, b=words, autojunk=False).get_opcodes():
        chunk = escape(" ".join(words[j1:j2]))
        if chunk:
            out.append(chunk if op == "equal" else tag("mark", chunk))
    return Markup(" ".join(out))


def _safe_name(key: str) -> str:
    """A file name from any key: path separators and odd characters become `_` (links stay plain ASCII)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("._")[-80:] or "image"


class Page:
    """One HTML page at `path` with its thumbnails in `path.parent / (path.stem + "_files")`.

    Build with `heading`, `paragraph`, `add` (Markup from `table`, `row`, `figure`, `tag`), then `write()`.
    """

    def __init__(self, path: str | Path, title: str, thumb_size: int = THUMB_SIZE, flag: str = "--out") -> None:
        self.path = Path(path)
        self.title = title
        self.thumb_size = thumb_size
        self.flag = flag
        self.assets = self.path.parent / f"{self.path.stem}_files"
        self._claimed = False
        self._body: list[str] = []
        self._written: dict[str, str] = {}  # key -> relative link

    def claim(self) -> None:
        """Refuse (owned_files.NotOurs, one line) a page name not ending in .html, a file there that sharpclip did not
        write, or a `_files` that is a link or a file; called before the first thumbnail or the page is written."""
        if self._claimed:
            return
        flag = self.flag
        if self.path.suffix.lower() != ".html":
            raise owned_files.NotOurs(f"{flag} {self.path}: a page's name must end in .html; choose another {flag}")
        owned_files.check([self.path], flag)
        if self.assets.is_symlink() or (self.assets.exists() and not self.assets.is_dir()):
            owned_files.folder(self.assets, flag, derived=True)  # raises its one line
        self._claimed = True

    # -- images -----------------------------------------------------------------------------------------------------
    def thumbnail(self, image: Any, key: str | None = None) -> str:
        """Save a thumbnail of `image` (a PIL image, an eval ImageRef, or any ImageSource: path, bytes, parquet cell)
        beside the page; returns its relative link. `key` names the file and de-duplicates (default: a running
        number)."""
        key = str(key) if key is not None else f"img{len(self._written)}"
        if key in self._written:
            return self._written[key]
        picture = load_any(image)
        picture = picture.convert("RGBA" if picture.mode in ("RGBA", "LA") else "RGB")
        picture.thumbnail((self.thumb_size, self.thumb_size))
        name = f"{len(self._written):05d}_{_safe_name(key)}"
        name = name if name.lower().endswith(".png") else name + ".png"
        self.claim()
        owned_files.folder(self.assets, self.flag, derived=True)
        with owned_files.writing(self.assets / name, self.flag) as tmp:
            picture.save(tmp, format="PNG")
        self._written[key] = f"{quote(self.assets.name)}/{quote(name)}"
        return self._written[key]

    def local(self, file: str | Path) -> str:
        """The relative link from the page to a file written beside it (or below its folder), e.g. a PNG figure."""
        file = Path(file).resolve()
        return "/".join(quote(part) for part in file.relative_to(self.path.parent.resolve()).parts)

    # -- markup -----------------------------------------------------------------------------------------------------
    def figure(self, src: str, caption: Any = "", mark: bool = False, alt: str = "") -> Markup:
        """A thumbnail with a caption under it; `mark` draws the green ground-truth frame."""
        img = Markup(f'<img src="{escape(src)}" alt="{escape(alt or caption)}" loading="lazy">')
        return tag("figure", join([img, tag("figcaption", caption)]), class_="mark" if mark else None)

    @staticmethod
    def row(items: Iterable[Any]) -> Markup:
        """Items side by side, wrapping."""
        return tag("div", join(items), class_="row")

    @staticmethod
    def columns(items: Iterable[Any]) -> Markup:
        """Blocks in equal columns (one per model, say)."""
        return tag("div", join(tag("div", item) for item in items), class_="cols")

    @staticmethod
    def table(header: Sequence[Any], rows: Iterable[Sequence[Any]]) -> Markup:
        """An HTML table; cells are plain text (escaped) or Markup."""
        head = tag("tr", join(tag("th", h) for h in header))
        body = join(tag("tr", join(tag("td", c) for c in row)) for row in rows)
        return tag("table", join([tag("thead", head), tag("tbody", body)]))

    def heading(self, text: Any, level: int = 2) -> None:
        """Append `<h{level}>`."""
        self._body.append(tag(f"h{level}", text))

    def paragraph(self, text: Any, note: bool = False) -> None:
        """Append a paragraph (`note`: smaller, grey)."""
        self._body.append(tag("p", text, class_="note" if note else None))

    def add(self, markup: Any) -> None:
        """Append Markup (or text, escaped)."""
        self._body.append(escape(markup))

    def render(self) -> str:
        """The whole document as a string."""
        style = STYLE % {"w": self.thumb_size}
        return (
            '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            '<meta name="generator" content="sharpclip">\n'
            f"<title>{escape(self.title)}</title>\n<style>{style}</style>\n</head>\n<body>\n"
            f"{tag('h1', self.title)}\n" + "\n".join(self._body) + "\n</body>\n</html>\n"
        )

    def write(self) -> Path:
        """Write the page (UTF-8); returns its path. Thumbnails were written as they were added."""
        self.claim()
        return owned_files.write_text(self.path, self.render(), self.flag)
