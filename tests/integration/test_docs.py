"""Every code example in the documentation runs: the Markdown pages and the docstrings.

Markdown (``README.md`` and ``docs/**/*.md``), one test per fenced block, named
``<file>::block<N>:L<line>`` so that a failure points at the block:

* a ```` ```python ```` block is **executed, standalone**: in a fresh module namespace, in a
  fresh temporary working directory, sharing nothing with the other blocks of its page. A
  block must therefore carry its own imports and data; a reader can copy any one block and
  run it.
* a ```` ```python ```` block that imports a peer library of the optional ``peers`` extra
  (``torch``, ``jmp``) is skipped, with a reason, when that library is not installed.
* a ```` ```py ```` block is shown, highlighted like Python, and **not executed**: it is for
  code of other libraries that cannot run here (DeepSpeed, Megatron-LM, Keras, Cerebras).
  It must not use jdls; jdls code goes in ```` ```python ````, where it runs.
* ``<!-- skip-test -->`` on the line before a ```` ```python ```` fence opts that one block
  out. Use it sparingly and say why next to it.

Docstrings: the doctests of every module of the ``jdls`` package run too, one test per module.
"""

from __future__ import annotations

import ast
import dataclasses
import doctest
import importlib
import importlib.util
import linecache
import pkgutil
import re
import sys
import types
from pathlib import Path

import pytest
from _helpers import ROOT

import jdls

DOCS = ROOT / "docs"

#: Optional libraries (the ``peers`` extra): a block importing one is skipped without it.
OPTIONAL_MODULES = frozenset({"torch", "jmp", "equinox"})
SKIP_MARKER = "<!-- skip-test -->"
RUN_LANGUAGE = "python"
SHOW_ONLY_LANGUAGE = "py"

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*)$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file."""

    path: Path
    index: int  # 0-based, among all fenced blocks of the file
    line: int  # 1-based line of the opening fence
    language: str
    source: str
    skip: bool

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}::block{self.index}:L{self.line}"


def markdown_files() -> list[Path]:
    """README.md and every page under docs/, in a stable order."""
    files = sorted(DOCS.rglob("*.md"))
    readme = ROOT / "README.md"
    return ([readme] if readme.exists() else []) + files


def extract_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of one Markdown file (fences may be indented, e.g. in tabs)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, info = match["indent"], match["fence"], match["info"].strip()
        language = info.split()[0].lower() if info else ""
        previous = next((s.strip() for s in reversed(lines[:i]) if s.strip()), "")
        body: list[str] = []
        j = i + 1
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        while j < len(lines) and not closing.match(lines[j]):
            line = lines[j]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            j += 1
        if j == len(lines):
            raise ValueError(f"{path}:{i + 1}: code fence {fence!r} is never closed")
        blocks.append(
            Block(
                path=path,
                index=len(blocks),
                line=i + 1,
                language=language,
                source="\n".join(body) + "\n",
                skip=previous == SKIP_MARKER,
            )
        )
        i = j + 1
    return blocks


ALL_BLOCKS = [b for p in markdown_files() for b in extract_blocks(p)]
RUN_BLOCKS = [b for b in ALL_BLOCKS if b.language == RUN_LANGUAGE]
SHOW_ONLY_BLOCKS = [b for b in ALL_BLOCKS if b.language == SHOW_ONLY_LANGUAGE]


def _imported_top_modules(source: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


#: The pages whose blocks the quick run executes, a reader's first steps; the full suite runs
#: every page's (docs/contributing.md, "Run the tests").
QUICK_PAGES = frozenset(
    {"README.md", "docs/index.md", "docs/getting-started.md", "docs/concepts.md"}
)


def _block_param(block: Block) -> object:
    quick = block.path.relative_to(ROOT).as_posix() in QUICK_PAGES
    return pytest.param(block, id=block.id, marks=() if quick else pytest.mark.full)


@pytest.mark.parametrize("block", [_block_param(b) for b in RUN_BLOCKS])
def test_python_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ```python block of the docs runs, standalone, without error."""
    if block.skip:
        pytest.skip(f"marked {SKIP_MARKER}")
    filename = f"<{block.id}>"
    linecache.cache[filename] = (len(block.source), None, block.source.splitlines(True), filename)
    code = compile(block.source, filename, "exec")  # a SyntaxError fails here, precisely
    missing = sorted(
        name
        for name in _imported_top_modules(block.source) & OPTIONAL_MODULES
        if importlib.util.find_spec(name) is None
    )
    if missing:
        pytest.skip(f"needs the optional libraries {missing} (pip install -e '.[test,peers]')")
    monkeypatch.chdir(tmp_path)
    module = types.ModuleType(f"docs_block_{block.index}")
    module.__file__ = str(tmp_path / "block.py")
    monkeypatch.setitem(sys.modules, module.__name__, module)  # dataclasses look it up
    exec(code, module.__dict__)


