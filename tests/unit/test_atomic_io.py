"""dataset.atomic_io: whole-file replacement with the permissions a plain open() gives."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dataset.atomic_io import atomic_path, atomic_write_lines, atomic_write_text
from tests.paths import REPO



@pytest.fixture
def restore_umask():
    mask = os.umask(0o022)
    os.umask(mask)
    yield
    os.umask(mask)


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077, 0o002])
def test_written_file_has_the_mode_open_gives(umask, tmp_path, restore_umask):
    os.umask(umask)
    with open(tmp_path / "plain.txt", "w") as f:
        f.write("x")
    atomic_write_text(tmp_path / "atomic.txt", "x")
    mode = stat.S_IMODE((tmp_path / "atomic.txt").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode) == 0o666 & ~umask


def test_replaces_content_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "sub" / "state.json"  # missing parent directories are created
    atomic_write_text(path, "old")
    atomic_write_lines(path, (line for line in ("a\n", "b\n")))
    assert path.read_text() == "a\nb\n"
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "state.json"
    atomic_write_text(path, "old")

    def broken_lines():
        yield "half"
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError, match="killed mid-write"):
        atomic_write_lines(path, broken_lines())
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_atomic_path_for_a_writer_that_opens_the_file_itself(tmp_path, restore_umask):
    os.umask(0o022)
    path = tmp_path / "model.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="writer failed"):
        with atomic_path(path) as staging:
            staging.write_bytes(b"half")
            raise RuntimeError("writer failed")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["model.bin"]
    with atomic_path(path) as staging:
        assert staging.parent == tmp_path and staging != path
        staging.write_bytes(b"new")
        assert path.read_bytes() == b"old"  # replaced only when the block ends
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["model.bin"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_importing_the_writers_does_not_import_hf_datasets():
    """The trainer's checkpoint and metrics modules and the sweep runner write files atomically; importing the
    writer must not pull in HF `datasets` (about 0.65 s)."""
    code = ("import sys, dataset.atomic_io, trainer.checkpoint, trainer.metrics_log; "
            "print('datasets' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"


def test_first_line_keeps_one_line_and_torchs_cause():
    from dataset.atomic_io import first_line

    assert first_line(ValueError("  bad value\nsecond line ")) == "bad value"
    assert first_line(KeyError()) == "KeyError"  # no message: its type's name
    assert first_line(OSError("gone"), named=True) == "OSError: gone"
    assert first_line(RuntimeError(), named=True) == "RuntimeError"
    # torch.load(weights_only=True) puts its advice first and the cause after "WeightsUnpickler error:".
    unpickler = RuntimeError("Weights only load failed. Re-running `torch.load` with `weights_only` set to `False` "
                             "will likely succeed.\n Please file an issue.\n\nWeightsUnpickler error: Unsupported "
                             "operand 149\n\nCheck the documentation of torch.load to learn more.")
    assert first_line(unpickler, named=True) == "RuntimeError: WeightsUnpickler error: Unsupported operand 149"


def test_text_that_is_not_utf8_is_worded_once_naming_the_byte_and_where(tmp_path):
    from dataset.atomic_io import not_utf8_at, read_text_file

    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9\n")
    with pytest.raises(ValueError) as refused:
        read_text_file(latin)
    assert str(refused.value) == f"{latin}: not valid UTF-8 (byte 0xe9 at offset 3)"
    # Text decoded with errors="surrogateescape" (argv, piped stdin) holds such a byte as U+DC80..U+DCFF.
    assert not_utf8_at(b"caf\xe9".decode("utf-8", "surrogateescape"), 3) == "not valid UTF-8 (byte 0xe9 at character 3)"
    assert not_utf8_at("a\ud800", 1) == "not valid UTF-8 (U+D800 at character 1)"


def test_a_folder_that_cannot_take_writes_is_refused_before_the_work(tmp_path, monkeypatch):
    """A read-only file system or a folder without write permission (os.access; root passes every permission
    check, so the refusal is simulated here): one line naming the flag and the folder, where the export, the GGUF
    writer and the trainer used to load and convert first and then fail with an OSError traceback."""
    from dataset.atomic_io import check_folder_path

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked and real_access(path, mode))
    with pytest.raises(ValueError) as refused:
        check_folder_path(locked / "run" / "deeper", "--out_dir")
    assert str(refused.value) == (f"--out_dir {locked / 'run' / 'deeper'}: cannot write in {locked} (no permission, "
                                  f"or a read-only file system)")
    with pytest.raises(ValueError, match="cannot write in"):
        check_folder_path(locked / "x.gguf", "--outfile", itself=False)
    check_folder_path(tmp_path / "free" / "run", "--out_dir")  # a writable folder above: fine


def test_an_export_that_fails_to_write_is_one_line_and_leaves_nothing(tmp_path):
    """A full disk while an export writes (an OSError, or safetensors' own error): one line naming the folder; no
    staging folder stays and an earlier export is untouched."""
    from safetensors import SafetensorError

    from model.export_dir import staged_dir

    for error in (OSError(28, "No space left on device"), SafetensorError("I/O error: No space left on device")):
        with pytest.raises(ValueError) as refused:
            with staged_dir(tmp_path / "export", "marker.json", {}) as staging:
                (staging / "part").write_text("half")
                raise error
        assert str(refused.value).startswith(f"writing {tmp_path / 'export'} failed: ") and "No space" in str(
            refused.value)
        assert list(tmp_path.iterdir()) == []


def test_a_folder_lock_whose_file_its_last_holder_removed_is_taken_on_the_folders_own_file(tmp_path, monkeypatch):
    """folder_lock removes its file on release. A waiter that opened the file just before the holder removed it then
    locked a file no longer in the folder, and a third writer creating the file anew would hold the folder beside
    it. The waiter sees its file is not the folder's and locks the folder's own: inside the lock, the folder's lock
    file is there and names this process."""
    import fcntl
    import socket

    from dataset.atomic_io import folder_lock

    real_flock, calls = fcntl.flock, []

    def holder_removes_it_first(fd, operation):
        if not calls:  # the holder releases between this open and this flock, removing its file
            (tmp_path / ".lock").unlink()
        calls.append(operation)
        return real_flock(fd, operation)

    (tmp_path / ".lock").write_text("4242@elsewhere")
    monkeypatch.setattr(fcntl, "flock", holder_removes_it_first)
    with folder_lock(tmp_path, ".lock", 0.0, "another save into it"):
        assert (tmp_path / ".lock").read_text() == f"{os.getpid()}@{socket.gethostname()}"
        assert len(calls) == 2
    assert not (tmp_path / ".lock").exists()


@pytest.mark.parametrize("code", ["ENOLCK", "EOPNOTSUPP"])
def test_a_folder_lock_on_a_file_system_without_locks_lets_the_save_go_on_unguarded(tmp_path, monkeypatch, code):
    """Some network mounts refuse flock (ENOLCK, EOPNOTSUPP): the save goes on as where there is no flock at all
    (a lock is a guard against a rare overlap, not a condition of saving), and leaves no lock file; any other
    error of flock is raised."""
    import errno
    import fcntl

    from dataset.atomic_io import folder_lock

    def refused(fd, operation):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(fcntl, "flock", refused)
    entered = []
    with folder_lock(tmp_path, ".lock", 0.0, "another save into it"):
        entered.append(True)
    assert entered == [True] and not (tmp_path / ".lock").exists()

    def broken(fd, operation):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(fcntl, "flock", broken)
    with pytest.raises(OSError, match="I/O error"):
        with folder_lock(tmp_path, ".lock", 0.0, "another save into it"):
            pass
