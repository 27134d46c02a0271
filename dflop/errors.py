"""Errors caused by the user's input (config, data, plan), reported as one readable line.

The CLI prints these without a traceback; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: the message is one line naming the file, key or sample at fault."""
