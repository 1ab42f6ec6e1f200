"""Text from outside (results files, bundles, kernel records, package metadata) made safe for where it lands:
one function per destination (pure, standard library only).

Every string a results file or a bundle carries is data, never an instruction: it must not move a terminal's
cursor, reverse the reading order of the line around it, start a markdown construct, or become shell syntax.
The characters that can do that in any destination are shown visibly here, as their Python escape
(``\\x1b``, ``\\u202e``), never passed through and never dropped without a trace:

- C0 controls (U+0000-U+001F) and DEL, except the tab and newline a destination allows;
- C1 controls (U+0080-U+009F);
- the bidirectional embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069) and the other
  invisible format and separator characters (zero-width spaces and joiners U+200B-U+200F, the line and
  paragraph separators U+2028/9, the byte order mark U+FEFF, the Arabic letter mark U+061C, lone
  surrogates...), listed here, not left to what one Python release calls unprintable;
- characters that are letters or symbols to Unicode yet draw nothing (the Hangul fillers U+115F, U+1160,
  U+3164, U+FFA0, the blank Braille pattern U+2800) and combining marks (categories Mn, Me), which draw over
  the character before them and can make one text look like another.

Every destination goes through the one test (:func:`unsafe`) and the one way of showing (:func:`visible`), the
terminal included. A Markdown page also turns a bare address into a link (``https://``, ``www.``, an e-mail
address): :func:`markdown` breaks each with an escape the renderer removes (``https\\://``, ``www\\.``) or,
for an e-mail address, a backslash that stays visible (``user\\@host.example``).

The destinations:

- :func:`terminal`: one line for stdout/stderr (a newline shows as ``\\n``);
- :func:`markdown`: one line or table cell of a Markdown page, every construct escaped (emphasis, code, links,
  images, raw HTML, entities, headings, block quotes, table bars);
- :func:`markdown_prose`: one line composed by stackprobe itself whose code spans are its own (commands in
  backticks); everything else as :func:`markdown`;
- :func:`html`: text for an HTML page (controls visible, then ``& < > " '`` as entities);
- :func:`shell`: one word of a command line a person pastes (controls visible, then shell-quoted);
  :func:`command` and :func:`setting` whole command lines and settings built from such words.
"""

from __future__ import annotations

import html as _html
import re
import shlex
import unicodedata
from collections.abc import Iterable

BIDI = frozenset(chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A)))
# Invisible whatever Python's Unicode tables say: zero-width and directional marks, separators, the byte
# order mark, the word joiner family, the Mongolian vowel separator, the fillers and the blank Braille cell.
INVISIBLE = frozenset(chr(c) for c in (*range(0x200B, 0x2010), 0x2028, 0x2029, 0xFEFF, 0x061C, 0x00AD, 0x180E,
                                       *range(0x2060, 0x2065), 0x115F, 0x1160, 0x3164, 0xFFA0, 0x2800))
MARKS = frozenset({"Mn", "Me"})  # combining marks: drawn over the character before them
# Backslash-escaped in Markdown (CommonMark escapes any ASCII punctuation this way): each can open a construct.
MD_SPECIAL = frozenset("\\`*[]<>|#~&!$")  # $: math on GitHub
# An underscore opens or closes emphasis only beside a non-alphanumeric (CommonMark): NCCL_ALGO stays as written
_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")
_MD_TRANS = {ord(c): "\\" + c for c in MD_SPECIAL} | {ord("<"): "&lt;", ord(">"): "&gt;"}  # no raw HTML
_MD_PROSE_TRANS = {k: v for k, v in _MD_TRANS.items() if k != ord("`")}
_LINE_START = re.compile(r"^(\s*)(?:([-+=])|(\d+)([.)]))")  # a list item, a setext underline, a numbered item


def _line_start(text: str) -> str:
    m = _LINE_START.match(text)
    if not m:
        return text
    lead, mark, digits, dot = m.groups()
    return lead + (f"\\{mark}" if mark else f"{digits}\\{dot}") + text[m.end():]
_FENCE = re.compile(r"`{3,}|~{3,}")


def unsafe(c: str) -> bool:
    """Whether one character may act rather than read, or reads as nothing: a control, a bidirectional, an
    invisible one or a combining mark (the module's list)."""
    o = ord(c)
    if o < 0x7F:
        return o < 0x20
    return (o <= 0x9F or c in BIDI or c in INVISIBLE or not c.isprintable()
            or unicodedata.category(c) in MARKS)


