"""Every class of character that acts or hides, in every destination (common.escape): the terminal, a Markdown
line or table cell, an HTML page and a pasted shell word each show it as its Python escape, never the character
itself; and a bare address a Markdown renderer would turn into a link reaches the page unlinked. The Markdown is
drawn by a real CommonMark renderer (markdown-it) to prove the escapes read as the text that came in."""

from __future__ import annotations

import html as std_html
import re

import pytest
from markdown_it import MarkdownIt

from common import escape

# (name, the character, how Python writes it): each class the module lists, with one or more members
CLASSES = [
    ("escape-byte", "\x1b", "\\x1b"),
    ("nul", "\x00", "\\x00"),
    ("carriage-return", "\r", "\\r"),
    ("delete", "\x7f", "\\x7f"),
    ("c1-csi", "\x9b", "\\x9b"),
    ("rtl-override", "\u202e", "\\u202e"),
    ("rtl-isolate", "\u2067", "\\u2067"),
    ("zero-width-space", "\u200b", "\\u200b"),
    ("zero-width-non-joiner", "\u200c", "\\u200c"),
    ("zero-width-joiner", "\u200d", "\\u200d"),
    ("left-to-right-mark", "\u200e", "\\u200e"),
    ("right-to-left-mark", "\u200f", "\\u200f"),
    ("line-separator", "\u2028", "\\u2028"),
    ("paragraph-separator", "\u2029", "\\u2029"),
    ("byte-order-mark", "\ufeff", "\\ufeff"),
    ("arabic-letter-mark", "\u061c", "\\u061c"),
    ("word-joiner", "\u2060", "\\u2060"),
    ("soft-hyphen", "\u00ad", "\\xad"),
    ("hangul-choseong-filler", "\u115f", "\\u115f"),
    ("hangul-jungseong-filler", "\u1160", "\\u1160"),
    ("hangul-filler", "\u3164", "\\u3164"),
    ("halfwidth-hangul-filler", "\uffa0", "\\uffa0"),
    ("braille-blank", "\u2800", "\\u2800"),
    ("combining-acute", "\u0301", "\\u0301"),
    ("combining-grapheme-joiner", "\u034f", "\\u034f"),
    ("variation-selector", "\ufe0f", "\\ufe0f"),
    ("enclosing-circle", "\u20dd", "\\u20dd"),
    ("tag-character", "\U000e0041", "\\U000e0041"),
    ("lone-surrogate", "\ud800", "\\ud800"),
]
MD = MarkdownIt("commonmark")


def md_text(line: str) -> str:
    """The text a CommonMark renderer draws for one Markdown line, tags removed."""
    return std_html.unescape(re.sub(r"<[^>]+>", "", MD.render(line))).strip()


@pytest.mark.parametrize(("name", "char", "shown"), CLASSES, ids=[c[0] for c in CLASSES])
def test_each_class_is_shown_as_its_escape_in_every_destination(name: str, char: str, shown: str) -> None:
    text = f"cell{char}name"
    assert escape.unsafe(char) and escape.has_unsafe(text)
    assert escape.visible(text) == f"cell{shown}name"
    out = {"terminal": escape.terminal(text), "markdown": escape.markdown(text),
           "prose": escape.markdown_prose(text), "html": escape.html(text), "shell": escape.shell(text)}
    for where, got in out.items():
        assert char not in got, (where, got)
    assert out["terminal"] == f"cell{shown}name"
    assert out["html"] == f"cell{shown}name"
    assert out["shell"] == f"'cell{shown}name'"
    if char == "\r":  # a line break of a Markdown line or cell: a space, as a newline is
        assert out["markdown"] == out["prose"] == "cell name"
        return
    assert out["markdown"] == out["prose"] == "cell" + shown.replace("\\", "\\\\") + "name"
    assert md_text(out["markdown"]) == f"cell{shown}name"  # the page shows the escape as Python writes it


def test_the_fast_path_never_passes_a_printable_but_invisible_character() -> None:
    """Python calls these printable: the guard that skips the per-character test must not trust that."""
    for char in ("\u3164", "\u2800", "\u0301", "\u115f", "\uffa0"):
        assert char.isprintable()
        assert escape.visible(char) == ascii(char)[1:-1]
        assert escape.terminal("ok " + char) != "ok " + char


def test_an_emoji_keeps_its_presentation_selector_and_nothing_else_does() -> None:
    for glyph in ("\u23f8\ufe0f", "\u26a0\ufe0f", "\u2705", "\u2764\ufe0e"):
        assert escape.terminal(glyph) == glyph and escape.markdown(glyph) == glyph
    assert escape.terminal("a\ufe0f") == "a\\ufe0f"  # after a letter it draws nothing: shown
    assert escape.terminal("\u23f8\ufe0f\ufe0f") == "\u23f8\ufe0f\\ufe0f"  # a second in a row hides data
    assert escape.terminal("\u23f8\U000e0100") == "\u23f8\\U000e0100"  # the supplementary selectors always