@pytest.mark.parametrize("block", SHOW_ONLY_BLOCKS, ids=[b.id for b in SHOW_ONLY_BLOCKS])
def test_show_only_block_holds_no_jdls_code(block: Block) -> None:
    """A ```py block is not executed, so it must not hide a jdls example."""
    assert not re.search(r"\bjdls\b", block.source), (
        f"{block.id}: a ```py block is not executed; jdls code belongs in a ```python block, "
        "where the docs tests run it"
    )


def test_blocks_were_found() -> None:
    """The extractor sees the pages (a broken glob would make every other test vanish)."""
    assert (DOCS / "index.md").exists()
    assert len(RUN_BLOCKS) >= 10, [b.id for b in RUN_BLOCKS]


def test_skip_markers_precede_python_blocks() -> None:
    """A stray ``<!-- skip-test -->`` (not followed by a ```python fence) is a mistake."""
    for path in markdown_files():
        lines = path.read_text(encoding="utf-8").splitlines()
        for n, line in enumerate(lines):
            if line.strip() != SKIP_MARKER:
                continue
            following = next((s.strip() for s in lines[n + 1 :] if s.strip()), "")
            assert re.match(r"^(`{3,}|~{3,})\s*python\b", following), (
                f"{path.relative_to(ROOT)}:{n + 1}: {SKIP_MARKER} must come right before a "
                "```python fence"
            )


# ------------------------------------------------------------------------------------------
# The site's navigation lists exactly the pages that exist.
# ------------------------------------------------------------------------------------------


def _nav_files(node: object) -> list[str]:
    if isinstance(node, str):
        return [node] if node.endswith(".md") else []
    if isinstance(node, list):
        return [f for item in node for f in _nav_files(item)]
    if isinstance(node, dict):
        return [f for value in node.values() for f in _nav_files(value)]
    return []


def test_nav_matches_pages() -> None:
    """Every page in mkdocs.yml's nav exists, and every page under docs/ is in the nav."""
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    in_nav = _nav_files(config["nav"])
    present = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    listed_but_missing = [f for f in in_nav if f not in present]
    assert not listed_but_missing, f"mkdocs.yml's nav lists missing pages: {listed_but_missing}"
    not_listed = sorted(present - set(in_nav))
    assert not not_listed, f"pages under docs/ missing from mkdocs.yml's nav: {not_listed}"
    assert len(in_nav) == len(set(in_nav)), "a page is listed twice in the nav"


def test_api_page_lists_every_public_name() -> None:
    """docs/api.md has a ``::: jdls.<name>`` entry for every name of ``jdls.__all__``."""
    text = (DOCS / "api.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^::: jdls\.(\w+)\s*$", text, flags=re.MULTILINE))
    assert not sorted(set(jdls.__all__) - listed), "names missing from docs/api.md"
    assert not sorted(listed - set(jdls.__all__)), "docs/api.md lists names not in jdls.__all__"


# ------------------------------------------------------------------------------------------
# Tests the docs cite as evidence exist.
# ------------------------------------------------------------------------------------------