def visible(text: object, keep: str = "") -> str:
    """``text`` with every unsafe character (see :func:`unsafe`) written as its Python escape, the characters in
    ``keep`` (tab, newline) left as they are."""
    s = str(text)
    if s.isascii() and s.isprintable():  # the common case: printable ASCII holds nothing unsafe
        return s
    out = []
    for i, c in enumerate(s):
        if c in keep or not unsafe(c) or (c in EMOJI_STYLE and i and _emoji_base(s[i - 1])):
            out.append(c)
        else:
            out.append(ascii(c)[1:-1])
    return "".join(out)


# The text and emoji presentation selectors: one right after a symbol (⏸️, ⚠️) is how an emoji is spelled and
# draws as part of it; anywhere else (after a letter, a second one in a row) it only hides, and is shown.
EMOJI_STYLE = frozenset("\ufe0e\ufe0f")


def _emoji_base(c: str) -> bool:
    return not c.isascii() and unicodedata.category(c) == "So"


def has_unsafe(text: str, keep: str = "\t\n") -> bool:
    """Whether ``text`` holds a character :func:`visible` would escape (``keep`` allowed)."""
    return any(unsafe(c) and c not in keep for c in text)


def terminal(text: object) -> str:
    """One line for a terminal: nothing in it can start a line of its own, move the cursor or reorder text."""
    return visible(text)


def _md_base(text: object) -> str:
    return visible(str(text).replace("\r\n", " ").replace("\n", " ").replace("\r", " "))


def _inline(text: str, table: dict[int, str], code_spans: bool = False) -> str:
    """Inline constructs escaped by ``table``; bare addresses unlinked, inside ``code_spans`` of the line's own
    (where a renderer links nothing and an escape would show) left as written."""
    out = _UNDERSCORE.sub(r"\\_", text.translate(table)).replace("](", "]\\(")
    if not code_spans:
        return _unlinked(out)
    parts = _CODE_SPAN.split(out)  # text, run, code, text, run, code, ...
    return "".join(_unlinked(p) if i % 3 == 0 else p + (parts[i - 1] if i % 3 == 2 else "")
                   for i, p in enumerate(parts))


_CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.*?)(?<!`)\1(?!`)")


# A bare address GitHub's renderer links (its autolink extension): a scheme's "://", a "www." and an e-mail
# address. The escapes of the first two are removed when the page is drawn (it reads as written, unlinked); the
# renderer reads an e-mail address after escapes are gone, so its at sign keeps a backslash that stays visible.
_SCHEME = re.compile(r"://")
_WWW = re.compile(r"(?i)\bwww\.")
_EMAIL_AT = re.compile(r"(?<=[A-Za-z0-9.+_-])@(?=[\\A-Za-z0-9_-]+\.)")


def _unlinked(text: str) -> str:
    if "://" not in text and "@" not in text and "." not in text:
        return text
    text = _SCHEME.sub(r"\\://", text)
    text = _WWW.sub(lambda m: m.group(0)[:-1] + "\\.", text)
    return _EMAIL_AT.sub(r"\\\\@", text)


def markdown(text: object) -> str:
    """Text from outside for a table cell or the middle of a Markdown line: shown as written, every inline
    construct escaped (a block construct opens only at a line's start, where :func:`markdown_prose` goes)."""
    return _inline(_md_base(text), _MD_TRANS)


def markdown_prose(text: object) -> str:
    """A line stackprobe composed (its own code spans in backticks) for Markdown: controls visible, raw HTML,
    links, emphasis, entities and table bars escaped, no code fence (a run of three backticks is escaped), and
    no list item, numbered item or underline opened where the line starts."""
    out = _line_start(_inline(_md_base(text), _MD_PROSE_TRANS, code_spans=True))
    return _FENCE.sub(lambda m: "".join("\\" + c for c in m.group(0)), out)


def html(text: object) -> str:
    """Text from outside for an HTML page: controls visible, then every markup character an entity."""
    return _html.escape(visible(text, keep="\t\n"), quote=True)


def shell(word: object) -> str:
    """One word of a command line a person pastes: controls visible (a pasted line cannot hide a character),
    then quoted where the shell would read it otherwise."""
    return shlex.quote(visible(word))


_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def command(words: Iterable[str]) -> str:
    """Words joined into one command line a person pastes, each quoted where the shell would read it otherwise
    (a plain word stays as it is: ``--only cu130-torch2.11.0-sgl0.4.2-fi0.6.16``)."""
    return " ".join(shell(w) for w in words)


def setting(text: str) -> str:
    """An environment assignment (``NAME=value``: the value quoted) or a flag (quoted as one word)."""
    m = _ASSIGNMENT.match(text)
    if m:
        return m.group(0) + shell(text[m.end():])
    return shell(text)
