"""The one exception type a user can cause.

The CLI prints a ``UserError`` as a single line and exits non-zero; anything
else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A mistake in what the user asked for: the message names the bad value and the way out."""
