"""ImageNet as image-net.org hands it out: the train and val tars and the devkit, read in place.

`ILSVRC2012_img_train.tar` is 138 GB of 1,000 tars (one per synset) and nobody wants to extract
it twice, so nothing here extracts: each image is indexed as a byte range of the file it sits in
(tar stores members uncompressed), read later with one `pread`. Indexing reads only the 512-byte
headers, seeking over the image data.

The devkit (`ILSVRC2012_devkit_t12.tar.gz`, or that dir extracted) labels val: line n of
`data/ILSVRC2012_validation_ground_truth.txt` is the 1-based ILSVRC2012_ID of val image n, and
`data/meta.mat` maps those ids to wnids. The ids are not in sorted-wnid order, so the label index
is the wnid's position in sorted order, as torchvision's ImageNet and every checkpoint have it.
"""

from __future__ import annotations

import io
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

from sparknet.errors import SparknetError

TRAIN_TAR = "ILSVRC2012_img_train.tar"
VAL_TAR = "ILSVRC2012_img_val.tar"
DEVKIT = "ILSVRC2012_devkit_t12"
DEVKIT_TAR = f"{DEVKIT}.tar.gz"
GROUND_TRUTH = "data/ILSVRC2012_validation_ground_truth.txt"
META_MAT = "data/meta.mat"
#: ILSVRC2012's val file names: image n is `ILSVRC2012_val_<n, 8 digits>.JPEG`
VAL_NAME = re.compile(r"^ILSVRC2012_val_(\d{8})$")


@dataclass(frozen=True)
class Member:
    """A regular file inside a tar: its name there, and where its bytes are in the file on disk."""

    name: str
    offset: int
    size: int


class _Window(io.RawIOBase):
    """Bytes [start, start + size) of an open file, as a seekable file of their own: a tar stored
    inside a tar, read without copying it out."""

    def __init__(self, fd: int, start: int, size: int) -> None:
        self.fd, self.start, self.size, self.pos = fd, start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer) -> int:  # type: ignore[override]
        n = max(0, min(len(buffer), self.size - self.pos))
        data = os.pread(self.fd, n, self.start + self.pos)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _members(fileobj, base: int, where: str, end: int) -> list[Member]:
    """The regular-file members of the tar read from `fileobj`, whose byte 0 is `base` in the file
    on disk; one line when it is not a tar or is cut short (`end`: the bytes the file has)."""
    out = []
    seen: set[str] = set()
    try:
        with tarfile.open(fileobj=fileobj, mode="r:") as tar:
            for info in tar:
                if not info.isfile():  # links and devices are nobody's images
                    continue
                if info.name in seen:  # the second copy would be read twice, or replace one
                    raise SparknetError(
                        f"{where} holds {info.name} twice: it is not as downloaded; download it "
                        "again"
                    )
                seen.add(info.name)
                out.append(Member(_utf8(info.name, where), base + info.offset_data, info.size))
    except tarfile.TarError as exc:
        if "unexpected end" in str(exc):  # tarfile's words for a header cut short
            raise SparknetError(
                f"{where} ends inside a member: the download is incomplete; finish or repeat it"
            ) from None
        raise SparknetError(
            f"{where} is not a readable tar ({_one_line(exc)}): download it again"
        ) from None
    if out and out[-1].offset + out[-1].size > end:
        raise SparknetError(
            f"{where} ends inside {out[-1].name}: the download is incomplete; finish or repeat it"
        )
    return out


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _utf8(name: str, where: str) -> str:
    """A member name the manifest (JSON) can hold: tarfile decodes other bytes to lone
    surrogates, which no reader could load back."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        shown = name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        raise SparknetError(
            f"{where} holds {shown}, whose name is not valid UTF-8: repack it without that file"
        ) from None
    return name


def tar_members(path: Path) -> list[Member]:
    """The files in the tar at `path`, in tar order."""
    with open(path, "rb") as f:
        return _members(f, 0, str(path), os.fstat(f.fileno()).st_size)


def nested_members(path: Path, inner: Member) -> list[Member]:
    """The files of the tar stored as member `inner` of the tar at `path` (one synset of the
    train tar), with offsets in `path`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        end = min(os.fstat(fd).st_size, inner.offset + inner.size)
        window = io.BufferedReader(_Window(fd, inner.offset, inner.size), 1 << 16)
        return _members(window, inner.offset, f"{path} member {inner.name}", end)
    finally:
        os.close(fd)


