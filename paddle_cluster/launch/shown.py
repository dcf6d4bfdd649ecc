"""What a job wrote, made safe to show in a terminal: ``printable`` makes control and format characters visible
(an escape sequence that would set the title, clear the screen or hide text is shown as ``\\x1b]0;...``), and the
commands put it in a rich ``Text``, never in markup (``[link=...]`` in a metric name stays those characters)."""

from __future__ import annotations

import unicodedata

# Control characters (C0, DEL, C1: ESC starts every CSI/OSC sequence), format characters (bidi overrides,
# zero-width ones), lone surrogates (undecodable bytes) and the line and paragraph separators.
_HIDDEN = ("Cc", "Cf", "Cs", "Zl", "Zp")


def printable(text: object) -> str:
    """``text`` as one line of visible characters: each control or format character as ``\\xHH``/``\\uHHHH``."""
    s = text if isinstance(text, str) else str(text)
    if s.isprintable():
        return s
    return "".join(ch if ch == " " or unicodedata.category(ch) not in _HIDDEN else
                   f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}" for ch in s)
