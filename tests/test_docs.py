"""The documentation a newcomer reads: links that lead somewhere, a README read in minutes, and
`mpexp-train --help` that names what there is to choose."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_WORDS = 1500

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(text: str) -> str:
    """The text outside fenced code blocks (```), where links and headings are what they seem."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            kept.append(line)
    return "\n".join(kept)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lowercased, punctuation dropped (hyphens and
    underscores kept), each space a hyphen; a repeated heading gets -1, -2, ..."""
    seen: dict[str, int] = {}
    for line in prose(page.read_text()).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", prose(page.read_text()))  # a link inside `code` is no link
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z+.-]*:", t)]  # https:, mailto:


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked.relative_to(ROOT)}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with the anchor #{anchor}")
    assert broken == [], f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_anchors_follow_githubs_rules(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Weights & Biases\n## Your own images: `dataset=image_folder`\n```\n# a comment\n```\n"
        "## Notes\n## Notes\n"
    )
    assert anchors(page) == {
        "weights--biases",
        "your-own-images-datasetimage_folder",
        "notes",
        "notes-1",
    }


def test_the_readme_reads_in_minutes():
    text = prose((ROOT / "README.md").read_text())
    words = len(re.findall(r"\S+", text))
    assert words <= README_WORDS, f"README.md has {words} words outside code; move some to docs/"


def test_help_names_every_group_and_option_the_most_used_keys_and_the_docs(in_process, tmp_path):
    result = in_process("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    groups = [d for d in sorted((ROOT / "conf").iterdir()) if d.is_dir() and d.name != "hydra"]
    assert len(groups) >= 7
    for group in groups:
        options = ", ".join(sorted(f.stem for f in group.glob("*.yaml")))
        assert f"{group.name}: {options}" in text
    for key in ("trainer.epochs", "trainer.seed", "optimizer.lr", "trainer.resume", "wandb.mode"):
        assert f"\n{key}=" in text
    assert "docs/configuration.md" in text and "--cfg job" in text
    assert "_target_" not in text  # the composed config stays behind --cfg job
