"""A guard for the files kvmini reads or writes by a user's path (prompts, reports, checkpoints, tokenizers)."""
import stat
from pathlib import Path

from kvmini.errors import KvminiError


def not_special(path, what: str):
    """`path` unless it exists as something other than a regular file or a folder: a FIFO, a socket or a
    device, whose read or write could wait forever (a FIFO nobody writes to) or never end. `what` names
    it in the message: not_special(Path("p.txt"), "prompt file") -> Path("p.txt")."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError:  # missing, or not ours to look at: the caller's own check says so
        return path
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise KvminiError(f"{what} {path} is not a regular file (a FIFO, socket or device would block or never end)")
    return path
