"""A checkpoint's manifest: every file it holds, with its size and SHA-256, written last and atomically.

`manifest.json` is the last file a save writes (checkpoint/sharded.py): written to a temporary name,
flushed to disk and renamed, so it is either whole or absent, and it lists every other file of the
checkpoint (meta.json included). Resume checks each file against it before anything is loaded:
a file that is missing, of another size (truncated by a full disk, a copy cut short) or of other
contents (a checksum that differs) is named with what is wrong, and the checkpoint counts as damaged.

Hashing reads every byte once (SHA-256: fast on CPUs with SHA instructions, not measured here on a
7B checkpoint); the files of a checkpoint are split over the ranks, each hashing its share, both when
saving and when verifying, so the cost per rank falls with the ranks. Checkpoints written before
manifests existed (no manifest.json) get the checks that need no manifest: meta.json parses, the
rank files and the DCP metadata are there.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable, Optional

MANIFEST = "manifest.json"
_CHUNK = 16 << 20


def listing(directory: str) -> list[str]:
    """Every file under `directory` as a '/'-separated relative path, sorted; the manifest itself left out."""
    out = []
    for base, _, files in os.walk(directory):
        for name in files:
            rel = os.path.relpath(os.path.join(base, name), directory).replace(os.sep, "/")
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def describe(directory: str, files: Iterable[str]) -> dict[str, dict]:
    """{relative path: {"bytes": size, "sha256": hex digest}} of `files` under `directory` (OSError if unreadable)."""
    out = {}
    for rel in files:
        digest = hashlib.sha256()
        size = 0
        with open(os.path.join(directory, rel), "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
        out[rel] = {"bytes": size, "sha256": digest.hexdigest()}
    return out


def write(directory: str, entries: dict[str, dict]) -> None:
    """Write `manifest.json` atomically: a temporary file, flushed to disk, renamed over the name."""
    path = os.path.join(directory, MANIFEST)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"format": 1, "files": dict(sorted(entries.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read(directory: str) -> Optional[dict[str, dict]]:
    """The manifest's {file: entry}, None when the checkpoint has none; ValueError saying what is wrong with it."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            files = json.load(f)["files"]
        if not all(isinstance(e, dict) and {"bytes", "sha256"} <= set(e) for e in files.values()):
            raise ValueError("an entry lacks its bytes or sha256")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{MANIFEST} does not parse ({type(err).__name__}: {err})") from None
    return files


def size_problems(directory: str, files: dict[str, dict]) -> list[str]:
    """What is wrong with each file's presence and size (cheap: no file is read)."""
    problems = []
    for rel, entry in files.items():
        path = os.path.join(directory, rel)
        if not os.path.isfile(path):
            problems.append(f"{rel} is missing")
            continue
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            cut = " (truncated)" if size < entry["bytes"] else ""
            problems.append(f"{rel} has {size} bytes, the manifest says {entry['bytes']}{cut}")
    return problems


def checksum_problems(directory: str, files: dict[str, dict]) -> list[str]:
    """The files among `files` whose contents differ from their checksum (each file is read whole)."""
    problems = []
    for rel, entry in files.items():
        try:
            got = describe(directory, [rel])[rel]
        except OSError as err:
            problems.append(f"{rel} cannot be read ({err.strerror or err})")
            continue
        if got["bytes"] == entry["bytes"] and got["sha256"] != entry["sha256"]:
            problems.append(f"{rel} has other contents than when it was saved (its SHA-256 is not the manifest's)")
    return problems


def legacy_problems(directory: str, world_size: int) -> list[str]:
    """For a checkpoint without a manifest: whether the files every checkpoint has are there."""
    need = [f"rank_{r:05d}.pt" for r in range(world_size)] + ["state/.metadata"]
    return [f"{rel} is missing" for rel in need if not os.path.isfile(os.path.join(directory, rel))]
