"""The one exception type for mistakes a user can make (paths, options, configs).

run.py turns a `KvminiError` into a single line on stderr and exit code 2;
anything else is a bug and keeps its traceback.
"""


class KvminiError(Exception):
    """A user-facing error: the message must say what was wrong and, if possible, what to do."""
