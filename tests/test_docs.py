"""Executes the code in the documentation, and checks its links.

Which blocks run: a fenced code block is *runnable* when the line right above its opening fence is the
HTML comment ``<!-- doctest: run -->`` (invisible when the Markdown is rendered), optionally with options::

    <!-- doctest: run ports=7164-7167 only="paddle-cluster run" expect="final test_mse=" -->

- ```` ```python ```` blocks are written to a file and run with this interpreter; ```` ```sh ```` blocks run
  with ``bash -e -o pipefail``. Other languages cannot be marked.
- Every runnable block of one Markdown file runs in order, in one fresh temporary directory, with ``HOME``
  pointed at a fresh temporary home: the built-in local cluster's ``ROOT_DIR`` (``~/paddle_cluster_jobs``)
  and the launcher's job memory land there, and a later block sees what an earlier one did (``paddle-cluster
  plot`` after ``paddle-cluster run``). The directory holds links to the repository's ``examples/`` and
  ``conf.py.example``, so commands written "in the repository root" work unchanged, without a ``conf.py``.
- The environment has no ``PADDLE_*`` variables (a Python block's ``connect()`` uses its in-process pserver),
  no ``XDG_STATE_HOME``, ``PYTHONPATH`` = this checkout, and ``paddle-cluster`` and ``python`` on ``PATH``
  run this checkout with this interpreter.
- A block must exit 0 within ``BLOCK_TIMEOUT`` seconds. A comment ``# expect: TEXT`` on any of its lines, or
  the option ``expect="TEXT"``, means TEXT must appear in its output (stdout and stderr).
- ``ports=LO-HI``: the block needs those ports on 127.0.0.1; if one is busy (another job), the block and the
  rest of its file are skipped with a reason.
- ``only="TEXT"`` (sh): run only the lines containing TEXT, and of a line ``a && b`` only the parts containing
  TEXT. It lets the README's ``scripts/venv && ... && paddle-cluster run ...`` block run its ``run`` part.

Mark only safe, local commands. ``test_required_blocks_are_marked`` keeps the blocks that must run marked.

Links: every relative link ``[text](target)`` in README.md and docs/*.md (outside code) must name an existing
file or directory; a ``#fragment`` into a Markdown file must match one of its headings (GitHub's anchors).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from helpers import checkout_env, ports_free

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
BLOCK_TIMEOUT = 150.0
MARKER = re.compile(r"^<!--\s*doctest:\s*run\b(?P<opts>.*?)-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<lang>[\w+-]*)")
EXPECT_COMMENT = re.compile(r"#\s*expect:\s*(?P<text>.+?)\s*$")
RUNNABLE_LANGS = ("python", "sh")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    runnable: bool = False
    opts: Dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def parse_blocks(path: Path) -> List[Block]:
    """Every fenced code block of a Markdown file, with its doctest marker if it has one."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: List[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group("fence"), m.group("lang").lower()
        start = i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(m.group("indent")):] if lines[i].startswith(m.group("indent")) else lines[i])
            i += 1
        block = Block(path, start + 1, lang, "\n".join(body) + "\n")
        marker = MARKER.match(lines[start - 1].strip()) if start > 0 else None
        if marker:
            block.runnable = True
            for item in shlex.split(marker.group("opts")):
                key, _, value = item.partition("=")
                block.opts[key] = value
        blocks.append(block)
        i += 1
    return blocks


