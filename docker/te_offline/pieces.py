"""Files too large for one transfer, carried to a GPU node as checked pieces and put back together there.

A node that reaches no package index gets its wheels copied in, and what one copy can carry
may be limited (an upload limit, a gateway), while Transformer Engine's core wheel alone is
276 MB. The files to carry are joined into one bundle, cut into pieces of at most `--max-mib`,
and each piece is written to a numbered folder of its own with the manifest (every piece's and
file's size and sha256, and the bundle's), so one transfer carries one folder. On the node each
folder's piece is checked against the manifest as it arrives (`receive`), and `join` rebuilds
the files only when every piece is there and every checksum agrees: a missing, truncated or
altered piece stops the install, naming the piece and the folder that carries it, instead of
installing a wrong wheel. Only the standard library: the node runs it with its own python3.

    python3 docker/te_offline/pieces.py split --max-mib 60 --out .te/pieces FILE...
    python3 docker/te_offline/pieces.py receive .te/pieces/3 --store /tmp/te      # on the node, each folder
    python3 docker/te_offline/pieces.py join --store /tmp/te --dest /tmp/te/files  # on the node, at the end
"""

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

FORMAT = "megatron-async-pieces/1"
MANIFEST = "manifest.json"
MIB = 1 << 20
_CHUNK = 4 * MIB


class PiecesError(Exception):
    """A piece or file that does not match the manifest, or one that is missing."""


