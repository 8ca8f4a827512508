"""Text bound for a mail header: one line, no control character, bounded.

A header value may not hold CR or LF (RFC 5322): a node's text with ``\\r\\n\\r\\n`` would end the headers and
write the mail's body, one with ``\\r\\nBcc: ...`` would add a header (or, where the mail library refuses it, keep
the alert from being sent at all). Every value eagleflow puts into a header (a subject, a Message-ID,
In-Reply-To) goes through ``header_text``: whitespace runs (line breaks included) become one space, any other
control character is escaped (``eagleflow.protocol.one_line``, the one way node text is made safe), and the
length is bounded.
"""
from __future__ import annotations

from eagleflow.protocol import one_line

MAX_HEADER_CHARS = 400


def header_text(value: object) -> str:
    text = one_line(" ".join(str(value).split()))
    return text if len(text) <= MAX_HEADER_CHARS else text[:MAX_HEADER_CHARS - 3] + "..."
