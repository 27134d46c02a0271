"""The docs stay true to the code: links resolve, named subcommands and config keys exist, every
benchmark script has its section, and the README's Python snippets run on a demo run's artifacts.

Conventions the docs follow (DEVELOPERS.md, "Docs"): a config key is named in backticks as
`section.key` (`train.checkpoint_every`, `data.datasets.media_root` for a dataset entry's key,
optionally followed by `: value`); a subcommand as `dflop <name>` inside backticks or a code block.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md"))
USER_DOCS = [REPO / "README.md", *DOCS]                      # subcommands and config keys checked here
LINKED_DOCS = [*USER_DOCS, REPO / "benchmarks/README.md", REPO / "CHANGES.md", REPO / "DEVELOPERS.md"]
SECTIONS = ("run", "model", "data", "profile", "scheduler", "cluster", "planner", "train")

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`((?:[^`\n]|\n(?!\n))+)`")  # may wrap onto the next line
KEY = re.compile(rf"^((?:{'|'.join(SECTIONS)})\.[A-Za-z_][A-Za-z0-9_.]*)(?::\s.*)?$")
SUBCOMMAND = re.compile(r"(?:^|[\s/(`])dflop ([a-z][a-z0-9-]*)")


def _prose(text: str) -> str:
    """`text` without its fenced code blocks (a `# comment` there is no heading, a link no link)."""
    return FENCE.sub("", text)


def _code(text: str) -> list[str]:
    """The inline code spans of the prose, and every line of the fenced code blocks."""
    spans = [" ".join(span.split()) for span in CODE_SPAN.findall(_prose(text))]
    blocks = [line for block in FENCE.findall(text) for line in block.splitlines()[1:-1]]
    return spans + blocks


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {github_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", _prose(path.read_text()), re.M)}


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(_prose(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target} (no heading with anchor #{anchor} in {dest.relative_to(REPO)})")
    return broken


def test_every_relative_link_and_anchor_resolves():
    broken = {str(p.relative_to(REPO)): b for p in LINKED_DOCS if (b := broken_links(p))}
    assert not broken, broken


def test_no_doc_links_outside_the_repository():
    # A clone of the repository has nothing beside it: DESIGN.md lived in ../shared once.
    for path in LINKED_DOCS:
        for target in LINK.findall(_prose(path.read_text())):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target) and target.split("#")[0]:
                dest = (path.parent / target.split("#")[0]).resolve()
                assert dest.is_relative_to(REPO), f"{path.relative_to(REPO)} links outside the repository: {target}"


def _subcommands() -> set[str]:
    import argparse

    from dflop.cli import build_parser

    actions = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(actions) == 1
    return set(actions[0].choices)


def test_every_named_subcommand_exists():
    known = _subcommands()
    named = {(p.name, name) for p in USER_DOCS for code in _code(p.read_text())
             for name in SUBCOMMAND.findall(code)}
    assert {"train", "optimize", "simulate"} <= {name for _, name in named}, "the pattern finds nothing"
    unknown = sorted((doc, name) for doc, name in named if name not in known)
    assert not unknown, f"not subcommands of dflop/cli.py ({sorted(known)}): {unknown}"


def _schema_keys() -> set[str]:
    schema = yaml.safe_load((REPO / "dflop/config.schema.yaml").read_text())
    keys: set[str] = set()

    def walk(node: dict, prefix: str) -> None:
        node = node.get("items", node)                     # an array's entries: data.datasets.<key>
        for name, sub in node.get("properties", {}).items():
            key = f"{prefix}.{name}" if prefix else name
            keys.add(key)
            walk(sub, key)

    walk(schema, "")
    return keys


def named_keys(text: str) -> set[str]:
    spans = (" ".join(span.split()) for span in CODE_SPAN.findall(_prose(text)))
    return {m.group(1).rstrip(".") for span in spans if (m := KEY.match(span))}


def test_every_named_config_key_is_in_the_schema():
    schema = _schema_keys()
    named = {(p.name, key) for p in [*USER_DOCS, REPO / "benchmarks/README.md"] for key in named_keys(p.read_text())}
    assert {"train.checkpoint_every", "data.datasets.media_root"} <= {k for _, k in named}, "the pattern finds nothing"
    unknown = sorted((doc, key) for doc, key in named if key not in schema)
    assert not unknown, f"not keys of dflop/config.schema.yaml: {unknown}"


def test_the_docs_yaml_examples_are_valid_configs():
    from dflop.config import validate

    checked = 0
    for path in USER_DOCS:
        for block in re.findall(r"^```yaml\n(.*?)^```", path.read_text(), re.M | re.S):
            config = yaml.safe_load(block)
            if isinstance(config, dict) and set(config) <= set(SECTIONS):
                validate(config)                           # raises naming the bad key
                checked += 1
    assert checked, "no config example found in the docs"


def test_every_benchmark_script_has_its_section():
    text = (REPO / "benchmarks/README.md").read_text()
    headings = re.findall(r"^## .*$", text, re.M)
    missing = [p.name for p in sorted((REPO / "benchmarks").glob("bench_*.py"))
               if not any(f"`{p.name}`" in h for h in headings)]
    missing += [f"gpu/{p.name}" for p in sorted((REPO / "benchmarks/gpu").iterdir())
                if p.is_file() and p.name not in text]
    assert not missing, f"benchmarks/README.md has no section for {missing}"


def test_sections_the_code_cites_exist_in_the_benchmarks_readme():
    # Docstrings cite measurements as (benchmarks/README.md, "Section"[ and "Section"]).
    headings = [h.strip() for h in re.findall(r"^#{2,3} (.+)$", _prose((REPO / "benchmarks/README.md").read_text()), re.M)]
    cited = []
    for path in [*sorted((REPO / "dflop").rglob("*.py")), *sorted((REPO / "benchmarks").rglob("*.py"))]:
        text = " ".join(path.read_text().split())
        for names in re.findall(r'benchmarks/README\.md,? ((?:"[^"]+"(?:,? and |, )?)+)', text):
            cited += [(str(path.relative_to(REPO)), name) for name in re.findall(r'"([^"]+)"', names)]
    assert cited, "the pattern finds nothing"
    missing = [(where, name) for where, name in cited if not any(h.startswith(name) for h in headings)]
    assert not missing, f"no such section in benchmarks/README.md: {missing}"


def test_the_readme_names_the_two_commands_and_they_are_make_targets():
    readme = (REPO / "README.md").read_text()
    makefile = (REPO / "Makefile").read_text()
    for target in ("demo", "test"):
        assert f"make {target}" in readme
        assert re.search(rf"^{target}:", makefile, re.M), f"Makefile has no target {target}"
    assert "make test" in (REPO / ".ci/run").read_text()


def readme_snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), re.M | re.S)


@pytest.mark.slow
@pytest.mark.parametrize("snippet", readme_snippets(), ids=lambda s: s.splitlines()[0][:40])
def test_readme_snippet_runs_on_the_demo_artifacts(snippet, demo_workdir):
    proc = subprocess.run([sys.executable, "-c", snippet], cwd=demo_workdir, capture_output=True, text=True)
    assert proc.returncode == 0, f"README snippet failed in a demo run's directory:\n{snippet}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), "the snippet printed nothing"
