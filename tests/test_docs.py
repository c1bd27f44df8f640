"""The docs a user reads: the README and every page under docs/ within their length, and every
relative link pointing at a file and a heading that exist."""

import glob
import os
import re
import unicodedata

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r'!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+"[^"]*")?\)')


def _pages():
    return [os.path.join(REPO, "README.md")] + sorted(
        glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))


def slug(heading):
    """GitHub's anchor of a heading."""
    h = re.sub(r"<[^>]+>", "", heading)
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h)
    h = h.replace("`", "").strip().lower()
    return "".join(c for c in h if c.isalnum() or c in "-_ "
                   or unicodedata.category(c).startswith("M")).replace(" ", "-")


def anchors(path):
    out, seen, fence = set(), {}, False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            fence = not fence
            continue
        m = None if fence else re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(2))
            n = seen[s] = seen.get(s, -1) + 1
            out.add(s if n == 0 else "%s-%d" % (s, n))
    return out


def broken_links(pages):
    bad = []
    for page in pages:
        text = open(page, encoding="utf-8").read()
        text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        text = re.sub(r"`[^`\n]*`", "", text)
        for m in LINK.finditer(text):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            where = "%s -> %s" % (os.path.relpath(page, REPO), target)
            if not os.path.exists(full):
                bad.append(where + " (no such file)")
            elif anchor and full.endswith(".md") and anchor not in anchors(full):
                bad.append(where + " (no such heading)")
    return bad


def test_pages_stay_short():
    lengths = {os.path.relpath(p, REPO): sum(1 for _ in open(p)) for p in _pages()}
    assert lengths["README.md"] <= 250
    assert {p: n for p, n in lengths.items() if n > 400} == {}


def test_relative_links_resolve():
    assert broken_links(_pages()) == []


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## Two words\n\n[ok](#two-words) [x](b.md) "
                                   "[y](#nothing) `[z](c.md)`\n")
    got = broken_links([str(tmp_path / "a.md")])
    assert [g.split(" -> ")[1] for g in got] == ["b.md (no such file)", "#nothing (no such heading)"]
