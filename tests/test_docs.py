"""The guide is checked like code: every `hpcdist ...` command line in the README and docs/
parses with the real command line, every job spec or site config shown as YAML loads (or says it
is a fragment), every link between pages resolves, and every performance table has its command,
date and versions beside it."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from hpcdist.cli import _split_command, build_parser
from tests.support.cli import REPO

PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
FENCE = re.compile(r"^```(\w*)\s*$")
# A YAML block that is part of a spec or a site config, not a whole one, says so on its first line.
FRAGMENT = "# fragment"


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    text: str


def blocks(page: Path) -> list[Block]:
    out, lang, start, body = [], None, 0, []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        match = FENCE.match(line)
        if match and lang is None:
            lang, start, body = match.group(1), number, []
        elif line.startswith("```") and lang is not None:
            out.append(Block(page, start, lang, "\n".join(body)))
            lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"{page.name}: a code block opened at line {start} is never closed"
    return out


def prose(page: Path) -> str:
    """The page without its code blocks."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


def command_lines() -> list[tuple[str, str]]:
    """(where, line) for each `hpcdist ...` line of a shell block and each inline `hpcdist ...`."""
    found = []
    for page in PAGES:
        for block in blocks(page):
            if block.lang not in ("sh", "bash", "shell", "console"):
                continue
            joined = re.sub(r"\\\n\s*", " ", block.text)
            for offset, line in enumerate(joined.splitlines()):
                line = line.strip().removeprefix("$ ")
                if re.match(r"(\S*/)?hpcdist ", line):
                    found.append((f"{page.name}:{block.line + offset + 1}", line))
        for span in re.findall(r"`(hpcdist [^`]+)`", prose(page)):
            words = span.split()[1:]
            if len(words) <= 2 and not any(w.startswith("-") for w in words):
                continue  # a command named in a sentence: test_every_named_command_exists
            found.append((f"{page.name} (inline)", span))
    return found


def test_the_guide_shows_commands() -> None:
    assert len(command_lines()) > 40


@pytest.mark.parametrize(("where", "line"), command_lines())
def test_every_command_line_parses(where: str, line: str) -> None:
    argv = shlex.split(line.split(" | ")[0].split(" && ")[0], comments=True)[1:]
    argv = [a for a in argv if a not in ("...", "…")]
    own, script = _split_command(argv)
    try:
        args = build_parser().parse_args(own)
    except SystemExit as exc:
        if exc.code == 0:  # --help
            return
        pytest.fail(f"{where}: `{line}` does not parse (exit {exc.code})")
    if args.command in ("render", "submit"):
        assert bool(args.job) != bool(script), f"{where}: `{line}` gives both or neither of a spec and a script"


def test_every_named_command_exists() -> None:
    """`hpcdist NAME` and `hpcdist FAMILY SUB` named in a sentence are real commands."""
    parser = build_parser()
    unknown = []
    for page in PAGES:
        for span in re.findall(r"`hpcdist ([a-z][a-z-]*(?: [a-z][a-z/-]*)?)`", prose(page)):
            try:
                with contextlib.redirect_stderr(io.StringIO()):
                    parser.parse_known_args([*span.split(), "--help"])
            except SystemExit as exc:
                if exc.code != 0:
                    unknown.append(f"{page.name}: hpcdist {span}")
    assert unknown == []


def yaml_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.lang in ("yaml", "yml")]


@pytest.mark.parametrize("block", yaml_blocks(), ids=lambda b: f"{b.page.name}:{b.line}")
def test_every_yaml_block_loads(block: Block, tmp_path: Path) -> None:
    from hpcdist.config import load_site, read_spec

    data = yaml.safe_load(block.text)
    if block.text.lstrip().startswith(FRAGMENT):
        return
    assert isinstance(data, dict), f"{block.page.name}:{block.line}: not a mapping; mark a fragment with {FRAGMENT!r}"
    path = tmp_path / "shown.yaml"
    path.write_text(block.text)
    if "kind" in data:
        read_spec(path)
    elif "scheduler" in data or "partitions" in data:
        load_site(str(path))
    else:
        pytest.fail(f"{block.page.name}:{block.line}: neither a job spec (kind:) nor a site config "
                    f"(scheduler:, partitions:); mark a part of one with {FRAGMENT!r} on its first line")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.+)$", prose(page), flags=re.M)}


def test_every_link_between_pages_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(page)):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []


def test_every_docs_page_is_linked_from_the_readme_and_links_back() -> None:
    readme = (REPO / "README.md").read_text()
    pages = sorted((REPO / "docs").glob("*.md"))
    assert [p.name for p in pages if f"(docs/{p.name})" not in readme] == []
    assert [p.name for p in pages if "(../README.md)" not in p.read_text()] == []


def test_the_readme_is_a_front_page() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 300


TABLE_ROW = re.compile(r"^\|.*\d.*\|\s*$")
DATE = re.compile(r"20\d\d-\d\d-\d\d")
VERSION = re.compile(r"torch \d+\.\d+")
COMMAND = re.compile(r"`[^`]*(benchmarks/|make |hpcdist )[^`]*`")


def test_every_performance_table_keeps_its_command_date_and_versions() -> None:
    """Above each table of figures: the command that gave them (since the table before), and the
    date and torch version (in the page's opening or the table's own section)."""
    lines = (REPO / "docs" / "performance.md").read_text().splitlines()
    intro_end = next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))
    intro = "\n".join(lines[:intro_end])
    section_start, since_table, missing, in_table = 0, 0, [], False
    for i, line in enumerate(lines):
        if line.startswith("## "):
            section_start = since_table = i
        is_row = line.startswith("|")
        if is_row and not in_table and TABLE_ROW.match(lines[i + 2] if i + 2 < len(lines) else ""):
            context = intro + "\n".join(lines[section_start:i]) if section_start else "\n".join(lines[:i])
            if not COMMAND.search("\n".join(lines[since_table:i])):
                missing.append(f"performance.md:{i + 1}: no command above this table")
            if not (DATE.search(context) and VERSION.search(context)):
                missing.append(f"performance.md:{i + 1}: no date and torch version for this table")
        if in_table and not is_row:
            since_table = i
        in_table = is_row
    assert missing == []
