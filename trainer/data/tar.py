"""The regular files of a tar archive held in memory, by member path.

The standard library's tarfile parses every field of every header; for CIFAR-10's 60,000
small JPEGs that is most of the time it takes to read the archive (1.8 s of 2 s on an
H200's host). This reads only what finds a file: its name (ustar's prefix, GNU long names,
pax paths), size and type, and checks each header's checksum so that a damaged archive is
refused rather than misread. Hard and symbolic links read as they would once unpacked: one
to a file in the archive as that file, one to a folder as that folder's files; one to
anything else dangles, no file there, and is listed apart for the reader to name, as are
the folders stored as members (an empty one is nothing else) and those a link leads to.
"""
import gzip
import posixpath
import zlib
from typing import NamedTuple

BLOCK = 512
GZIP_MAGIC = b"\x1f\x8b"
FILE_TYPES = (b"0", b"\0", b"7")  # regular, old-style regular, contiguous
HARD_LINK, SYMLINK, DIRECTORY = b"1", b"2", b"5"
MAX_HOPS = 40  # links followed for one path before it counts as a loop, as Linux's limit


class Damaged(ValueError):
    """An archive cut short or with changed bytes (its gzip stream, a header after the first,
    a member's contents): raised apart from a file that is no tar archive at all, whose
    first header does not check out."""


def _refused(pos: int, why: str, header: bytes = b"") -> ValueError:
    """The error for a header cut short or that does not check out: past the first, or at a
    first that names itself a tar header (POSIX's "ustar" at byte 257), the archive's damage
    (`why`); else a file that is no tar archive."""
    if pos or header[257:262] == b"ustar":
        return Damaged(why)
    return ValueError("it is not a tar archive, gzip-compressed or not")


def _checks_out(header: bytes) -> bool:
    """Whether a header's checksum field holds the sum of its bytes, the field's own counted as spaces."""
    try:
        return sum(header) - sum(header[148:156]) + 8 * ord(" ") == _number(header[148:156])
    except ValueError:  # no octal number there: text, or other bytes that are no header
        return False


def _number(field: bytes) -> int:
    if field[0] & 0x80:  # GNU base-256, for sizes of 8 GiB and more
        return int.from_bytes(field[1:], "big")
    return int(field.strip(b"\0 ") or b"0", 8)


def _text(name: bytes) -> str:
    """A member's name: UTF-8, where bytes that are not (a Latin-1 name) keep their place as
    surrogates, as tarfile and os.listdir read them, rather than refuse the archive."""
    return name.decode("utf-8", "surrogateescape")


def _pax_value(records: bytes, wanted: bytes) -> str | None:
    """The value of key `wanted` in a pax extended header ("<length> <key>=<value>\\n" records), if any."""
    pos = 0
    while pos < len(records):
        length = int(records[pos:records.index(b" ", pos)])
        key, _, value = records[records.index(b" ", pos) + 1:pos + length - 1].partition(b"=")
        if key == wanted:
            return _text(value)
        pos += length
    return None


def _clean(name: str) -> str:
    """A member's path as unpacking makes it: no "./", no doubled or leading "/"."""
    return posixpath.normpath(name).lstrip("/")


def _with_links(files: dict[str, bytes], member: dict[str, str],
                links: dict[str, tuple[str, bool]]) -> tuple[dict[str, bytes], dict[str, str], list[str]]:
    """`files` and what the archive's links read as once it is unpacked, each at a path
    that `find -L` lists there: a link to a file, that file's contents; a link to a folder,
    that folder's files under the link's path. A link reached through others is followed
    (at most MAX_HOPS of them for one path); a folder already above in the walk is a loop,
    left out as `find -L` leaves it; a link to anything else dangles: its path is listed apart,
    as is each folder reached through a link, with the folder it is.
    member: a file's path as unpacked -> its name in `files`; links: a link's path -> (its
    target, whether it is a hard link, named from the root)."""
    entries: dict[str, set[str]] = {}  # a folder's path ("" the root) -> the names in it
    for path in [*member, *links]:
        parts = path.split("/")
        for i in range(len(parts)):
            entries.setdefault("/".join(parts[:i]), set()).add(parts[i])

    def real(path: str) -> str | None:
        """The path, every link along it followed as the file system follows it."""
        done, todo, hops = "", path.split("/"), 0
        while todo:
            part = todo.pop(0)
            if part in ("", "."):
                continue
            if part == "..":
                if not done:
                    return None  # out of the archive
                done = posixpath.dirname(done)
                continue
            here = f"{done}/{part}" if done else part
            if here not in links:
                done = here
                continue
            hops += 1
            target, hard = links[here]
            if hops > MAX_HOPS or target.startswith("/"):
                return None  # a loop of links, or a path outside the archive
            todo, done = target.split("/") + todo, "" if hard else done
        return done

    out, reached, dangling = dict(files), {}, []

    def walk(logical: str, folder: str, above: set[str], linked: bool):
        for name in sorted(entries.get(folder, ())):
            path, shown = f"{folder}/{name}" if folder else name, f"{logical}/{name}" if logical else name
            through = linked or path in links
            target = real(path) if path in links else path
            if target in member:
                if through:
                    out[shown] = files[member[target]]
            elif target in entries:
                if through:
                    reached[shown] = target
                if target not in above:
                    walk(shown, target, above | {target}, through)
            elif path in links:
                dangling.append(shown)
    walk("", "", {""}, False)
    return out, reached, dangling


