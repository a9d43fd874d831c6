"""The pages stay true of the repository: every relative link of README.md, CONTRIBUTING.md, docs/*.md and bench/*.md
leads to a file (and a `#section` to a heading there); every repository path those pages cite (a `file:line` too),
every test they name and every `attnlab.` name they put in backticks exists; the layout tree of docs/layout.md names
every file and folder at the top of the repository and of src/attnlab/, and only paths that exist; the front page
stays a front page; and each guide starts from a command and ends with what the user sees. (Their commands run in
tests/test_readme.py; the config table's tests are checked in tests/test_style.py.)"""

from __future__ import annotations

import ast
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

from test_contributing import resolve  # an `attnlab.x.y` name's object, as CONTRIBUTING.md's test reads it

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", *(REPO / "docs").glob("*.md"), *(REPO / "bench").glob(
    "*.md")])
GUIDES = [REPO / "docs" / f"{n}.md" for n in ("training", "data", "decoding", "variants", "ablations", "slurm",
                                              "reliability", "reproduce", "performance", "layout")]
FENCE = re.compile(r"^ *```.*?^ *```", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
TOP = ("src", "tests", "bench", "experiments", "ablations", "slurm", "docs")
# a repository path in a page: under one of TOP (a glob with *, a folder with /, a `file:line` with :N or :N-M), or
# attnlab/... for src/attnlab/...
CITED = re.compile(r"(?<![\w./<>-])((?:" + "|".join(TOP) + r"|attnlab)/[\w./*-]*\w/?)(?::(\d+)(?:-(\d+))?)?")
TEST_NAME = re.compile(r"\b(test_\w+\.py)::(test_\w+\*?)")


def rel(page: Path) -> str:
    return str(page.relative_to(REPO))


@cache
def tracked() -> list[str]:
    """The files git tracks: what the layout tree must name (files not yet added are not a clone's)."""
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def exists(path: str) -> bool:
    if "*" in path:
        return any(REPO.glob(path))
    return (REPO / path).exists()


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: a link's text for the link, lower case, anything but letters, digits, _, - and
    spaces dropped (backticks, parentheses), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_every_relative_link_leads_somewhere():
    bad = []
    for page in PAGES:
        for target in LINK.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.is_relative_to(REPO) or not exists(str(dest.relative_to(REPO))):
                bad.append(f"{rel(page)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and dest.exists() and anchor not in anchors(dest):
                bad.append(f"{rel(page)}: {target} (no heading #{anchor} in {dest.name})")
    assert not bad, "\n".join(bad)


def cited_paths(page: Path) -> list[tuple[str, int | None]]:
    text = re.sub(r"https?://\S+", "", page.read_text(encoding="utf-8"))
    text = LINK.sub("", text)  # links are checked above, relative to their page
    out = []
    for m in CITED.finditer(text):
        path = m.group(1).rstrip(".")
        if path.startswith("attnlab/"):
            path = "src/" + path
        out.append((path, int(m.group(3) or m.group(2)) if m.group(2) else None))
    return out


@pytest.mark.parametrize("page", [p for p in PAGES if p.parent.name != "bench"], ids=rel)
def test_every_cited_path_and_line_exists(page):
    found = cited_paths(page)
    missing = sorted({p for p, _ in found if not exists(p)})
    assert not missing, f"{rel(page)} cites paths that do not exist: {missing}"
    short = [f"{p}:{n}" for p, n in found if n is not None and n > len((REPO / p).read_text().splitlines())]
    assert not short, f"{rel(page)} cites lines past the end of their file: {short}"


@cache
def defined_tests(file: str) -> set[str]:
    path = REPO / "tests" / file
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_test_named_exists():
    """`test_x.py::test_y` anywhere, and `tests/test_x.py` or a bare `test_x.py` file: defined in tests/."""
    bad = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for file, name in TEST_NAME.findall(text):
            prefix = name.removesuffix("*")
            if not (REPO / "tests" / file).is_file() or not any(
                    d == name or (name.endswith("*") and d.startswith(prefix)) for d in defined_tests(file)):
                bad.append(f"{rel(page)}: {file}::{name}")
        for file in re.findall(r"(?<![\w/])(test_\w+\.py)\b", text):
            if not (REPO / "tests" / file).is_file():
                bad.append(f"{rel(page)}: {file}")
    assert not bad, "\n".join(bad)




def test_every_attnlab_name_in_backticks_resolves():
    bad = []
    for page in PAGES:
        prose = FENCE.sub("", page.read_text(encoding="utf-8"))
        for code in re.findall(r"`([^`\n]+)`", prose):
            m = re.fullmatch(r"(attnlab(?:\.\w+)+)(?:\(.*\)|\[\"(\w+)\"\])?", code)
            if not m:
                continue
            try:
                obj = resolve(m.group(1))
                assert m.group(2) is None or m.group(2) in obj
            except (ImportError, AttributeError, AssertionError):
                bad.append(f"{rel(page)}: {code}")
    assert not bad, "\n".join(bad)


def layout_tree() -> list[str]:
    """The paths of docs/layout.md's tree: an entry is a line indented less than 8 spaces whose first word is a
    name (a folder ends in /); an entry indented 2 spaces more than a folder is inside it."""
    text = (REPO / "docs" / "layout.md").read_text(encoding="utf-8")
    tree = re.search(r"^```text\n(.*?)^```", text, re.S | re.M).group(1)
    paths, folders = [], []
    for line in tree.splitlines():
        indent = len(line) - len(line.lstrip())
        if not line.strip() or indent >= 8:
            continue
        name = line.split()[0]
        folders = folders[: indent // 2]
        paths.append("".join(folders) + name)
        if name.endswith("/"):
            folders.append(name)
    return paths


def test_layout_tree_names_every_top_level_entry_and_only_what_exists():
    paths = layout_tree()
    assert "src/attnlab/config.py" in paths and "src/attnlab/models/" in paths
    missing = [p for p in paths if not exists(p)]
    assert not missing, f"docs/layout.md names paths that do not exist: {missing}"
    named = {p.rstrip("/") for p in paths}
    top = {f.split("/")[0] for f in tracked() if not f.startswith(".")}
    package = {"src/attnlab/" + f.split("/")[2] for f in tracked() if f.startswith("src/attnlab/")}
    left_out = sorted(p for p in (top - {"src"}) | package if p not in named)
    assert not left_out, f"docs/layout.md's tree leaves out {left_out}: add a line for each"


def test_the_front_page_fits_on_a_few_screens():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move the depth into a guide in docs/"
    linked = set(LINK.findall((REPO / "README.md").read_text(encoding="utf-8")))
    guides = {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")} - {"docs/significance_power.md"}
    assert guides <= linked, f"guides the front page does not link: {sorted(guides - linked)}"


@pytest.mark.parametrize("guide", GUIDES, ids=rel)
def test_each_guide_starts_from_a_command_and_ends_with_what_the_user_sees(guide):
    text = guide.read_text(encoding="utf-8")
    first_section = text.split("\n## ", 1)[0]
    assert re.search(r"^```(bash|python)\n", first_section, re.M), f"{rel(guide)}: no command before its first section"
    assert re.findall(r"^## (.+)$", text, re.M)[-1] == "What you see", f"{rel(guide)}: its last section is not "\
        "'What you see'"
