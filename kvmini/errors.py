"""The one exception type for mistakes a user can make (paths, options, configs).

Every entry point (run.py, the `python -m kvmini...` tools) turns a `KvminiError` into a single
line on stderr and exit code 2. Their shared error boundary (`kvmini.cli.run`) also turns refusals
from the operating system and anything unforeseen into one line; KVMINI_DEBUG=1 shows the
traceback instead.
"""


class KvminiError(Exception):
    """A user-facing error: the message must say what was wrong and, if possible, what to do."""


def one_of(what: str, value, choices: tuple):
    """`value` if it is one of `choices`, else a KvminiError naming `what`: no part of kvmini falls back
    silently on a mode it does not know. one_of("pooling", "avg", ("avg", "max")) -> "avg"."""
    if value not in choices:
        raise KvminiError(f"{what} must be one of {', '.join(map(str, choices))}, got {value!r}")
    return value


def tokens(n: int) -> str:
    """'1 token', '1,024 tokens': a count in a message."""
    return f"{n:,} token" + ("" if n == 1 else "s")
