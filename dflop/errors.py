"""Errors caused by the user's input (config, data, plan), reported as one readable line.

The CLI prints these without a traceback; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: the message is one line naming the file, key or sample at fault."""


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first non-empty line of an exception's message, printable, at most `limit` characters:
    library messages (Arrow, FFmpeg) span lines and may quote the corrupt bytes they choked on."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return "".join(c if c.isprintable() else "?" for c in lines[0])[:limit]
