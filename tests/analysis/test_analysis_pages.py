"""analysis/pages.py: escaping, thumbnails beside the page, relative links, and the page checker itself."""

from __future__ import annotations

import pytest
from PIL import Image

from _support.html_pages import check_page, parse_page
from sharpclip.analysis.pages import Markup, Page, escape, marked_differences, tag


def test_escape_text_and_pass_markup():
    assert escape('<b>"a" & b</b>') == "&lt;b&gt;&quot;a&quot; &amp; b&lt;/b&gt;"
    assert escape(Markup("<i>x</i>")) == "<i>x</i>"
    both = Markup("<i>x</i>") + "<y>" + Markup("<br>")
    assert both == "<i>x</i>&lt;y&gt;<br>" and isinstance(both, Markup)
    assert "<z>" + Markup("<br>") == "&lt;z&gt;<br>"
    assert tag("td", "1 < 2", class_="a&b") == '<td class="a&amp;b">1 &lt; 2</td>'


def test_page_thumbnails_escape_and_relative_links(tmp_path):
    big = tmp_path / "in dir" / "big image.png"
    big.parent.mkdir()
    Image.new("RGB", (640, 320), (200, 10, 10)).save(big)
    page = Page(tmp_path / "out" / "my page.html", "T <script>", thumb_size=64)
    first = page.thumbnail(big, key=str(big))
    assert page.thumbnail(big, key=str(big)) == first  # one file per key
    second = page.thumbnail(Image.new("L", (10, 30)))
    page.add(page.row([page.figure(first, "caption <b>&</b>", mark=True), page.figure(second, "x")]))
    page.add(page.table(["q", "rank"], [["a<b", Markup("<b>3</b>")]]))
    path = page.write()
    parsed = check_page(path)
    assert parsed.title == "T <script>" and "caption <b>&</b>" in parsed.text and "a<b" in parsed.text
    assert parsed.classes.count("mark") == 1 and len(parsed.images) == 2
    files = parsed.image_files(path)
    assert all(f.parent == tmp_path / "out" / "my page_files" for f in files)
    assert max(Image.open(files[0]).size) == 64  # downscaled, aspect kept
    assert Image.open(files[0]).size == (64, 32)


def test_checker_fails_on_missing_image_and_remote_links(tmp_path):
    page = Page(tmp_path / "p.html", "p")
    page.add(page.figure("p_files/none.png", "gone"))
    with pytest.raises(AssertionError, match="names no file"):
        check_page(page.write())
    (tmp_path / "q.html").write_text(
        '<!DOCTYPE html><html><head><title>q</title></head><body><a href="https://cdn.example/x.js">x</a></body></html>'
    )
    with pytest.raises(AssertionError, match="remote"):
        check_page(tmp_path / "q.html")
    assert parse_page(tmp_path / "q.html").links == ["https://cdn.example/x.js"]


def test_marked_differences_marks_the_changed_words_only():
    got = marked_differences("a large dotted cyan cross <x>", "a large striped cyan cross <x> too")
    assert got == "a large <mark>striped</mark> cyan cross &lt;x&gt; <mark>too</mark>"
    assert marked_differences("same words", "same words") == "same words"
