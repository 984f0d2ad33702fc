#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The patch series as a git repository, for restructuring and rebasing it.

``fork.py refresh`` edits the last patch that touches a file; splitting,
merging or reordering patches, or carrying the series to another vLLM
release, is easier with git's own tools::

    fork_workspace.py init   DIR [--base cpu] [--vllm VERSION]   # one commit a patch
    ... edit, commit, `git rebase -i base` in DIR ...
    fork_workspace.py export DIR [--renumber]   # back into patches/<VERSION>/

``init`` commits the pristine upstream files the series touches (tag
``base``), then each patch as one commit whose message is the patch's header
and whose last line names its file (``Patch: 0007-....patch``). ``export``
writes every commit after ``base`` back as a patch of the workspace's release
(a commit without a ``Patch:`` line gets a name from its subject and the next
number), rewrites ``patches/<VERSION>/series`` and removes the patch files no
commit names. A file the
series newly touches must be committed into ``base`` first (``git commit
--amend`` on the base commit, then rebase), so that ``base`` stays the
pristine tree. Only the standard library and ``git`` are used.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fork import (  # noqa: E402
    DEFAULT_VERSION,
    FLAVOURS,
    SUPPORTED,
    Base,
    ForkError,
    Pristine,
    _diff,
    git_apply,
    log,
    patch_files,
    patch_header,
    read_series,
    series_dir,
    series_files,
)

TRAILER = "Patch: "


def _git(ws: Path, *args: str, stdin: str | None = None) -> str:
    proc = subprocess.run(
        ["git", "-C", str(ws), *args],
        input=stdin,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise ForkError(f"git {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def init(ws: Path, base: Base) -> None:
    if ws.exists() and any(ws.iterdir()):
        raise ForkError(f"{ws} is not empty")
    ws.mkdir(parents=True, exist_ok=True)
    pristine = Pristine(base)
    series = read_series(base.version)
    _git(ws, "init", "-q")
    _git(ws, "config", "user.name", "fork workspace")
    _git(ws, "config", "user.email", "fork-workspace@localhost")
    _git(ws, "config", "fork.vllm", base.version)  # where export writes
    for rel in series_files(series):
        dst = ws / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(pristine.read(rel))
    _git(ws, "add", "-A")
    _git(ws, "commit", "-q", "-m", f"base: pristine {base.pin} files")
    _git(ws, "tag", "base")
    for patch in series:
        git_apply(ws, patch)
        header = patch_header(patch).rstrip()
        header = re.sub(r"\n---$", "", header).rstrip()
        message = f"{header}\n\n{TRAILER}{patch.name}\n"
        _git(ws, "add", "-A")
        _git(ws, "commit", "-q", "-F", "-", stdin=message)
    log(f"{ws}: base + {len(series)} commits, one a patch")


def _slug(subject: str) -> str:
    subject = subject.removeprefix("Subject:").strip().lower()
    return re.sub(r"[^a-z0-9]+", "-", subject).strip("-")[:48] or "change"


def export(ws: Path, renumber: bool = False) -> None:
    folder = series_dir(_git(ws, "config", "fork.vllm").strip())
    commits = _git(ws, "rev-list", "--reverse", "base..HEAD").split()
    if not commits:
        raise ForkError(f"{ws}: no commits after base")
    names: list[str] = []
    texts: list[str] = []
    for number, commit in enumerate(commits, start=1):
        message = _git(ws, "log", "-1", "--format=%B", commit).rstrip()
        lines = message.splitlines()
        name = next(
            (ln[len(TRAILER) :].strip() for ln in lines if ln.startswith(TRAILER)),
            None,
        )
        header = "\n".join(ln for ln in lines if not ln.startswith(TRAILER)).rstrip()
        if name is None:
            name = f"{number:04d}-{_slug(lines[0])}.patch"
        body = []
        files = _git(ws, "diff", "--name-only", f"{commit}^", commit).split()
        if (folder / name).is_file():  # keep the patch's own file order
            order = {f: i for i, f in enumerate(patch_files(folder / name))}
            files.sort(key=lambda f: order.get(f, len(order)))
        for rel in files:
            before = _git(ws, "show", f"{commit}^:{rel}")
            after = _git(ws, "show", f"{commit}:{rel}")
            body.append(_diff(rel, before.encode(), after.encode()))
        if not files:
            raise ForkError(f"{commit[:12]} ({name}) changes nothing")
        names.append(name)
        texts.append(f"{header}\n\n---\n" + "".join(body))
    if renumber:  # number the patches by their place in the series
        names = [
            f"{i:04d}-{n[5:]}" if n[:4].isdigit() and n[4] == "-" else n
            for i, n in enumerate(names, start=1)
        ]
    if len(set(names)) != len(names):
        raise ForkError(f"two commits name the same patch: {names}")
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.patch"):
        if old.name not in names:
            old.unlink()
    for name, text in zip(names, texts):
        (folder / name).write_text(text)
    (folder / "series").write_text("".join(f"{n}\n" for n in names))
    log(f"exported {len(names)} patches into {folder}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    i = sub.add_parser("init")
    i.add_argument("workspace", type=Path)
    i.add_argument("--base", choices=sorted(FLAVOURS), default="cpu")
    i.add_argument("--vllm", choices=sorted(SUPPORTED), default=DEFAULT_VERSION)
    e = sub.add_parser("export")
    e.add_argument("workspace", type=Path)
    e.add_argument(
        "--renumber", action="store_true", help="number patches by series order"
    )
    args = parser.parse_args(argv)
    try:
        if args.verb == "init":
            init(args.workspace, Base(args.base, args.vllm))
        else:
            export(args.workspace, args.renumber)
    except ForkError as exc:
        print(f"fork_workspace: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
