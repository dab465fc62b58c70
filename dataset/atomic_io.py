"""The project's file helpers: its one atomic write, folders made and text files read with one-line errors, and the
words those one-line errors share (an exception's first line, text that is not UTF-8). Standard library only, so
importing it costs nothing (the trainer, the metrics log and the sweep runner all use it without pulling in HF
``datasets``)."""

from __future__ import annotations

import errno
import hashlib
import os
import socket
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from dataset.shown_value import PATH_MAX, shown_path, shown_text, shown_value


def first_line(error: BaseException, named: bool = False) -> str:
    """The first line of `error`'s message, for a one-line refusal (its type's name when it has none); `named`: after
    its type's name (``"ValueError: ..."``), for errors of any kind."""
    text = str(error).strip()
    if "WeightsUnpickler error:" in text:  # torch's advice on weights_only comes first; the cause follows it
        text = "WeightsUnpickler error: " + text.split("WeightsUnpickler error:", 1)[1].strip().split("\n\n")[0]
    if not text:
        return type(error).__name__
    return f"{type(error).__name__}: {text.splitlines()[0]}" if named else text.splitlines()[0]


def not_utf8(error: UnicodeDecodeError) -> str:
    """The words for bytes that do not decode as UTF-8: ``"not valid UTF-8 (byte 0xff at offset 12)"``."""
    return f"not valid UTF-8 (byte 0x{error.object[error.start]:02x} at offset {error.start})"


def not_utf8_at(text: str, index: int) -> str:
    """The same words for a text with a lone surrogate at `index`: how Python holds a byte that is not UTF-8 (argv,
    a stream read with errors="surrogateescape": U+DC80..U+DCFF, named as that byte), or a surrogate given as such:
    ``"not valid UTF-8 (byte 0xff at character 3)"``."""
    code = ord(text[index])
    what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
    return f"not valid UTF-8 ({what} at character {index})"


def _current_umask() -> int:
    """The process umask. Linux reports it in /proc without changing it; elsewhere it can only be read by setting
    it, which briefly leaves other threads creating files with umask 0, so that is the fallback."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _regular_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0o666 less the umask (read per call, as it may change)."""
    return 0o666 & ~_current_umask()


def give_open_modes(folder: Path) -> None:
    """Give every file under `folder` the mode ``open(path, "w")`` would: writers that go through a private temp file
    (safetensors writes model.safetensors 0600) would leave a model or checkpoint only its owner can read. A file of
    another owner (another process's shard) is left as it is."""
    mode, me = _regular_file_mode(), os.getuid()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_uid == me:
            path.chmod(mode)


def file_in_the_way(path: Path) -> Path | None:
    """The file that keeps `path` from being a folder: `path` itself or a folder above it (None: nothing does)."""
    return next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)


def not_a_folder(path: Path, blocker: Path) -> str:
    """The one wording of a file where the folder `path` must go (`blocker`: `path` itself or a folder above it)."""
    return f"{path} is a file, not a folder" if blocker == path else f"{path}: {blocker} is a file, not a folder"


def _not_a_file(path: Path) -> str:
    """The one wording of a folder where the file `path` must go (the other way round from not_a_folder)."""
    return f"{path} is a folder, not a file"


def special_file_kind(path: Path) -> str | None:
    """What `path` is where a regular file is to be read and it is none -- "a folder", "a FIFO (a pipe)" (a shell's
    <(...)), "a socket", "a device" (/dev/zero) -- or None: a regular file, or nothing there (its reader says "no
    such file")."""
    if path.is_file() or not path.exists():
        return None
    if path.is_dir():
        return "a folder"
    return "a FIFO (a pipe)" if path.is_fifo() else "a socket" if path.is_socket() else "a device"


def check_not_a_folder(path: Path) -> None:
    """Refuse, in one line naming it, a `path` to be written as a file that is a folder (or a link to one: a `mkdir`
    in its place): a write replaces the file (atomic_path's os.replace), which fails on a folder, after the work."""
    if path.is_dir():
        raise ValueError(_not_a_file(path))


