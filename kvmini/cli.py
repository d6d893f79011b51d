"""The one error boundary of every command-line entry point: run.py and the `python -m kvmini...` tools.

A user's mistake (KvminiError) or a refusal from the operating system (OSError) is one line on
stderr and exit code 2; an argparse usage error is one line too (exit code 2, `--help` for the
rest); Ctrl-C is one line and exit code 130, at any moment including the imports. An error kvmini
does not anticipate is still one line, naming its type; KVMINI_DEBUG=1 shows the traceback instead.
Standard library (and kvmini.errors, kvmini.files) only, so that it is in place before torch is
imported.

    from kvmini import cli
    cli.exit_on_ctrl_c(__name__)   # first, before the heavy imports
    import torch
    ...
    if __name__ == "__main__":
        sys.exit(cli.run(lambda: work(parse(argv))))
"""
import argparse
import errno
import importlib
import math
import os
import re
import signal
import sys
import tempfile
from pathlib import Path

from kvmini.errors import KvminiError
from kvmini.files import not_special

INTERRUPTED = "\ninterrupted (Ctrl-C)"


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit code 2), an option is never abbreviated,
    and an option that takes a value given twice is refused (argparse would keep the last silently)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        given = sys.argv[1:] if args is None else list(args)
        seen = set()
        for word in given[: given.index("--")] if "--" in given else given:
            action = self._option_string_actions.get(str(word).split("=", 1)[0])
            if type(action) is argparse._StoreAction:  # not append, count or a flag
                if action.dest in seen:
                    self.error(f"{'/'.join(action.option_strings)} is given twice; give it once")
                seen.add(action.dest)
        return super().parse_known_args(given, namespace)


def seconds(text: str) -> int:
    """An argparse type: a time limit in whole seconds, 1 to a week."""
    return whole_number(text, 1, 7 * 24 * 3600)


def path(text: str) -> str:
    """An argparse type for a file or folder: '' (or spaces) is refused, not read as absent or as the
    current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty (a path)")
    return text


def whole_number(text: str, low: int = 0, high: int | None = None) -> int:
    """ASCII digits only ('²', '٣' and '1e3' are refused), within [low, high]."""
    if not re.fullmatch(r"[+-]?[0-9]+", text.strip()):
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}")
    value = int(text)
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"must be {f'in [{low}, {high}]' if high is not None else f'>= {low}'}, got {text}")
    return value


def at_least(low: int):
    """An argparse type: a whole number >= low."""
    return lambda text: whole_number(text, low)


def real_number(text: str) -> float:
    """A finite number written in ASCII ('inf', 'nan' and '١.٥' are refused)."""
    try:
        value = float(text) if text.isascii() and "_" not in text else math.nan  # float() reads '1_0' as 10
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def budget(text):
    """'128' or '1' -> tokens per layer (int); '0.2' or '1.0' -> a ratio of the prompt (float).
    A sign or spaces do not change the reading: '+1' and ' 1 ' are one token, like '1'."""
    if re.fullmatch(r"\+?[0-9]+", text.strip()):
        return int(text)
    return real_number(text)


def _exit_interrupted(signum, frame):
    os.write(2, (INTERRUPTED + "\n").encode())
    os._exit(130)


def exit_on_ctrl_c(name: str) -> None:
    """When module `name` runs as the program ("__main__"), Ctrl-C ends it at once (one line, 130)
    until `run` starts the work. A KeyboardInterrupt raised inside an import can be swallowed or
    turned into another error by the library being imported (torch: a RecursionError), so during
    the imports nothing is unwound. Imported as a library (notebooks, tests), nothing changes."""
    if name == "__main__":
        signal.signal(signal.SIGINT, _exit_interrupted)


def one_line(e: BaseException) -> str:
    """The message for a failure: ours as written, the operating system's with the file it concerns."""
    if isinstance(e, KvminiError):
        return str(e)
    if isinstance(e, OSError):
        what = e.strerror or str(e) or type(e).__name__
        if e.filename is not None:
            return f"{what}: {e.filename}"
        if e.errno in (errno.EPIPE, errno.ENOSPC, errno.EBADF, errno.EIO) or isinstance(e, BrokenPipeError):
            return f"cannot write the output: {what}"
        return what
    text = (str(e).strip().splitlines() or [""])[0][:300]
    asked = re.search(r"(?:can't allocate memory|out of memory).*?(\d+) bytes", text)  # torch's allocators
    if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and (asked or "out of memory" in text.lower())):
        size = f": a tensor of {int(asked.group(1)) / 2**30:,.1f} GiB" if asked else ""
        return (f"out of memory{size} (a shorter prompt, a smaller budget, --chunk-size, --evict-every or --history, "
                "or a smaller model needs less)")
    return f"unexpected {type(e).__name__}: {text} (a case kvmini does not check yet; KVMINI_DEBUG=1 shows where)"


