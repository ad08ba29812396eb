"""Citations of docs/design.md stay true: every `docs/design.md §N` written anywhere in the repository (code,
tests, jobs, scripts, configs, Markdown) names a numbered section heading that exists there, and every mention of
the page in code names a section. The page's own cross-references (`§N`) resolve too, and the research notes that
code cites by name (outside the repository) are listed on the page's sources section.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
# Where citations are looked for: text files of these kinds anywhere in the repository but .git and caches.
SCANNED_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".cpp", ".h", ".cfg", ".txt"}
CODE_SUFFIXES = {".py", ".yaml", ".yml", ".toml", ".cpp", ".h"}
SKIPPED_DIRS = {".git", ".cache", "__pycache__", ".venv", "node_modules", ".pytest_cache", ".ruff_cache"}
# Notes kept outside the repository that code cites by file name (docs/design.md lists them).
OUTSIDE_NOTES = ("serving-paper.md", "tokenizer-paper.md", "gpu-notes.md", "cluster-notes.md", "ray-notes.md")

HEADING = re.compile(r"^#{2,4}\s+(\d+(?:\.\d+)*)\.?\s+\S", re.MULTILINE)
PAGE = "docs/design" + ".md"  # split so this file's own text is not read as a citation
CITATION = re.compile(re.escape(PAGE) + r"\s*§\s*(\d+(?:\.\d+)*)")
MENTION = re.compile(r"(?<![\w/.-])(?:docs/)?design\.md\b")
# A cross-reference inside the page: §N not after "paper" (the paper's own sections, e.g. paper §7.1.3).
CROSS_REF = re.compile(r"(\bpaper\s+)?§\s*(\d+(?:\.\d+)*)")


def sections(text: str) -> set[str]:
    """The numbered section ids of a Markdown page: `## 5. Title` gives "5", `### 5.3 Title` gives "5.3"."""
    return set(HEADING.findall(text))


def citations(text: str) -> list[tuple[int, str]]:
    """(line, section id) of every `docs/design.md §N` in a text."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in CITATION.finditer(text)]


def bare_mentions(text: str) -> list[int]:
    """Lines that mention the design page without naming a section (`design.md` alone, or `docs/design.md`)."""
    cited = {m.start() for m in CITATION.finditer(text)}
    out = []
    for m in MENTION.finditer(text):
        start = m.start()
        page_start = start if text.startswith("docs/", start) else start - len("docs/")
        if page_start in cited or start in cited:
            continue
        out.append(text.count("\n", 0, start) + 1)
    return out


def _files() -> list[Path]:
    out = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info")]  # never descended
        out += [Path(folder) / n for n in names if Path(n).suffix in SCANNED_SUFFIXES]
    return sorted(path for path in out if path != DESIGN)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return ""


def test_design_page_has_unique_numbered_sections():
    text = DESIGN.read_text(encoding="utf-8")
    ids = HEADING.findall(text)
    assert ids, "docs/design.md has no numbered section headings"
    assert len(ids) == len(set(ids)), f"section numbers used twice: {sorted(i for i in ids if ids.count(i) > 1)}"
    # Every subsection sits under its top-level section.
    tops = {i for i in ids if "." not in i}
    assert all(i.split(".")[0] in tops for i in ids), "a subsection without its section"


def test_every_citation_names_an_existing_section():
    known = sections(DESIGN.read_text(encoding="utf-8"))
    wrong = [f"{path.relative_to(ROOT)}:{line}: §{sid}" for path in _files()
             for line, sid in citations(_read(path)) if sid not in known]
    assert not wrong, "citations of sections docs/design.md does not have:\n" + "\n".join(wrong)


def test_code_cites_a_section_when_it_names_the_page():
    this = Path(__file__).resolve()
    bare = [f"{path.relative_to(ROOT)}:{line}" for path in _files()
            if path.suffix in CODE_SUFFIXES and path.resolve() != this for line in bare_mentions(_read(path))]
    assert not bare, "code names the design page without a section (write `docs/design.md §N`):\n" + "\n".join(bare)


def test_code_cites_no_path_outside_the_repository():
    this = Path(__file__).resolve()
    outside = "shared/" + "docs"
    found = [f"{path.relative_to(ROOT)}:{i}" for path in _files()
             if path.suffix in CODE_SUFFIXES and path.resolve() != this
             for i, line in enumerate(_read(path).splitlines(), 1) if outside in line]
    assert not found, "cite the notes by name (docs/design.md §13 lists them), not by a path outside the repo:\n" \
        + "\n".join(found)


def test_page_cross_references_resolve():
    text = DESIGN.read_text(encoding="utf-8")
    known = sections(text)
    wrong = sorted({sid for paper, sid in CROSS_REF.findall(text) if not paper and sid not in known})
    assert not wrong, f"docs/design.md refers to sections it does not have: {wrong}"


def test_notes_cited_by_code_are_listed_on_the_page():
    text = DESIGN.read_text(encoding="utf-8")
    cited = {note for path in _files() if path.suffix in CODE_SUFFIXES for note in OUTSIDE_NOTES
             if note.removesuffix(".md") in _read(path)}
    missing = sorted(note for note in cited if note not in text)
    assert not missing, f"notes cited in code but not listed in docs/design.md: {missing}"


def test_the_checks_can_fail():
    """The parsers on a page and a text made for them: a missing section, a bare mention, a wrapped citation."""
    page = "# T\n\n## 1. One\n\n### 1.2 Sub\n\n## 2. Two\n"
    assert sections(page) == {"1", "1.2", "2"}
    text = (f"# see {PAGE} §1.2 and {PAGE} §3\n"
            f"# the contract ({PAGE},\n# \"a title\") and design.md\n"
            f'"""wrapped: {PAGE}\n§2"""\n')
    assert citations(text) == [(1, "1.2"), (1, "3"), (4, "2")]
    assert [sid for _, sid in citations(text) if sid not in sections(page)] == ["3"]
    assert bare_mentions(text) == [2, 3]
