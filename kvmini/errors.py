"""The one exception type for mistakes a user can make (paths, options, configs). Every entry point
turns it into one line on stderr and exit code 2 (`kvmini.cli.run`; KVMINI_DEBUG=1: the traceback).
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