def read_range(path: Path, offset: int, size: int) -> bytes:
    """`size` bytes of `path` from `offset`: one member's data. A short read (the file shrank
    since it was indexed) is an OSError like any other unreadable source."""
    with open(path, "rb") as f:
        data = os.pread(f.fileno(), size, offset)
    if len(data) != size:
        raise OSError(f"{path} is shorter than when it was indexed")
    return data


@dataclass(frozen=True)
class Devkit:
    """What the devkit says: val image n's wnid (`val_wnids[n - 1]`) and each wnid's words."""

    val_wnids: list[str]
    names: dict[str, str]
    where: str


def find_devkit(src: Path) -> Path | None:
    """The devkit beside the downloads: the .tar.gz as downloaded, or its extracted dir."""
    for candidate in (src / DEVKIT_TAR, src / DEVKIT):
        if candidate.exists():
            return candidate
    return None


def _devkit_files(path: Path) -> tuple[bytes, bytes]:
    """(meta.mat, the ground truth) read from the devkit tarball or its extracted dir."""
    wanted = (META_MAT, GROUND_TRUTH)
    if path.is_dir():
        missing = [name for name in wanted if not (path / name).is_file()]
        if missing:
            raise SparknetError(
                f"{path} has no {missing[0]}: point at the ILSVRC2012 devkit as extracted from "
                f"{DEVKIT_TAR}"
            )
        return (path / META_MAT).read_bytes(), (path / GROUND_TRUTH).read_bytes()
    found: dict[str, bytes] = {}
    try:
        with tarfile.open(path, "r:*") as tar:
            for info in tar:
                for name in wanted:
                    if info.isfile() and info.name.endswith("/" + name):
                        found[name] = tar.extractfile(info).read()  # type: ignore[union-attr]
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise SparknetError(
            f"{path} is not a readable tar.gz ({_one_line(exc)}): download it again"
        ) from None
    missing = [name for name in wanted if name not in found]
    if missing:
        raise SparknetError(
            f"{path} holds no {missing[0]}: use the devkit of ILSVRC2012 ({DEVKIT_TAR}, task 1 & 2)"
        )
    return found[META_MAT], found[GROUND_TRUTH]


def read_devkit(path: Path) -> Devkit:
    """The val labels and class words of the devkit at `path` (tarball or extracted dir).

    meta.mat's `synsets` holds 1,860 synsets; the 1,000 leaves (num_children 0) are the classes
    and their ILSVRC2012_ID (1..1000) is what the ground truth names.
    """
    from scipy.io import loadmat  # scipy comes with scikit-learn; only the devkit needs it

    meta_bytes, truth_bytes = _devkit_files(path)
    try:
        synsets = loadmat(io.BytesIO(meta_bytes), squeeze_me=True)["synsets"]
        ids = [int(i) for i in synsets["ILSVRC2012_ID"]]
        wnids = [str(w) for w in synsets["WNID"]]
        words = [str(w) for w in synsets["words"]]
        leaves = [int(n) == 0 for n in synsets["num_children"]]
    except Exception as exc:  # scipy raises many types for a damaged .mat
        raise SparknetError(
            f"{path}: {META_MAT} cannot be read ({type(exc).__name__}: {_one_line(exc)}): "
            "download the devkit again"
        ) from None
    id_to_wnid = {i: w for i, w, leaf in zip(ids, wnids, leaves, strict=True) if leaf}
    names = {w: n for w, n, leaf in zip(wnids, words, leaves, strict=True) if leaf}
    val_wnids = []
    lines = truth_bytes.decode("ascii", "replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    for n, raw in enumerate(lines, start=1):
        line = raw.strip()
        wnid = id_to_wnid.get(int(line)) if line.isdigit() else None
        if wnid is None:
            raise SparknetError(
                f"{path}: line {n} of {GROUND_TRUTH} ({line!r}) is not a class id of "
                f"{META_MAT}: download the devkit again"
            )
        val_wnids.append(wnid)
    return Devkit(val_wnids=val_wnids, names=names, where=str(path))


def val_number(stem: str) -> int | None:
    """n of `ILSVRC2012_val_<n>`, or None for another name."""
    match = VAL_NAME.match(stem)
    return int(match.group(1)) if match else None