def test_tab_and_newline_are_kept_only_where_the_destination_allows() -> None:
    assert escape.terminal("a\tb\nc") == "a\\tb\\nc"
    assert escape.html("a\tb\nc") == "a\tb\nc"
    assert escape.markdown("a\nb") == "a b"  # one line or table cell


def test_plain_text_and_ordinary_non_ascii_stay_as_written() -> None:
    for text in ("NCCL_ALGO=Ring", "cu130-torch2.11.0-sgl0.4.2-fi0.6.16", "H100 80GB HBM3", "Gerät für Ñandú",
                 "日本語のホスト", "привет", "µs ± 3 %", "ν=2 → ×1.5"):
        assert escape.terminal(text) == text
        assert escape.html(text) == std_html.escape(text)


URLS = [
    ("https://evil.example/x", "https\\://evil.example/x"),
    ("http://evil.example", "http\\://evil.example"),
    ("ftp://evil.example", "ftp\\://evil.example"),
    ("HTTPS://EVIL.EXAMPLE", "HTTPS\\://EVIL.EXAMPLE"),
    ("www.evil.example", "www\\.evil.example"),
    ("WWW.evil.example", "WWW\\.evil.example"),
    ("(www.evil.example)", "(www\\.evil.example)"),
]


@pytest.mark.parametrize(("url", "md"), URLS, ids=[u[0] for u in URLS])
def test_a_bare_address_reaches_a_markdown_page_unlinked_and_reads_as_written(url: str, md: str) -> None:
    text = f"see {url} now"
    assert escape.markdown(text) == f"see {md} now"
    assert escape.markdown_prose(text) == f"see {md} now"
    assert md_text(escape.markdown(text)) == text  # the escape is gone once drawn: the text as it came
    assert escape.terminal(text) == text  # a terminal and an HTML page link nothing by themselves
    assert escape.html(text) == std_html.escape(text) and "<a" not in escape.html(text)


def test_an_e_mail_address_keeps_a_visible_backslash_before_its_at_sign() -> None:
    """GitHub's renderer links an address after removing escapes, so the break must stay in the drawn text."""
    assert escape.markdown("mail ops@evil.example now") == "mail ops\\\\@evil.example now"
    assert md_text(escape.markdown("mail ops@evil.example now")) == "mail ops\\@evil.example now"
    assert escape.markdown("mailto:ops@evil.example") == "mailto:ops\\\\@evil.example"
    assert escape.markdown("rank@0 and @user") == "rank@0 and @user"  # no domain after it: not an address
    assert escape.terminal("ops@evil.example") == "ops@evil.example"


def test_our_own_code_spans_keep_their_addresses_as_written() -> None:
    """A line stackprobe composed may name an address in a code span, where a renderer links nothing and an
    escape would show."""
    line = "install with `uv pip install --index-url https://download.example/whl torch` first"
    assert escape.markdown_prose(line) == line
    assert escape.markdown_prose("see https://x.example and `https://y.example`") == (
        "see https\\://x.example and `https://y.example`")


def test_provision_abi_prints_no_byte_of_a_wheels_names_raw() -> None:
    """Package, version, variant and symbol text from wheels reaches `provision abi`'s grid, its detail, its
    findings and its closing note shown as escapes; the grid's columns stay aligned on what is printed."""
    from common import abi
    from provision.abi import view
    from provision.abi.index import Made, Want

    evil_sym = "_ZN3c103fooEv\x1b]8;;https://evil.example\x07click\x1b]8;;\x07"
    torch = abi.TorchIndex("2.9.1\x1b[2J", "cu130\u202e", 13, "torch.whl", "sha256-" + "1" * 64,
                           frozenset({"_ZN3c103barEv"}))
    ext = abi.ExtensionIndex("sgl\u200bkernel", "0.4.10\r", "k.whl", "sha256-" + "2" * 64, "2.9.1\x1b[31m",
                             frozenset({evil_sym}), frozenset(), ("libcudart.so.13",), ("sgl_kernel/x.so",))
    g = abi.grid([torch], [ext])
    lines = view.grid_lines(g, detail=True)
    made = [Made(Want("sgl\u2028kernel", "0.4.11\x9b"), None, "no wheel \x1b[1mfor\u3164 this", "registry", 0, 0.0)]
    lines += view.summary(made, 1.0, None)
    for line in lines:
        assert not any(escape.unsafe(c) for c in line), repr(line)
    text = "\n".join(lines)
    for shown in ("2.9.1\\x1b[2J", "cu130\\u202e", "sgl\\u200bkernel", "0.4.10\\r", "sgl\\u2028kernel",
                  "0.4.11\\x9b", "no wheel \\x1b[1mfor\\u3164 this"):
        assert shown in text, (shown, text)
    header, variants = lines[0], lines[1]
    assert variants.index("cu130\\u202e") == header.index("2.9.1\\x1b[2J")  # aligned on the printed text