def sha256_file(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def piece_name(index: int, count: int) -> str:
    """1-based, so that piece k travels in folder k."""
    return f"piece-{index:02d}-of-{count:02d}"


def split(files, out_dir, max_bytes: int) -> dict:
    """Write out_dir/<k>/{piece, manifest.json} for k = 1..n and out_dir/manifest.json."""
    if max_bytes <= 0:
        raise PiecesError(f"--max-mib must be positive, got {max_bytes / MIB:g}")
    files = [Path(f) for f in files]
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        raise PiecesError(f"two files with the same name: {sorted(n for n in names if names.count(n) > 1)}")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        if not (out_dir / MANIFEST).is_file():
            raise PiecesError(f"{out_dir} is not empty and holds no earlier split: give an empty --out")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    entries = [{"name": f.name, "size": f.stat().st_size, "sha256": sha256_file(f)} for f in files]
    total = sum(e["size"] for e in entries)
    count = max(1, -(-total // max_bytes))
    bundle, pieces = hashlib.sha256(), []
    sources = iter(files)
    current = None
    for index in range(1, count + 1):
        name = piece_name(index, count)
        folder = out_dir / str(index)
        folder.mkdir()
        digest, size = hashlib.sha256(), 0
        with open(folder / name, "wb") as out:
            while size < max_bytes:
                if current is None:
                    nxt = next(sources, None)
                    if nxt is None:
                        break
                    current = open(nxt, "rb")
                block = current.read(min(_CHUNK, max_bytes - size))
                if not block:
                    current.close()
                    current = None
                    continue
                out.write(block)
                digest.update(block)
                bundle.update(block)
                size += len(block)
        pieces.append({"name": name, "size": size, "sha256": digest.hexdigest()})
    if current is not None:
        current.close()
    manifest = {"format": FORMAT, "piece_bytes": max_bytes,
                "bundle": {"size": total, "sha256": bundle.hexdigest()},
                "files": entries, "pieces": pieces}
    for target in [out_dir] + [out_dir / str(i) for i in range(1, count + 1)]:
        write_manifest(manifest, target / MANIFEST)
    return manifest


def write_manifest(manifest: dict, path) -> None:
    Path(path).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


def read_manifest(path) -> dict:
    """The manifest, refused if it is not one this module wrote or if its sizes disagree."""
    path = Path(path)
    if not path.is_file():
        raise PiecesError(f"no manifest at {path}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise PiecesError(f"{path} is not JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PiecesError(f"{path} is not a {FORMAT} manifest")
    try:
        pieces, files, bundle = manifest["pieces"], manifest["files"], manifest["bundle"]
        piece_total = sum(int(p["size"]) for p in pieces)
        file_total = sum(int(f["size"]) for f in files)
        names = [p["name"] for p in pieces] + [f["name"] for f in files] + [bundle["sha256"]]
    except (KeyError, TypeError, ValueError) as e:
        raise PiecesError(f"{path} lacks a field or has a wrong one: {e!r}") from None
    if not (piece_total == file_total == int(bundle["size"])) or not all(isinstance(n, str) for n in names):
        raise PiecesError(f"{path}: pieces ({piece_total} bytes), files ({file_total}) and bundle "
                          f"({bundle['size']}) disagree")
    return manifest


def _check_piece(path: Path, entry: dict, number: int) -> None:
    if not path.is_file():
        raise PiecesError(f"{entry['name']} is missing from {path.parent}: receive piece folder {number} again")
    size = path.stat().st_size
    if size != entry["size"]:
        raise PiecesError(f"{entry['name']} has {size} bytes, the manifest {entry['size']}: "
                          f"receive piece folder {number} again")
    actual = sha256_file(path)
    if actual != entry["sha256"]:
        raise PiecesError(f"{entry['name']} has sha256 {actual}, the manifest {entry['sha256']}: "
                          f"receive piece folder {number} again")


def present(manifest: dict, store) -> list[int]:
    """The folders (1-based) whose piece is in store, by name only."""
    return [i for i, p in enumerate(manifest["pieces"], 1) if (Path(store) / p["name"]).is_file()]


def receive(folder, store) -> dict:
    """Check the one piece folder carries and copy it into store; returns the manifest."""
    folder, store = Path(folder), Path(store)
    manifest = read_manifest(folder / MANIFEST)
    carried = [(i, p) for i, p in enumerate(manifest["pieces"], 1) if (folder / p["name"]).is_file()]
    if len(carried) != 1:
        raise PiecesError(f"{folder} carries {len(carried)} pieces of its manifest, expected 1")
    number, entry = carried[0]
    _check_piece(folder / entry["name"], entry, number)
    store.mkdir(parents=True, exist_ok=True)
    if (store / MANIFEST).is_file():
        held = read_manifest(store / MANIFEST)
        if held["bundle"] != manifest["bundle"]:
            raise PiecesError(f"{store} holds pieces of another bundle (sha256 {held['bundle']['sha256']}, "
                              f"this piece's {manifest['bundle']['sha256']}): remove {store} and start again "
                              f"from folder 1")
    else:
        write_manifest(manifest, store / MANIFEST)
    tmp = store / (entry["name"] + ".part")
    shutil.copyfile(folder / entry["name"], tmp)
    os.replace(tmp, store / entry["name"])
    return manifest


def join(store, dest) -> dict:
    """Rebuild every file of the bundle in dest from the pieces in store, or refuse."""
    store, dest = Path(store), Path(dest)
    manifest = read_manifest(store / MANIFEST)
    pieces = manifest["pieces"]
    missing = [i for i, p in enumerate(pieces, 1) if not (store / p["name"]).is_file()]
    if missing:
        raise PiecesError(f"missing pieces {', '.join(pieces[i - 1]['name'] for i in missing)} in {store}: "
                          f"receive piece folders {', '.join(map(str, missing))} first")
    for i, entry in enumerate(pieces, 1):
        _check_piece(store / entry["name"], entry, i)
    dest.mkdir(parents=True, exist_ok=True)
    bundle = hashlib.sha256()
    stream = _piece_stream(store, pieces, bundle)
    written = []
    try:
        for entry in manifest["files"]:
            target = dest / entry["name"]
            written.append(target)
            digest, left = hashlib.sha256(), entry["size"]
            with open(target, "wb") as out:
                while left:
                    block = stream.read(min(_CHUNK, left))
                    if not block:
                        raise PiecesError(f"the pieces end before {entry['name']} does")
                    out.write(block)
                    digest.update(block)
                    left -= len(block)
            if digest.hexdigest() != entry["sha256"]:
                raise PiecesError(f"{entry['name']} rebuilt with sha256 {digest.hexdigest()}, "
                                  f"the manifest {entry['sha256']}")
        if stream.read(1) or bundle.hexdigest() != manifest["bundle"]["sha256"]:
            raise PiecesError(f"the bundle rebuilt with sha256 {bundle.hexdigest()}, "
                              f"the manifest {manifest['bundle']['sha256']}")
    except PiecesError:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    finally:
        stream.close()
    return manifest


class _piece_stream:
    """The pieces read back to back as one file, hashed as they are read."""

    def __init__(self, store: Path, pieces: list, digest):
        self._paths = [store / p["name"] for p in pieces]
        self._digest, self._file = digest, None

    def read(self, n: int) -> bytes:
        while True:
            if self._file is None:
                if not self._paths:
                    return b""
                self._file = open(self._paths.pop(0), "rb")
            block = self._file.read(n)
            if block:
                self._digest.update(block)
                return block
            self._file.close()
            self._file = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pieces.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("split", help="cut FILEs into pieces, one numbered folder each")
    p.add_argument("files", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--max-mib", type=float, default=60.0)
    p = sub.add_parser("receive", help="check one folder's piece and copy it into the store")
    p.add_argument("folder")
    p.add_argument("--store", required=True)
    p = sub.add_parser("join", help="rebuild the files once every piece is in the store")
    p.add_argument("--store", required=True)
    p.add_argument("--dest", required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "split":
            manifest = split(args.files, args.out, int(args.max_mib * MIB))
            for i, piece in enumerate(manifest["pieces"], 1):
                print(f"folder {i}: {Path(args.out) / str(i)} ({piece['size'] / MIB:.1f} MiB)")
            print(f"bundle {manifest['bundle']['size'] / MIB:.1f} MiB, {len(manifest['files'])} files, "
                  f"sha256 {manifest['bundle']['sha256']}")
        elif args.command == "receive":
            manifest = receive(args.folder, args.store)
            have = present(manifest, args.store)
            want = [i for i in range(1, len(manifest["pieces"]) + 1) if i not in have]
            print(f"pieces: have {','.join(map(str, have))} of {len(manifest['pieces'])}"
                  + (f"; missing {','.join(map(str, want))}" if want else "; all here"))
        else:
            manifest = join(args.store, args.dest)
            for entry in manifest["files"]:
                print(f"{entry['name']}: {entry['size']} bytes, sha256 ok")
    except PiecesError as e:
        print(f"pieces: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