_TEST_REFERENCE = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`")


def test_cited_tests_exist() -> None:
    """Every `tests/file.py` or `tests/file.py::test_name` the docs cite exists."""
    missing = []
    for path in markdown_files():
        for match in _TEST_REFERENCE.finditer(path.read_text(encoding="utf-8")):
            file, name = ROOT / match[1], match[2]
            where = f"{path.relative_to(ROOT)}: {match[0]}"
            defined = file.exists() and (
                not name or re.search(rf"\bdef {name}\b", file.read_text(encoding="utf-8"))
            )
            if not defined:
                missing.append(where)
    assert not missing, "the docs cite tests that do not exist:\n" + "\n".join(missing)


# ------------------------------------------------------------------------------------------
# The float-format table of docs/concepts.md is true.
# ------------------------------------------------------------------------------------------


def _format_table_rows() -> list[list[str]]:
    text = (DOCS / "concepts.md").read_text(encoding="utf-8")
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0].startswith(("float", "bfloat", "cbfloat")):
            rows.append(cells)
    return rows


def _code_value(cell: str) -> float:
    """The number written as code in a cell (``2**-24``), evaluated exactly."""
    match = re.search(r"`([^`]+)`", cell)
    assert match, cell
    assert re.fullmatch(r"[0-9*+\-()./ ]+", match[1]), cell  # arithmetic only
    return float(eval(match[1], {"__builtins__": {}}))


def _approx_ok(cell: str, value: float) -> None:
    """A decimal in parentheses, if any, is the value to two significant digits."""
    match = re.search(r"\(([0-9.e+\-]+)\)\s*$", cell)
    if match:
        assert float(f"{value:.1e}") == float(match[1]), (cell, value)


def test_concepts_float_table() -> None:
    """Every number of the float-format table is what ml_dtypes (or jdls, for cbfloat16) says."""
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    rows = _format_table_rows()
    assert {r[0] for r in rows} >= {"float32", "float16", "bfloat16", "cbfloat16"}
    for name, bits, largest, normal, subnormal, eps, has_inf in rows:
        if name == "cbfloat16":
            info = jdls.finfo("cbfloat16")
            inf_kept = bool(jnp.isinf(jdls.cbfloat16.round(jnp.float32(jnp.inf))))
            # The reference reading: bias 31, IEEE-style specials and subnormals.
            assert float(info.max) == (2 - 2**-9) * 2.0**31
            assert float(info.smallest_normal) == 2.0**-30
            assert float(info.smallest_subnormal) == 2.0**-39
            assert float(info.eps) == 2.0**-9
        else:
            dtype = np.dtype(getattr(ml_dtypes, name, None) or name)
            info = ml_dtypes.finfo(dtype)
            with np.errstate(over="ignore", invalid="ignore"):
                inf_kept = bool(np.isinf(np.array(np.inf, np.float32).astype(dtype)))
        expected_bits = f"1 / {info.nexp} / {info.nmant}"
        assert bits == expected_bits, (name, bits, expected_bits)
        for cell, value in [
            (largest, info.max),
            (normal, info.smallest_normal),
            (subnormal, info.smallest_subnormal),
            (eps, info.eps),
        ]:
            assert _code_value(cell) == float(value), (name, cell, float(value))
            _approx_ok(cell, float(value))
        assert has_inf == ("yes" if inf_kept else "no"), (name, has_inf)


# ------------------------------------------------------------------------------------------
# No transformation after the wrap: it would run on skipped steps too.
# ------------------------------------------------------------------------------------------

_CHAIN = re.compile(r"\b(?:named_)?chain\(")
_WRAP = re.compile(r"\b(?:jdls\.)?(?:presets\.)?(?:cerebras_)?wrap\(")

#: Chains with a transformation after a wrap that a page shows on purpose, and why.
AFTER_THE_WRAP_ALLOWED = {
    ("docs/reliability.md", "chain(jdls.wrap(a), jdls.wrap(b))"): "the error get_scale raises",
}


def _closing(text: str, start: int) -> int | None:
    """The index of the bracket closing the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return None


def _arguments(inner: str) -> list[str]:
    """The top-level, comma-separated arguments of a call's bracketed text."""
    args, depth, current = [], 0, []
    for c in inner:
        depth += (c in "([{") - (c in ")]}")
        if c == "," and depth == 0:
            args.append("".join(current).strip())
            current = []
        else:
            current.append(c)
    args.append("".join(current).strip())
    return [a for a in args if a]


def chains_after_the_wrap(text: str) -> list[str]:
    """Every ``chain(...)`` / ``named_chain(...)`` in ``text`` (code, prose, tables) with an
    argument after one holding a ``jdls.wrap``, other than ``...``."""
    found = []
    for match in _CHAIN.finditer(text):
        close = _closing(text, match.end() - 1)
        if close is None:
            continue
        args = _arguments(text[match.end() : close])
        wraps = [i for i, a in enumerate(args) if _WRAP.search(a)]
        if wraps and any(a not in ("...", "\u2026") for a in args[wraps[0] + 1 :]):
            found.append(" ".join(text[match.start() : close + 1].split()))
    return found


def test_chains_after_the_wrap_are_recognised() -> None:
    assert chains_after_the_wrap(
        "`optax.chain(jdls.wrap(optax.scale_by_adam()), optax.add_decayed_weights(wd), "
        "optax.scale(-lr))`"
    ) == [
        "chain(jdls.wrap(optax.scale_by_adam()), optax.add_decayed_weights(wd), optax.scale(-lr))"
    ]
    assert chains_after_the_wrap("optax.named_chain(('w', jdls.wrap(adam)), ('s', s))")
    for fine in (
        "optax.chain(jdls.clip(1.0), jdls.wrap(optax.adam(1e-3)))",
        "jdls.wrap(optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(wd)))",
        "`optax.chain(jdls.wrap(inner), ...)`",
        "optax.chain(\n    jdls.clip(1.0),\n    jdls.wrap(optax.adam(1e-3)),\n)",
    ):
        assert chains_after_the_wrap(fine) == [], fine


def test_no_page_or_example_chains_a_transformation_after_the_wrap() -> None:
    """A transformation after ``jdls.wrap`` in an ``optax.chain`` runs on skipped steps too
    (a weight decay there shrinks the parameters of a skipped step): the README, the pages,
    the examples and the docstrings put the whole optimizer inside the wrap."""
    files = [
        *markdown_files(),
        *sorted((ROOT / "examples").rglob("*.py")),
        *sorted((ROOT / "jdls").rglob("*.py")),
    ]
    found = [
        f"{path.relative_to(ROOT).as_posix()}: {chain}"
        for path in files
        for chain in chains_after_the_wrap(path.read_text(encoding="utf-8"))
        if (path.relative_to(ROOT).as_posix(), chain) not in AFTER_THE_WRAP_ALLOWED
    ]
    assert not found, "\n".join(found)


# ------------------------------------------------------------------------------------------
# Doctests of the package.
# ------------------------------------------------------------------------------------------


def _package_modules() -> list[str]:
    names = [jdls.__name__]
    for info in pkgutil.walk_packages(jdls.__path__, prefix=f"{jdls.__name__}."):
        names.append(info.name)
    return sorted(names)


#: The modules whose doctests the quick run executes: the train step's own (the scales, their
#: rules and presets, the wrap, clipping, the statistics); the full suite runs every module's.
QUICK_DOCTESTS = (
    "jdls._scales.scale",
    "jdls._transforms.wrap",
    "jdls._transforms.clip",
    "jdls._transforms.stats",
    "jdls.rules",
    "jdls.presets",
)


def _doctest_param(name: str) -> object:
    quick = name == "jdls" or name.startswith(QUICK_DOCTESTS)
    return pytest.param(name, id=name, marks=() if quick else pytest.mark.full)


@pytest.mark.parametrize("module_name", [_doctest_param(n) for n in _package_modules()])
def test_doctests(module_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``>>>`` examples in the docstrings of one module of jdls pass."""
    monkeypatch.chdir(tmp_path)
    if module_name in ("jdls.equinox", "jdls._frameworks.equinox_sites"):
        pytest.importorskip("equinox")
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    report: list[str] = []
    for test in finder.find(module, module_name, globs={}):
        runner.run(test, out=report.append)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, "".join(report)