def check_folder_path(path: Path, flag: str, itself: bool = True) -> None:
    """Refuse, in one line naming `flag`, a `path` that cannot be made a folder because it, or a folder above it,
    is a file (mkdir would fail there, after the work); `itself=False`: `path` is to be a file, so the folders above
    it are checked, and it must not be a folder (check_not_a_folder). A name the system refuses to look up (a
    component over NAME_MAX bytes, a path over 4,096: an OSError traceback) is refused the same way."""
    if (problem := folder_path_problem(path, itself)) is not None:
        raise ValueError(f"{flag} {problem}")


def folder_path_problem(path: Path, itself: bool = True) -> str | None:
    """Why `path` cannot be made a folder (`itself=False`: cannot be a file in one), in words beginning with the
    path, for check_folder_path to put after its flag and an argparse flag type after its own; None: it can."""
    try:
        if name_too_long(path):  # the lookup below may stop at a missing folder first, and mkdir fail after the work
            raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG))
        blocker = file_in_the_way(path if itself else path.parent)
        folder_there = not itself and path.is_dir()
    except OSError as error:  # exists() passes over a missing folder only: File name too long, Permission denied
        return cannot_name(path, error, itself)
    if blocker is not None:
        return not_a_folder(path, blocker)
    if folder_there:
        return _not_a_file(path)
    # The folder the writes land in (or would be made in) must take them: refused before the work, not after it.
    existing = next(p for p in (path if itself else path.parent, *path.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{path}: cannot write in {existing} (no permission, or a read-only file system)"
    return None


def check_output_file(path: Path, flag: str, inputs: Iterable[tuple[str, Path]]) -> None:
    """Refuse, in one line naming both flags, an output file `path` (`flag`) that cannot be written
    (check_folder_path) or that is one of the tool's `inputs` (input flag, a file it reads): the same file by any
    name (a symlink, a hard link, a folder reached through one), compared by inode. Writing the report there would
    destroy the model or data the tool was given, or leave its names pointing at two files; refused before the
    work, not after it."""
    check_folder_path(path, flag, itself=False)
    for input_flag, source in inputs:
        try:
            same = os.path.samefile(path, source)
        except OSError:  # either one is missing (a new output file, an input the tool does not have): not the same
            continue
        if same:
            named = "" if path.resolve() == source.resolve() else " (the same file by another name)"
            raise ValueError(f"{flag} {path} is {input_flag}'s {source}{named}: writing there would destroy a file "
                             f"the tool reads; choose another {flag}")


def make_dirs(path: str | Path) -> Path:
    """``mkdir -p path``; a ValueError names the file in the way when it, or a folder above it, is a file (the
    one-line error a cache or output folder gets, not a FileExistsError traceback)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(not_a_folder(path, file_in_the_way(path) or path)) from None
    except OSError as error:
        if error.errno != errno.ENAMETOOLONG:  # a full disk or a read-only one: the caller's to say
            raise
        raise ValueError(cannot_name(path, error)) from None
    return path


NAME_MAX = 255  # Linux's longest file name, in bytes (a component of a path)


def name_too_long(path: Path) -> bool:
    """Whether the system would refuse `path` as too long (File name too long): a component over NAME_MAX bytes, or
    the whole over PATH_MAX - 1; counted here, as a lookup stops at a missing folder before a longer name below it."""
    return len(os.fsencode(path)) >= PATH_MAX or any(len(os.fsencode(part)) > NAME_MAX for part in path.parts)


def cannot_name(path: Path, error: OSError, folder: bool = True) -> str:
    """The one wording of a path the system refuses to look up (`error`: File name too long, Permission denied),
    the path quoted by shown_path. Every tool's last resort for a too-long name that no check met before is
    trainer/cli.py's run_main, in these words."""
    return f"{shown_path(str(path))} cannot name a {'folder' if folder else 'file'} ({error.strerror})"


def read_text_file(path: Path, what: str = "a file", max_chars: int | None = None) -> str:
    """The UTF-8 text of `path`; a ValueError ``"{path}: {reason}"`` when it does not exist, is a directory (not
    `what`), is not UTF-8, cannot be read, or holds more than `max_chars` characters (read no further: /dev/zero
    and an endless pipe end, where a whole read grew until the process was killed for memory)."""
    try:
        with Path(path).open(encoding="utf-8") as handle:  # Path.open, as read_text: the sweep tests count reads
            text = handle.read(-1 if max_chars is None else max_chars + 1)
        if max_chars is not None and len(text) > max_chars:
            raise ValueError(f"{path}: holds more than {max_chars:,} characters; no {what.removeprefix('a ')} "
                             f"this project reads is so long")
        return text
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a directory, not {what}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: {not_utf8(error)}") from None
    except OSError as error:
        raise ValueError(f"{path}: cannot be read ({error.strerror})") from None


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A fresh temp file beside ``path``, for writers that open a file by name; when the block ends without an
    error it is fsynced and ``os.replace``d onto ``path``, else removed. Readers (or a second rank writing the
    same file) see the old content or the new, never a half-written file."""
    path = Path(path)
    make_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:  # mkstemp creates the file 0600; give it the mode a plain open() would, so others can read it
            os.fchmod(fd, _regular_file_mode())
        finally:
            os.close(fd)
        yield Path(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def folder_lock(folder: Path, name: str, wait_s: float, what: str) -> Iterator[None]:
    """Hold `folder` for one writer: an exclusive flock on its lock file `name`, which records the holder as
    pid@host. Another holder is waited for up to `wait_s` seconds, then refused: a ValueError naming the folder,
    the holder and `what` it is doing ("another save into it"). The kernel drops the lock with its process, so a
    killed holder's is taken over at once (its file, left behind, is reused). The file is removed on release,
    while still held: a waiter that locked the removed file sees it is no longer the folder's and tries again."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): unguarded
        yield
        return
    path, deadline = folder / name, time.monotonic() + wait_s
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            os.close(fd)
            if time.monotonic() >= deadline:
                raise ValueError(f"{folder}: {what} is under way ({_holder_words(holder)}; lock file {path}), still "
                                 f"after {wait_s:g} s: let it end, then try again, or use another folder") from None
            time.sleep(0.1)
            continue
        except OSError as error:  # a file system without locks (some network mounts: ENOLCK, EOPNOTSUPP)
            os.close(fd)
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                raise
            path.unlink(missing_ok=True)
            yield  # unguarded, as without flock: a save must not fail for want of a lock
            return
        except BaseException:
            os.close(fd)
            raise
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        held = os.fstat(fd)
        if current is not None and (current.st_dev, current.st_ino) == (held.st_dev, held.st_ino):
            break
        os.close(fd)  # the file the last holder removed: lock the folder's own file
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}@{socket.gethostname()}".encode(), 0)
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def _holder_words(holder: str) -> str:
    """A lock file's pid@host in words for a refusal ("pid 4242 on host node1"); its first line otherwise, quoted
    (a lock file of another program's, or damaged) as dataset/shown_value.py quotes every refused value."""
    pid, at, host = holder.partition("@")
    if at and pid.isdigit() and host:
        return f"pid {shown_text(pid)} on host {shown_text(host)}"  # a damaged file's 199 digits cut too
    return f"held by {shown_value(holder.splitlines()[0])}" if holder else "its holder unrecorded"


def atomic_write_lines(path: str | Path, lines: Iterable[str]) -> None:
    """Write ``lines`` to ``path`` atomically (see ``atomic_path``)."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.writelines(lines)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (see ``atomic_write_lines``)."""
    atomic_write_lines(path, [text])


def _resolved(path: Path) -> Path:
    try:
        return path.resolve()
    except (RuntimeError, OSError):  # RuntimeError: pathlib's "Symlink loop from ..." (before Python 3.13)
        raise ValueError(f"{path}: a symlink loop (its links lead back to themselves, never to a file or folder); "
                         f"remove the link or point it at a real file or folder") from None


def path_overlap(path: Path, other: Path) -> str | None:
    """How `path` lies against `other`, both resolved as the file system will see them (symlinks and `..` seen
    through, a relative path taken from the current directory): "is" (the same folder), "is inside" or "holds";
    None: apart. The one test of whether writing into (or replacing) one may destroy the other. A path through a
    symlink loop resolves to nothing: a ValueError naming it (pathlib's RuntimeError was a traceback)."""
    real, real_other = _resolved(path), _resolved(other)
    if real == real_other:
        return "is"
    if real_other in real.parents:
        return "is inside"
    if real in real_other.parents:
        return "holds"
    return None


def file_digest(path: Path) -> dict[str, int | str]:
    """{"bytes": its size, "sha256": the hex digest of its bytes}: what a folder written as a whole (a checkpoint)
    records of each of its files, to tell later that a file is still the one written there."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}
