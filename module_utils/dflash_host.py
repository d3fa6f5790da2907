# Copyright: dflash authors
# Apache-2.0
"""How dflash module logic touches the managed host: run a command, write a file atomically, wait.

The logic in the other ``dflash_*`` module_utils takes a host object instead of an
``AnsibleModule`` so it can be unit-tested (and run for real) without Ansible:
``LocalHost`` uses ``subprocess`` and ``os.replace``; ``ModuleHost`` routes the same
calls through ``module.run_command`` and ``module.atomic_move``.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import time
import uuid


class LocalHost:
    """Plain-Python host operations (tests, and any code running outside a module)."""

    def run(self, args, check_rc=False):
        """Run ``args`` (a list, never a shell string); return ``(rc, stdout, stderr)``."""
        try:
            proc = subprocess.run(list(args), capture_output=True, text=True, check=False)
        except FileNotFoundError as exc:
            return 127, "", str(exc)
        if check_rc and proc.returncode != 0:
            raise HostCommandError(args, proc.returncode, proc.stdout, proc.stderr)
        return proc.returncode, proc.stdout, proc.stderr

    def which(self, name, extra_dirs=("/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin")):
        found = shutil.which(name)
        if found:
            return found
        for directory in extra_dirs:
            candidate = os.path.join(directory, name)
            if os.access(candidate, os.X_OK):
                return candidate
        return None

    def atomic_write(self, path, data, mode=0o644):
        """Write ``data`` (str or bytes) to ``path`` through a temp file in the same directory (``write_atomic``)."""
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        write_atomic(path, data, mode, replace=lambda tmp, dest: self._replace(tmp, dest, mode))

    def _replace(self, src, dest, mode):
        os.replace(src, dest)

    def sleep(self, seconds):
        time.sleep(seconds)

    def now(self):
        return time.monotonic()

    def warn(self, message):
        pass


class ModuleHost(LocalHost):
    """Host operations through an ``AnsibleModule`` (run_command, atomic_move, warn)."""

    def __init__(self, module):
        self.module = module

    def run(self, args, check_rc=False):
        rc, out, err = self.module.run_command(list(args))
        if check_rc and rc != 0:
            raise HostCommandError(args, rc, out, err)
        return rc, out, err

    def which(self, name, extra_dirs=("/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin")):
        return self.module.get_bin_path(name, required=False, opt_dirs=list(extra_dirs))

    def _replace(self, src, dest, mode):
        # atomic_move gives a new file 0666 & ~umask and, by default, copies an existing file's mode onto the
        # new one: either way not `mode` (a 0600 environment file would become 0644). keep_dest_attrs=False
        # keeps the temp file's mode, the umask makes a new file at most `mode`, the fchmod makes it exactly.
        umask = os.umask(0o777 & ~mode)
        try:
            self.module.atomic_move(src, dest, unsafe_writes=False, keep_dest_attrs=False)
        finally:
            os.umask(umask)
        fd = os.open(dest, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.fchmod(fd, mode)
        finally:
            os.close(fd)

    def warn(self, message):
        self.module.warn(message)


class HostCommandError(Exception):
    def __init__(self, args, rc, stdout, stderr):
        self.args_list = list(args)
        self.rc = rc
        self.stdout = stdout
        self.stderr = stderr
        detail = (stderr or stdout or "").strip()
        super().__init__(f"command {' '.join(self.args_list)!r} failed with exit status {rc}: {detail}")


def fsync_dir(path):
    """Make a rename/creation inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path, data, mode=0o644, tmp_name=None, dir_fd=None, replace=None, sync_dir=True):
    """The one atomic writer of the module_utils and modules: ``path`` holds the old content or all of ``data``
    (str, written as UTF-8, or bytes), never a part.

    ``data`` goes into a new temp file beside ``path`` (``tmp_name``, a stale one of that name removed first, else
    ``.dflash-`` and random letters), created with ``O_EXCL | O_NOFOLLOW`` (a link planted at the name is never
    followed) and mode 0600, set to ``mode`` with ``fchmod`` before anything is written (so it never had a wider
    one; ``None``: no chmod at all, the file keeps 0666 less the umask, for pmxcfs, which refuses one), fsynced,
    renamed over ``path`` (a link there is replaced, never followed; ``replace(tmp, path)`` when given, e.g.
    Ansible's atomic_move) and its directory fsynced unless not ``sync_dir``. ``dir_fd``: ``path`` and ``tmp_name``
    are names in that directory (an fd of ``open_directory_nofollow``). On any error the temp file is removed."""
    directory = os.path.dirname(path) or "."
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    tmp = None
    for _ in range(100):
        tmp = tmp_name or os.path.join(directory, ".dflash-" + uuid.uuid4().hex[:8])
        if tmp_name:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
        try:
            fd = os.open(tmp, flags, 0o600 if mode is not None else 0o666, dir_fd=dir_fd)
            break
        except FileExistsError:
            if tmp_name:
                raise
    else:  # pragma: no cover - 100 names taken
        raise FileExistsError(errno.EEXIST, "no free temp name", directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            if mode is not None:
                os.fchmod(handle.fileno(), mode)
            handle.write(data.encode() if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        if replace is not None:
            replace(tmp, path)
        else:
            os.rename(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise
    if sync_dir:
        if dir_fd is None:
            fsync_dir(directory)
        else:
            os.fsync(dir_fd)


# Root reads files that the trainer account can write (heartbeat.json, node files, checkpoints/latest, the
# log): at most this much, so a huge or endless file cannot eat the module's memory.
READ_LIMIT = 1 << 20
# Symbolic links followed while resolving one path (the kernel's own limit).
MAX_LINKS = 40

_KINDS = ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "fifo"), (stat.S_ISCHR, "character device"),
          (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "symbolic link"))


class UnsafeFile(OSError):
    """A path root refuses to read or follow; ``reason`` completes a sentence that starts with the path."""

    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


def file_kind(mode):
    return next((name for test, name in _KINDS if test(mode)), "special file")


def _fail(where, path, reason, final=True):
    """``reason`` of the file itself (``final``, with the resolved name if a root-owned link led there), or of
    a directory on the way to it."""
    if final:
        raise UnsafeFile(reason if where == path.rstrip("/") else f"{reason} (at {where})")
    raise UnsafeFile(f"is under {where}, {reason.removeprefix('is ')}")


def walk_nofollow(parts, walk, refuse, follow_last=False, open_last=False, create=False):
    """The one symlink-safe walk of root's paths (``open_nofollow``, ``open_directory_nofollow``): ``parts``, the
    components of an absolute path, resolved one at a time with ``openat`` and ``O_NOFOLLOW``, each directory
    opened (``walk``, its flags) under the fd of the one before. A symbolic link is followed only when root owns it
    (the system's own links, an operator's mount link), at most MAX_LINKS of them; the last component only when
    ``follow_last``. ``create``: a missing component is made (root's, 0755) with ``mkdirat`` under its parent's fd.

    What root refuses goes to ``refuse(where, event, value)``, which raises (``UnsafeFile``) or returns to let the
    walk go on: ``"link"`` (a link owned by uid ``value``), ``"loop"`` (more than MAX_LINKS links), ``"kind"`` (a
    component on the way that is not a directory, of mode ``value``: returning lets its open fail), ``"changed"``
    (that open failed with errno ``value``, ELOOP or ENOTDIR: replaced since the stat; returning re-raises).

    Returns ``(fd, name, where, st, created)``: with ``open_last`` the fd of the last component (a directory)
    and name None; else the fd of the directory that holds ``name``, the last component, of lstat ``st``. ``where``
    is its path as resolved. The fd is the caller's to close."""
    parts = list(parts)
    dir_fd = os.open("/", walk)
    links, done, created = 0, "", False
    name = st = None
    try:
        while parts:
            name = parts.pop(0)
            where = (done.rstrip("/") + "/" + name) if name != ".." else (os.path.dirname(done) or "/")
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, 0o755, dir_fd=dir_fd)
                    created = True
                except FileExistsError:  # made since the stat by another process (another node, shared storage):
                    pass  # inspected below as any existing component, a link of another account refused
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode) and (parts or follow_last):
                if st.st_uid != 0:
                    refuse(where, "link", st.st_uid)
                links += 1
                if links > MAX_LINKS:
                    refuse(where, "loop", links)
                target = os.readlink(name, dir_fd=dir_fd)
                parts = [p for p in target.split("/") if p not in ("", ".")] + parts
                if target.startswith("/"):
                    os.close(dir_fd)
                    dir_fd, done = os.open("/", walk), ""
                continue
            if not parts and not open_last:
                result, dir_fd = (dir_fd, name, where, st, created), -1
                return result
            if not stat.S_ISDIR(st.st_mode):
                refuse(where, "kind", st.st_mode)
            try:
                next_fd = os.open(name, walk, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    refuse(where, "changed", exc.errno)
                raise
            os.close(dir_fd)
            dir_fd, done = next_fd, where
        result, dir_fd = (dir_fd, None, done or "/", st, created), -1
        return result
    finally:
        if dir_fd >= 0:
            os.close(dir_fd)


def open_nofollow(path, follow=False):
    """A read-only fd of the regular file ``path``, opened without following a link root did not make.

    The path is resolved one component at a time (``walk_nofollow``: ``openat`` with ``O_NOFOLLOW``): a symbolic
    link is followed only when root owns it (the system's own links, an operator's mount link); a link owned by any
    other account (the trainer replacing its run directory, or a file in it) raises ``UnsafeFile``. The
    last component is never a link unless ``follow`` (root's own paths, such as an operator's environment
    file, may be links to root's files). It is opened with ``O_NONBLOCK`` (a FIFO never blocks the open)
    and must be a regular file: a FIFO, device, socket or directory raises ``UnsafeFile`` naming its kind,
    and so does a file with more than one hard link (the trainer may link any file it can see into its
    run directory where the kernel does not protect hard links).
    ``FileNotFoundError``/``NotADirectoryError`` pass through (missing)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    walk = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not path.startswith("/"):
        parts = [p for p in os.getcwd().split("/") if p] + parts
    if not parts:
        raise UnsafeFile("is not a regular file (directory)")

    def refuse(where, event, value):
        if event == "link":
            _fail(where, path, f"a symbolic link owned by uid {value}, which root does not follow", final=False)
        if event == "loop":
            _fail(where, path, "a symbolic link of too many levels of links", final=False)
        if event == "changed" and value == errno.ELOOP:  # replaced by a link since the stat
            _fail(where, path, "a symbolic link, which root does not follow", final=False)
        # "kind", or ENOTDIR: the open raises NotADirectoryError (missing)

    dir_fd, name, where, st, _ = walk_nofollow(parts, walk, refuse, follow_last=follow)
    try:
        if name is None:  # a link of root's led to a directory
            raise UnsafeFile("is not a regular file (directory)")
        if stat.S_ISLNK(st.st_mode):
            _fail(where, path, f"is a symbolic link (to {os.readlink(name, dir_fd=dir_fd)}), which root does not follow")
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # replaced by a link since the stat
                _fail(where, path, "is a symbolic link, which root does not follow")
            raise
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            os.close(fd)
            _fail(where, path, f"is not a regular file ({file_kind(opened.st_mode)})")
        if opened.st_nlink > 1:  # another name of the same file: perhaps a root-only one elsewhere
            os.close(fd)
            _fail(where, path, f"has {opened.st_nlink} hard links, which root does not read")
        return fd
    finally:
        os.close(dir_fd)


def _read_fd(fd, limit, strict=True):
    """At most ``limit`` bytes; ``strict``: more than that raises UnsafeFile instead of being cut."""
    chunks, size = [], 0
    while size <= limit:
        chunk = os.read(fd, min(65536, limit + (1 if strict else 0) - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if strict and size > limit:
        raise UnsafeFile(f"is larger than {_size(limit)}, more than root reads")
    return b"".join(chunks)


def _size(limit):
    return f"{limit >> 20} MiB" if limit >= 1 << 20 and not limit % (1 << 20) else f"{limit} bytes"


def unread(exc):
    """Why root did not read a file, completing a sentence that starts with its path: an ``UnsafeFile``'s reason,
    else "cannot be read (STRERROR)"."""
    return exc.reason if isinstance(exc, UnsafeFile) else f"cannot be read ({exc.strerror})"


def read_text_checked(path, limit=READ_LIMIT, follow=False):
    """``(text, None)``; ``(None, None)`` when missing; ``(None, reason)`` when root does not read it.

    ``reason`` completes a sentence that starts with the path ("is not a regular file (fifo)", "is a
    symbolic link (to /dev/zero), which root does not follow", "is larger than 1 MiB, more than root reads").
    See ``open_nofollow``: never blocks, never follows a link another account made, reads at most ``limit``."""
    try:
        fd = open_nofollow(path, follow=follow)
    except (FileNotFoundError, NotADirectoryError):
        return None, None
    except OSError as exc:  # UnsafeFile among them
        return None, unread(exc)
    try:
        data = _read_fd(fd, limit)
    except (FileNotFoundError, ProcessLookupError):
        # ProcessLookupError: a /proc/PID file opened just before PID exited fails on read (ESRCH)
        return None, None
    except OSError as exc:
        return None, unread(exc)
    finally:
        os.close(fd)
    return data.decode("utf-8", errors="replace"), None


def read_text(path, default=None, limit=READ_LIMIT, follow=False):
    """The text of ``path``, or ``default`` when it is missing or root does not read it (read_text_checked)."""
    text, _ = read_text_checked(path, limit=limit, follow=follow)
    return default if text is None else text


TAIL_BYTES = 256 * 1024  # a diagnosis tail reads at most this much of a log

# Control characters of text the trainer wrote (a log line, a heartbeat's `error`, a stack frame) as they are shown:
# escaped, so that no ESC sequence, carriage return or newline of theirs reaches an operator's terminal or a log
# line raw (a screen clear, a forged `health: OK` line). C0 but the tab, DEL, C1, and the Unicode line separators
# and bidirectional overrides.
_UNPRINTABLE = {code: f"\\x{code:02x}" for code in [*range(0x09), *range(0x0A, 0x20), 0x7F, *range(0x80, 0xA0)]}
_UNPRINTABLE.update({code: f"\\u{code:04x}" for code in (0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A))})


# A line of a log as shown, at most (a sparse or binary log's "line" may be a whole read of NUL bytes).
LINE_LIMIT = 4096


def printable(text):
    """``text`` with its control characters escaped (``\\x1b``): safe to print to a terminal, one line."""
    return text.translate(_UNPRINTABLE)


def render_lines(data):
    """The lines of a log chunk (bytes) as a terminal left them: split at ``"\n"`` only (``str.splitlines``
    would also split at ``"\r"``, form feeds and Unicode separators), and of a line a progress bar redrew with
    carriage returns only its last state (a trailing ``"\r"``, as in CRLF, ends a state, it starts none); any
    other control character is escaped (``printable``), and a line is shown up to LINE_LIMIT characters."""
    lines = (printable(line.rstrip("\r").rsplit("\r", 1)[-1]) for line in data.decode("utf-8", errors="replace").split("\n"))
    return [line if len(line) <= LINE_LIMIT else f"{line[:LINE_LIMIT]}... ({len(line) - LINE_LIMIT} more characters)"
            for line in lines]


def read_lines(path, offset=-1, count=40, max_bytes=TAIL_BYTES, partial=False):
    """The one log reader of the module_utils: ``{path, exists, size, next_offset, lines}``.

    ``offset`` < 0 reads the last ``count`` lines (a tail); else the lines from byte ``offset`` on (a follow;
    an offset past the end means the log was truncated, so it is read from the start). At most ``max_bytes``
    per read: a follow catches up over several reads, a tail drops the line its seek cut (unless a carriage
return after the cut began that line's last state). Lines are whole and
    ``next_offset`` is just after the last one, so a line being written comes whole with the next read;
    ``partial`` (a diagnosis, which reads once) also returns that line as it is now (a progress bar that has
    not ended its line yet). Lines are rendered by ``render_lines``.

    The file is opened as ``open_nofollow`` does: no link another account made is followed, a FIFO or device
    is never waited on (``UnsafeFile``, an OSError, says what it is); a missing file is ``exists: False``."""
    out = {"path": path, "exists": False, "size": 0, "next_offset": 0, "lines": []}
    try:
        fd = open_nofollow(path)
    except (FileNotFoundError, NotADirectoryError):
        return out
    out["exists"] = True
    try:
        size = out["size"] = os.fstat(fd).st_size
        tail = offset < 0
        start = max(0, size - max_bytes) if tail else (offset if offset <= size else 0)
        # One byte before a tail's start tells whether the seek cut a line.
        os.lseek(fd, max(0, start - 1) if tail else start, os.SEEK_SET)
        cut = tail and start > 0 and os.read(fd, 1) != b"\n"
        data = _read_fd(fd, min(max_bytes, size - start), strict=False)  # a log growing meanwhile: cut there
    finally:
        os.close(fd)
    end = data.rfind(b"\n") + 1
    if end == 0 and len(data) == max_bytes:  # one line longer than a read: return it cut rather than never
        end = len(data)
    lines = render_lines(data[:end]) if end else []
    if lines and lines[-1] == "" and data[:end].endswith(b"\n"):
        lines.pop()  # the empty string after the last "\n"
    if partial and end < len(data):
        lines.append(render_lines(data[end:])[-1])
    if cut and lines and b"\r" not in data.split(b"\n", 1)[0].rstrip(b"\r"):
        lines = lines[1:]  # the seek cut it (a line redrawn after the cut still shows its last state whole)
    out["lines"] = (lines[-count:] if count > 0 else []) if tail else lines
    out["next_offset"] = start + end
    return out


def tail_lines_checked(path, count, max_bytes=TAIL_BYTES):
    """``(the last count lines, None)``; ``(None, None)`` when missing; ``(None, reason)`` when not read.

    ``read_lines``' tail with the line being written: a diagnosis shows the log as it is now."""
    try:
        result = read_lines(path, -1, count, max_bytes, partial=True)
    except OSError as exc:  # UnsafeFile among them
        return None, unread(exc)
    return (result["lines"] if result["exists"] else None), None


def tail_lines(path, count, max_bytes=TAIL_BYTES):
    """The last ``count`` lines of a (possibly huge) text file, or None if it is missing or not read."""
    return tail_lines_checked(path, count, max_bytes)[0]


def _who(uid):
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def open_directory_nofollow(path, create=False):
    """An ``O_DIRECTORY`` fd of ``path``, resolved as ``open_nofollow`` does (``walk_nofollow``): a link another
    account made (the trainer replacing its run directory, or a parent it owns) raises ``UnsafeFile``; root's own
    links are followed. ``create``: missing components are made (root's, 0755) with ``mkdirat`` under the fd of
    their parent, never through a link. Returns ``(fd, created)``."""
    walk = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

    def refuse(where, event, value):
        if event == "link":
            raise UnsafeFile(f"{where} is a symbolic link owned by {_who(value)}, which root does not follow")
        if event == "loop":
            raise UnsafeFile(f"{where}: too many levels of symbolic links")
        if event == "kind":
            raise UnsafeFile(f"{where} is not a directory ({file_kind(value)})")
        raise UnsafeFile(f"{where} changed while root resolved it (now a link or not a directory)") from None

    fd, _name, _where, _st, created = walk_nofollow([p for p in os.path.abspath(path).split("/") if p], walk, refuse,
                                                    follow_last=True, open_last=True, create=create)
    return fd, created