def _stray_markers(path: Path) -> List[int]:
    """Lines with a doctest marker that is not right above a fence (a typo would silently skip a block)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [n + 1 for n, line in enumerate(lines)
            if "doctest:" in line and line.strip().startswith("<!--")
            and (n + 1 >= len(lines) or not FENCE.match(lines[n + 1]))]


def _runnable_files() -> List[Path]:
    return [p for p in DOCS if any(b.runnable for b in parse_blocks(p))]


# -- running blocks ------------------------------------------------------------------------------------


def _ports_busy(spec: str) -> List[int]:
    lo, _, hi = spec.partition("-")
    return [port for port in range(int(lo), int(hi or lo) + 1) if not ports_free([port])]


def _sandbox(tmp: Path) -> Tuple[Path, Dict[str, str]]:
    """The working directory and environment every block of one file runs in."""
    work, home, bin_dir = tmp / "work", tmp / "home", tmp / "bin"
    for d in (work, home, bin_dir):
        d.mkdir()
    for name in ("examples", "conf.py.example"):
        (work / name).symlink_to(REPO / name)
    shims = {"paddle-cluster": f'exec "{sys.executable}" -m paddle_cluster "$@"',
             "python": f'exec "{sys.executable}" "$@"', "python3": f'exec "{sys.executable}" "$@"'}
    for name, line in shims.items():
        shim = bin_dir / name
        shim.write_text(f"#!/bin/sh\n{line}\n")
        shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PADDLE_", "XDG_")) and k not in ("PYTHONSTARTUP",)}
    return work, checkout_env(env, HOME=str(home), PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
                              PYTHONUNBUFFERED="1")


def _only(code: str, text: str) -> str:
    out = []
    for line in code.splitlines():
        if text in line:
            out.append(" && ".join(part.strip() for part in line.split("&&") if text in part))
    assert out, f"only={text!r} selects nothing"
    return "\n".join(out) + "\n"


def _expectations(block: Block) -> List[str]:
    found = [m.group("text") for line in block.code.splitlines() if (m := EXPECT_COMMENT.search(line))]
    if "expect" in block.opts:
        found.append(block.opts["expect"])
    return found


def run_block(block: Block, work: Path, env: Dict[str, str], n: int) -> Tuple[int, str, float]:
    code = block.code
    if block.lang == "python":
        script = work.parent / f"block{n}.py"
        script.write_text(code)
        argv = [sys.executable, str(script)]
    else:
        if "only" in block.opts:
            code = _only(code, block.opts["only"])
        argv = ["bash", "-e", "-o", "pipefail", "-c", code]
    t0 = time.monotonic()
    try:
        p = subprocess.run(argv, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=BLOCK_TIMEOUT, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace")
        pytest.fail(f"{block.where}: no exit within {BLOCK_TIMEOUT:g} s; output so far:\n{out[-3000:]}")
    return p.returncode, p.stdout.decode(errors="replace"), time.monotonic() - t0


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", _runnable_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_runnable_blocks(path: Path, tmp_path: Path) -> None:
    work, env = _sandbox(tmp_path)
    for n, block in enumerate(b for b in parse_blocks(path) if b.runnable):
        assert block.lang in RUNNABLE_LANGS, f"{block.where}: cannot run a {block.lang or 'plain'} block"
        if "ports" in block.opts:
            busy = _ports_busy(block.opts["ports"])
            if busy:
                pytest.skip(f"{block.where} needs ports {block.opts['ports']} on 127.0.0.1, but {busy} are in use "
                            "(another job or test?)")
        code, out, took = run_block(block, work, env, n)
        assert code == 0, f"{block.where}: exit status {code} after {took:.1f} s; output:\n{out[-4000:]}"
        for text in _expectations(block):  # a quoted number is the printed one, not a prefix of it
            assert re.search(re.escape(text) + (r"(?![\d.])" if text[-1:].isdigit() else ""), out), \
                f"{block.where}: output lacks {text!r}; output:\n{out[-4000:]}"


def test_required_blocks_are_marked() -> None:
    def marked(rel: str, lang: str, needle: str) -> bool:
        return any(b.runnable and b.lang == lang and needle in b.code for b in parse_blocks(REPO / rel))

    assert marked("README.md", "sh", "paddle-cluster run --job_dispatch_package examples/fit_a_line")
    assert marked("docs/quickstart.md", "sh", "paddle-cluster run --job_dispatch_package examples/fit_a_line")
    assert marked("docs/quickstart.md", "sh", "paddle-cluster plot")
    # followed word for word: step 6's workspace and run, step 7's status and logs -f run too
    assert marked("docs/quickstart.md", "sh", "paddle-cluster run --job_dispatch_package ./ws")
    assert marked("docs/quickstart.md", "sh", "paddle-cluster status")
    assert marked("docs/quickstart.md", "sh", "paddle-cluster logs node0 --role trainer -f")
    assert marked("docs/runtime.md", "python", "register_sparse")
    assert marked("docs/checkpoints.md", "python", "PADDLE_RESUME")
    assert marked("docs/backends.md", "sh", "paddle-cluster render k8s")


def test_markers_sit_right_above_a_fence() -> None:
    stray = {str(p.relative_to(REPO)): lines for p in DOCS if (lines := _stray_markers(p))}
    assert not stray, f"doctest markers not directly above a code fence (the block would not run): {stray}"


def test_parser_sees_markers_and_options(tmp_path: Path) -> None:
    md = tmp_path / "x.md"
    md.write_text('text\n\n<!-- doctest: run ports=1-2 only="a b" -->\n```sh\nx && a b\n```\n\n```python\npass\n```\n')
    blocks = parse_blocks(md)
    assert [(b.lang, b.runnable) for b in blocks] == [("sh", True), ("python", False)]
    assert blocks[0].opts == {"ports": "1-2", "only": "a b"}
    assert _only(blocks[0].code, "a b") == "a b\n"


# -- links ---------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?(?P<target>[^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"`[^`\n]*`")


def _prose(path: Path) -> List[Tuple[int, str]]:
    """(line number, text) outside fenced code, with inline code removed."""
    out, fence = [], None
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = FENCE.match(line)
        if m and (fence is None or line.strip().startswith(fence)):
            fence = m.group("fence") if fence is None else None
            continue
        if fence is None:
            out.append((n, INLINE_CODE.sub("", line)))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set:
    seen: Dict[str, int] = {}
    out = set()
    for _, line in _prose(path) if path.suffix == ".md" else []:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        k = seen.get(slug, 0)
        seen[slug] = k + 1
        out.add(slug if k == 0 else f"{slug}-{k}")
    return out


def _links() -> List[Tuple[Path, int, str]]:
    found = []
    for path in DOCS:
        for n, text in _prose(path):
            for m in LINK.finditer(text):
                target = m.group("target")
                if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                found.append((path, n, target))
    return found


def test_relative_links_point_to_existing_files() -> None:
    links = _links()
    assert links, "no links found: the link pattern is broken"
    bad = []
    for path, n, target in links:
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(REPO)}:{n}"
        if not dest.exists():
            bad.append(f"{where}: {target} -> {dest} does not exist")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{where}: {target}: no heading with anchor #{fragment} in {dest.name}")
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_slugs_follow_github() -> None:
    assert _slug("4. Write conf.py") == "4-write-confpy"
    assert _slug("The `ENV` key, and more!") == "the-env-key-and-more"
    assert _slug("Sync and async mode") == "sync-and-async-mode"



def test_architecture_names_every_module_and_only_modules_that_exist() -> None:
    """docs/architecture.md's module tables have a row for every module of paddle_cluster (a row may name a whole
    package directory), every module path it names anywhere (``a/b.py``, ``a/b/``) exists, and the node's
    sub-commands are all listed: the document follows the tree."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    pkg = REPO / "paddle_cluster"
    rows = {t for line in text.splitlines() if line.startswith("| `")
            for t in re.findall(r"`([^`]+)`", line.split("|")[1])}
    modules = sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*.py"))
    missing = [m for m in modules if not any(m == t or (t.endswith("/") and m.startswith(t)) for t in rows)]
    assert not missing, f"docs/architecture.md has no row for: {', '.join(missing)}"
    named = set(re.findall(r"`(?:paddle_cluster/)?((?:\w+/)+\w+\.py|\w+/(?:\w+/)+)`", text)) | rows
    gone = sorted(t for t in named if not (pkg / t).exists() and not (REPO / t).exists()
                  and not list(pkg.rglob(t)))  # a bare name in a package's row: somewhere below
    assert not gone, f"docs/architecture.md names what the tree does not have: {', '.join(gone)}"
    from paddle_cluster.node.__main__ import _parser

    subs = next(a for a in _parser()._actions if a.dest == "cmd").choices
    row = next(line for line in text.splitlines() if line.startswith("| `node/__main__.py`"))
    assert set(subs) | {"pod"} <= set(re.findall(r"`(\w+)`", row)), row
