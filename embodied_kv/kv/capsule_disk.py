"""The disk tier's format: one folder, two files per capsule, nothing executable.

    <name>.safetensors   the tensors (safetensors: no pickle)
    <name>.json          format, name, digest, nbytes, pinned, meta

Both are written to temporary files (`.<file>.<random>.tmp`) and renamed, payload
first, manifest last. Reading checks the manifest's format and name, parses the
payload, and checks the digest over meta and tensor bytes against the manifest and
against the digest the store indexed: a truncated, flipped or swapped payload, or
an edited manifest, fails it. (One hash per read: the digest already covers every
byte a restore uses, so a second checksum of the file would only double the cost.)

A degraded disk (docs/requests.md): a file the tier cannot remove (a read-only mount,
no write permission) is left in place with a warning, never an error. On a folder it
cannot write, the scan reads and verifies every capsule before adopting it, so a
corrupted capsule whose files could not be removed is never adopted again.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections import deque
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from embodied_kv.kv.capsule import FORMAT, Capsule, capsule_digest

NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")  # fullmatch: no control characters
TMP = re.compile(r"\..+\.(json|safetensors)\.[^.]+\.tmp")  # atomic_tmp's names
FAMILY = FORMAT.rsplit("/", 1)[0] + "/"  # "embodied_kv.capsule/": every version
MANIFEST_KEYS = (("digest", str), ("nbytes", int), ("pinned", bool), ("meta", dict))
KEEP_WARNINGS = 32  # the newest warnings kept for the log and /diagnostics


class DiskTier:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.warnings: deque[str] = deque(maxlen=KEEP_WARNINGS)
        self.left: int = 0  # files it had to remove and could not (left in place)
        self.quarantine: dict[str, str] = {}  # name -> why: failed verification, files stay

    def writable(self) -> bool:
        """False on a read-only mount or without write permission on the folder."""
        try:
            if os.statvfs(self.folder).f_flag & os.ST_RDONLY:
                return False
        except OSError:
            return False
        return os.access(self.folder, os.W_OK)

    def warn(self, line: str) -> None:
        self.warnings.append(line)

    def remove(self, path: Path) -> bool:
        """Unlink one file of ours; False (and a warning) if it cannot be, never an error."""
        try:
            path.unlink(missing_ok=True)
            return True
        except OSError as e:
            self.left += 1
            reason = f"{type(e).__name__}: {e.strerror or e}"
            self.warn(f"could not remove {path} ({reason}); left in place")
            return False

    def paths(self, name: str) -> tuple[Path, Path]:
        return self.folder / f"{name}.safetensors", self.folder / f"{name}.json"

    def write(self, cap: Capsule) -> None:
        """Both files to temporaries first, then renamed (payload, then manifest)."""
        payload, manifest = self.paths(cap.name)
        tensors = {k: v.detach().contiguous().cpu() for k, v in cap.tensors.items()}
        doc = {
            "format": FORMAT,
            "name": cap.name,
            "digest": cap.digest,
            "nbytes": cap.nbytes,
            "pinned": cap.pinned,
            "meta": cap.meta,
        }
        tmp_payload = tmp_manifest = None
        try:
            tmp_payload = atomic_tmp(payload)
            save_file(tensors, tmp_payload, metadata={"format": FORMAT, "name": cap.name})
            tmp_manifest = atomic_tmp(manifest)
            Path(tmp_manifest).write_text(json.dumps(doc, sort_keys=True))
            os.replace(tmp_payload, payload)
            os.replace(tmp_manifest, manifest)
        finally:
            for tmp in (tmp_payload, tmp_manifest):
                if tmp is not None:
                    Path(tmp).unlink(missing_ok=True)

    def manifest(self, name: str) -> dict:
        _, manifest = self.paths(name)
        try:
            doc = json.loads(manifest.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"capsule {name!r} on disk: unreadable manifest ({e})") from e
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("name") != name:
            raise ValueError(f"capsule {name!r} on disk: not a {FORMAT} manifest of that name")
        for key, kind in MANIFEST_KEYS:
            if not isinstance(doc.get(key), kind):
                raise ValueError(f"capsule {name!r} on disk: manifest lacks {key!r}")
        return doc

    def read(self, name: str, digest: str) -> dict[str, torch.Tensor]:
        """The tensors of capsule `name`, whose digest the store knows as `digest`."""
        doc = self.manifest(name)
        payload, _ = self.paths(name)
        try:
            tensors = load_file(str(payload))
        except Exception as e:  # missing, or a payload safetensors cannot parse
            raise ValueError(
                f"capsule {name!r} on disk is truncated or corrupted (unreadable payload: {e})"
            ) from e
        if capsule_digest(doc["meta"], tensors) != doc["digest"] or doc["digest"] != digest:
            raise ValueError(
                f"capsule {name!r} on disk is truncated or corrupted: the digest over its meta "
                "and tensors does not match (payload changed or swapped, or manifest edited)"
            )
        return tensors

    def unlink(self, name: str) -> None:
        for p in self.paths(name):
            p.unlink(missing_ok=True)

    def discard(self, name: str) -> bool:
        """Remove a capsule's files if the folder lets us -> True; else they stay (warned)."""
        return all([self.remove(p) for p in self.paths(name)])

    def scan(self) -> tuple[list[Capsule], int]:
        """-> (capsules found, oldest manifest first; files removed). Only files this
        format wrote are touched (the folder may hold others): temporary files, our
        manifests that fail their checks (another format version, no payload) and our
        payloads without a manifest are removed where the folder allows it (else left,
        with a warning). Payloads are verified when loaded, not here (a start stays
        fast), except on a folder that cannot be written: there a corrupted capsule
        could not have been removed, so each is verified before it is adopted."""
        removed, found = 0, []
        verify = not self.writable()
        for path in sorted(self.folder.iterdir()):
            if not path.is_file():
                continue
            if TMP.fullmatch(path.name):
                removed += self.remove(path)  # a write that never finished
                continue
            if path.suffix != ".json" or not self._ours(path):
                continue
            name = path.stem
            try:
                check_name(name)
                doc = self.manifest(name)
                if not self.paths(name)[0].is_file():
                    raise ValueError(f"capsule {name!r} on disk has no payload")
            except ValueError:  # ours but unusable: it and the payload it names go
                for p in (path, path.with_suffix(".safetensors")):
                    removed += p.is_file() and self.remove(p)
                continue
            if verify:
                try:
                    self.read(name, doc["digest"])
                except ValueError as e:
                    self.quarantine[name] = str(e)
                    self.warn(f"{e}; not adopted (quarantined: the folder is read-only)")
                    continue
            cap = Capsule(name, {}, doc["meta"], doc["nbytes"], "disk", doc["pinned"])
            cap.known_digest = doc["digest"]
            found.append((path.stat().st_mtime, cap))
        names = {c.name for _, c in found} | set(self.quarantine)
        for payload in sorted(self.folder.glob("*.safetensors")):
            if payload.stem not in names and self._ours(payload):  # no manifest
                removed += self.remove(payload)
        return [c for _, c in sorted(found, key=lambda x: x[0])], removed

    @staticmethod
    def _ours(path: Path) -> bool:
        """Written by this format (any version): a manifest whose `format` says so, or a
        payload whose safetensors metadata does, or any file of an older version."""
        try:
            if path.suffix == ".json":
                doc = json.loads(path.read_text())
                return isinstance(doc, dict) and str(doc.get("format", "")).startswith(FAMILY)
            with safe_open(str(path), framework="pt") as f:
                return str((f.metadata() or {}).get("format", "")).startswith(FAMILY)
        except Exception:  # unreadable: not provably ours, so left alone
            return False


def check_name(name: str) -> None:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(
            f"bad capsule name {name!r}: use 1-128 of [A-Za-z0-9_.-], not starting with "
            "'.' or '-'"
        )


def atomic_tmp(path: Path) -> str:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    return tmp
