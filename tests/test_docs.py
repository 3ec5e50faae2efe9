"""The docs cannot drift from the code: recipe keys, links, and speed ratios against the benchmark tables.

docs/recipe-keys.md documents a key by writing it in backticks in the first column of a table
row (several keys may share a row); exactly those rows are parsed. A mixture task's keys are
written `tasks[].KEY`.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from lit_transformer.recipe import schema

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
KEYS_PAGE = DOCS / "recipe-keys.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def documented_keys(text: str) -> list[str]:
    """The backticked names in the first cell of every table row whose first cell starts with one."""
    keys = []
    for line in text.splitlines():
        cells = line.strip().split("|")
        if len(cells) < 3 or not line.strip().startswith("|"):
            continue
        first = cells[1].strip()
        if first.startswith("`"):
            keys.extend(re.findall(r"`([^`]+)`", first))
    return keys


def schema_keys() -> set[str]:
    task_keys = {f"tasks[].{schema.to_public(f.name)}" for f in dataclasses.fields(schema.TaskConfig)}
    return set(schema.all_keys()) | task_keys


def test_every_schema_key_is_documented_and_every_documented_key_exists():
    documented = documented_keys(KEYS_PAGE.read_text(encoding="utf-8"))
    expected = schema_keys()
    missing = sorted(expected - set(documented))
    unknown = sorted(set(documented) - expected)
    twice = sorted({key for key in documented if documented.count(key) > 1})
    assert not missing, f"schema keys not documented in docs/recipe-keys.md: {missing}"
    assert not unknown, f"keys in docs/recipe-keys.md that the schema does not have: {unknown}"
    assert not twice, f"keys documented in more than one row of docs/recipe-keys.md: {twice}"


def test_the_key_parser_reads_first_cells_only():
    text = "| `a.b`, `a.c` | `x.y` |\n|---|---|\n| key | `d.e` |\nprose `f.g`\n"
    assert documented_keys(text) == ["a.b", "a.c"]


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = {Path(t.split("#")[0]).as_posix() for t in LINK.findall(readme)}
    unlinked = [p.name for p in pages() if f"docs/{p.name}" not in targets]
    assert not unlinked, f"docs pages not linked from README.md: {unlinked}"


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    found, fence = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        fence ^= line.startswith("```")
        if not fence and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_every_relative_link_points_to_an_existing_file_and_heading():
    broken = []
    for page in [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *pages()]:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+:", target):
                continue  # a URL
            path, _, anchor = target.partition("#")
            file = (page.parent / path) if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, f"broken relative links: {broken}"


# what runs and builds leave in a checkout (the quickstart's runs/, a wheel's build/ and dist/)
GENERATED = {"runs", "build", "dist", "__pycache__", "wandb"}


def readme_tree() -> str:
    """The README's layout block: the code block that starts with `lit_transformer/`."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```\nlit_transformer/\n") + 4
    return text[start : text.index("```", start)]


def test_every_folder_appears_in_the_readme_tree():
    tree = readme_tree()
    lines = tree.splitlines()
    missing = []
    for init in sorted((ROOT / "lit_transformer").rglob("__init__.py")):
        parts = init.parent.relative_to(ROOT / "lit_transformer").parts
        if parts and not any(re.match(rf"^{'  ' * len(parts)}{parts[-1]}/\s", line) for line in lines):
            missing.append("lit_transformer/" + "/".join(parts))
    for top in sorted(p for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if top.name in GENERATED or top.name.endswith(".egg-info") or top.name == "lit_transformer":
            continue
        if not any(line.startswith(f"{top.name}/ ") for line in lines):
            missing.append(top.name)
    tests_entry = tree[tree.index("\ntests/") :]
    folders = [d for d in (ROOT / "tests").iterdir() if d.is_dir() and d.name not in GENERATED]
    missing += [f"tests/{d.name}" for d in folders if f"{d.name}/" not in tests_entry]
    assert missing == [], f"folders missing from README.md's layout block: {missing}"


# ---------------------------------------------------------------- speed-ratio figures ("1.17x")

# A figure such as "1.17x" or a range such as "5.4-14.6x" (each end must then be a figure).
RATIO = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))?x(?!\w)")

# Ratios in prose that are not benchmark results, or not copied from a table: (page, figure).
NOT_BENCHMARK_FIGURES = {
    ("evaluation.md", "10x"),  # the probe head's learning rate, 10x the backbone's: a setting
    ("recipe-keys.md", "4x"),  # d_ff 4x d_model: a shape
    # quotients of the page's own long-context table (step seconds, peak MiB at 8k and 16k)
    ("efficient-attention.md", "0.48x"),
    ("efficient-attention.md", "0.66x"),
    ("efficient-attention.md", "0.42x"),
    ("efficient-attention.md", "0.55x"),
    ("efficient-attention.md", "1.04x"),
    ("efficient-attention.md", "1.13x"),
}


def table_ratios(text: str) -> set[str]:
    """Every ratio figure in a table row of `text`, a range's two ends included."""
    found = set()
    for line in text.splitlines():
        if line.lstrip().startswith("|"):
            for m in RATIO.finditer(line):
                found |= {m.group(0), f"{m.group(1)}x"} | ({f"{m.group(2)}x"} if m.group(2) else set())
    return found


def unsourced_ratios(text: str, sources: set[str]) -> list[str]:
    """The ratio figures of `text`'s prose that no table in `sources` holds (a range: both ends)."""
    missing = []
    for line in text.splitlines():
        if line.lstrip().startswith("|"):
            continue  # a table row is itself a source, with its command beside it
        for m in RATIO.finditer(line):
            ends = [f"{m.group(1)}x"] + ([f"{m.group(2)}x"] if m.group(2) else [])
            if m.group(0) not in sources and not all(end in sources for end in ends):
                missing.append(m.group(0))
    return missing


def test_every_speed_ratio_in_the_docs_is_a_table_figure():
    """A speed ratio in docs/ or README.md is one of the figures of benchmarks/README.md's tables
    or of a docs table (each with its command), so a figure cannot drift from its measurement."""
    pages = {"README.md": ROOT / "README.md", **{p.name: p for p in DOCS.glob("*.md")}}
    texts = {name: path.read_text(encoding="utf-8") for name, path in pages.items()}
    sources = table_ratios((ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8"))
    for text in texts.values():
        sources |= table_ratios(text)
    drifted = [
        f"{name}: {figure}"
        for name, text in sorted(texts.items())
        for figure in unsourced_ratios(text, sources)
        if (name, figure) not in NOT_BENCHMARK_FIGURES
    ]
    assert not drifted, f"speed ratios in the docs that no benchmark table holds: {drifted}"


def test_the_ratio_check_catches_a_planted_figure():
    table = "| cell | ours / hf | ratio |\n|---|---|---|\n| gpt2 | 10 / 2 | 5.4x (4.8-6.1) |\n| t5 | 30 / 2 | 14.6x |\n"
    page = "Decoding is 5.4-14.6x faster; on T5 14.6x. Greedy is 12x, beam 5-12x, and d192 x 4 is a shape.\n"
    assert sorted(table_ratios(table)) == ["14.6x", "5.4x"]
    assert unsourced_ratios(page, table_ratios(table)) == ["12x", "5-12x"]
    assert unsourced_ratios(table + page.split(" Greedy")[0], table_ratios(table)) == []