class Members(NamedTuple):
    files: dict[str, bytes]  # path -> contents, of the regular files and the links to them
    folders: set[str]  # the paths of the folders stored as members
    linked: dict[str, str]  # the path of a folder reached through a link -> the folder it is
    dangling: list[str]  # the paths of the links to nothing in the archive


def tar_files(archive: bytes) -> Members:
    """What a tar archive, gzip-compressed or not, unpacks to."""
    try:
        data = gzip.decompress(archive) if archive[:2] == GZIP_MAGIC else archive
    except (EOFError, OSError, zlib.error) as e:  # cut short, a failed CRC, damaged deflate data
        raise Damaged(f"its gzip stream: {e}") from None
    # a later member of a name replaces an earlier one, as unpacking writes over it
    files, cleaned, links, folders, pos, next_name, next_link = {}, {}, {}, set(), 0, None, None
    while True:
        header = data[pos:pos + BLOCK]
        if len(header) < BLOCK:  # cut between members, or inside a header
            raise _refused(pos, f"the archive ends at byte {len(data)} without its end-of-archive blocks")
        if header[0] == 0 and not header.strip(b"\0"):
            break  # the end-of-archive blocks
        if not _checks_out(header):
            raise _refused(pos, f"damaged tar header at byte {pos}", header)
        size, kind = _number(header[124:136]), header[156:157]
        body = data[pos + BLOCK:pos + BLOCK + size]
        if len(body) < size:
            raise Damaged(f"the archive ends inside its member at byte {pos}")
        pos += BLOCK + -(-size // BLOCK) * BLOCK
        if kind == b"L":  # GNU: the next member's long name
            next_name = _text(body.rstrip(b"\0"))
        elif kind == b"K":  # GNU: the next member's long link target
            next_link = _text(body.rstrip(b"\0"))
        elif kind == b"x":  # pax: the next member's attributes, perhaps its path and link target
            next_name = _pax_value(body, b"path") or next_name
            next_link = _pax_value(body, b"linkpath") or next_link
        elif kind in FILE_TYPES + (HARD_LINK, SYMLINK, DIRECTORY):
            name = _text(header[:100].split(b"\0", 1)[0])
            prefix = header[345:500].split(b"\0", 1)[0] if header[257:262] == b"ustar" else b""
            name = next_name or (_text(prefix) + "/" + name if prefix else name)
            clean = _clean(name)
            target = next_link or _text(header[157:257].split(b"\0", 1)[0])
            if kind == DIRECTORY:
                folders.add(clean)
            # GNU tar stores a file named twice (tar czf a.tgz train test train) the second time as a hard
            # link to itself: unpacked, that is the file, once (taken as a link, it was a loop, left out)
            elif not (kind == HARD_LINK and _clean(target) == clean and clean in cleaned):
                files.pop(cleaned.pop(clean, None), None)
                links.pop(clean, None)
                if kind in FILE_TYPES:
                    files[name], cleaned[clean] = body, name
                else:  # a hard link names a member from the root; a symbolic one a path from its own folder
                    links[clean] = (target, kind == HARD_LINK)
            next_name = next_link = None
        else:  # devices, global pax headers: nothing to read
            next_name = next_link = None
    files, linked, dangling = _with_links(files, cleaned, links) if links else (files, {}, [])
    return Members(files, folders, linked, dangling)