def silence_stdout() -> None:
    """After the output failed, point it at /dev/null so the exit's own flush cannot fail again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def read_prompt(path: str) -> str:
    """A prompt file's text: it exists, is a regular file of UTF-8 text and not only whitespace."""
    file = Path(path)
    if not file.exists():
        raise KvminiError(f"prompt file not found: {path}")
    if file.is_dir():
        raise KvminiError(f"prompt {path} is a directory, not a text file")
    not_special(file, "prompt")
    try:
        text = file.read_bytes().decode("utf-8-sig")  # a byte order mark is no part of the text
    except UnicodeDecodeError as e:
        raise KvminiError(f"prompt file {path} is not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise KvminiError(f"prompt file {path} is empty")
    return text


def prompt_fits(ids: list[int], max_new_tokens: int, context: int, source) -> list[int]:
    """A prompt's token ids, checked: at least one, and room in the model's context for the answer."""
    if not ids:
        raise KvminiError(f"the prompt encodes to zero tokens: none of its characters is in the tokenizer's "
                          f"vocabulary ({source})")
    if len(ids) + max_new_tokens > context:
        raise KvminiError(f"prompt has {len(ids)} tokens; with --max-new-tokens {max_new_tokens} "
                          f"that exceeds the model's context of {context} tokens")
    return ids


def writable_file(path: str, flag: str = "") -> Path:
    """An output file that can be written, checked before any work (so no result is lost to it);
    `flag` names the option in the message. Nothing is left behind."""
    file, name = Path(path), f"{flag} {path}".strip()
    not_special(file, name)
    if file.is_symlink() and not file.exists():
        raise KvminiError(f"{name} is a link to a missing file ({os.readlink(file)}); name the file itself")
    if file.is_dir():
        raise KvminiError(f"{name} is a folder, not a file")
    if not file.parent.is_dir():
        raise KvminiError(f"cannot write {name}: the folder {file.parent} does not exist")
    existed = file.exists()
    with open(file, "a"):  # PermissionError (one line) when it may not be written
        pass
    if not existed:
        file.unlink()
    return file


def writable_folder(path: str, flag: str) -> Path:
    """An output folder, created if needed and probed, before any work."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise KvminiError(f"{flag} {path} is a file, not a folder")
    out.mkdir(parents=True, exist_ok=True)  # PermissionError, FileExistsError ...: one line
    tempfile.TemporaryFile(dir=out).close()
    return out


def debugging() -> bool:
    """KVMINI_DEBUG=1 (any value but empty or 0) lets a failure's traceback through."""
    return os.environ.get("KVMINI_DEBUG", "").strip() not in ("", "0")


def not_an_input(output: Path, flag: str, *inputs) -> Path:
    """`output` unless it is one of the files or inside one of the folders the run reads (an --html
    page written over the prompt or into the model folder)."""
    out = Path(output).resolve()
    for given in (Path(i) for i in inputs if i):
        held = given.resolve()
        if out == held or (held.is_dir() and held in out.parents):
            raise KvminiError(f"{flag} {output} would overwrite {'a file in ' if out != held else ''}{given}, "
                              "which this run reads; write it elsewhere")
    return Path(output)


def run(work, imports: tuple[str, ...] = ()) -> int:
    """The error boundary: `work()` -> its exit code; whatever goes wrong is one line on stderr.
    `imports` are imported first, still under `exit_on_ctrl_c` (modules the work imports lazily)."""
    if sys.stdout is None or sys.stderr is None:  # started with stdout or stderr closed (`>&-`)
        if sys.stderr is not None:
            print("error: standard output is closed; nowhere to write the answer", file=sys.stderr)
        return 2
    sys.stdout.reconfigure(errors="replace")  # text the terminal's encoding lacks prints as '?'
    sys.stderr.reconfigure(errors="backslashreplace")
    try:
        for module in imports:
            importlib.import_module(module)
        if signal.getsignal(signal.SIGINT) is _exit_interrupted:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # the work may clean up on Ctrl-C
        return work()
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return 130
    except SystemExit as e:  # argparse: --help (0) or a usage error (2, its line already written)
        return e.code if isinstance(e.code, int) else 2
    except Exception as e:
        if debugging():
            raise
        if isinstance(e, OSError) and e.filename is None:
            silence_stdout()
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    except BaseException as e:  # a Rust library's panic reaches Python as pyo3's PanicException, not an Exception
        if type(e).__name__ != "PanicException" or debugging():
            raise
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
