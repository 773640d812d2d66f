"""The repository holds what is true now: results the docs cite, paths that
exist, a README a user reads top to bottom, no narration of past work."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest

from vllm_selfspec.assets import ROOT

pytestmark = pytest.mark.engine_free

# Work dated by session: an ordinal, "this" or "last" before the word, or a number after it.
ORDINAL = (r"(\d+(st|nd|rd|th)|first|second|third|\w*(fourth|fifth|sixth|seventh|eighth|ninth"
           r"|tenth|eleventh|twelfth|teenth|ieth))")
SESSION_WORDS = re.compile(rf"\b({ORDINAL}|this|last|next|previous|earlier)[- ]sessions?\b"
                           r"|\bsessions? \d+\b", re.IGNORECASE)
# A repository path cited in prose or a comment.
CITED_PATH = re.compile(r"(?<![\w./-])((?:docs|results|scripts|tests|vllm_selfspec|configs)"
                        r"/[\w./+-]*\w)")


def tracked(*patterns: str) -> list[str]:
    return subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.split()


def text_of(paths: list[str]) -> str:
    return "\n".join((ROOT / path).read_text() for path in paths)


def docs() -> list[str]:
    return ["README.md", *tracked("docs/*.md")]


def test_every_committed_result_is_cited_by_a_page():
    """results/ keeps only what README or docs/ cite (by file name, or by the
    stem a command's `--name` gives it); git keeps the rest."""
    prose = text_of(docs())
    uncited = [path for path in tracked("results/")
               if not re.search(re.escape(path.rsplit("/", 1)[1].rsplit(".", 1)[0])
                                + r"(?![\w-])", prose)]
    assert not uncited, f"results no page cites (delete them or cite them): {uncited}"


def test_every_run_a_page_names_has_its_result_committed():
    """A command a page quotes with `--name NAME` wrote results/NAME.*: the
    figures the page takes from it can be checked."""
    names = set(re.findall(r"--name ([\w.+-]+)", text_of(docs())))
    committed = {path.rsplit("/", 1)[1].rsplit(".", 1)[0] for path in tracked("results/")}
    assert names, "no page quotes a run's command"
    assert not names - committed, sorted(names - committed)


def test_results_pages_open_with_the_tables_their_result_files_give():
    """The run tables of docs/results/ are what `scripts/results_pages.py`
    writes from the committed result files (provenance and headline figures)."""
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "results_pages.py"),
                             "--check"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert all("<!-- runs: " in (ROOT / page).read_text() for page in tracked("docs/results/*.md")
               if not page.endswith("README.md"))


def test_pages_cite_results_by_whole_names():
    """A result cited by a fragment (`-sets.png`, `{a,b}.json`) is a name
    neither a reader nor the checks above can find."""
    fragment = re.compile(r"`-[\w.-]+\.(?:png|json)`|\{[\w,.-]*\}\.(?:json|png|\*)")
    found = [f"{path}: {match.group(0)}" for path in docs()
             for match in fragment.finditer((ROOT / path).read_text())]
    assert not found, found


def test_every_path_the_repository_cites_exists():
    """Docs, code and comments cite files that are there (`results/` files are
    written by a run, so only committed ones are checked when a doc cites
    one by name with its extension)."""
    files = [p for p in tracked("*.md", "*.py", "*.sh", "*.toml") if not p.startswith("results/")]
    missing = set()
    for path in files:
        for cited in CITED_PATH.findall((ROOT / path).read_text()):
            cited = cited.rstrip(".")
            if "<" in cited or "*" in cited or cited.endswith("/"):
                continue
            here = (ROOT / path).parent  # a link relative to the citing file
            if (not (ROOT / cited).exists() and not (here / cited).exists()
                    and "." in cited.rsplit("/", 1)[1]):
                missing.add(f"{path}: {cited}")
    assert not missing, "\n".join(sorted(missing))


def test_no_file_narrates_work_by_session():
    files = [p for p in tracked("*.md", "*.py", "*.sh") if not p.startswith("results/")]
    found = [f"{path}: {match.group(0)}" for path in files
             for match in SESSION_WORDS.finditer((ROOT / path).read_text())]
    assert not found, found


def test_the_readme_is_a_guide_of_at_most_two_hundred_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)


def package_imports() -> dict[str, set[str]]:
    """Each module of the plugin and the plugin modules it imports anywhere
    in its body (lazy imports inside functions count: they are how a cycle
    hides)."""
    package = ROOT / "vllm_selfspec"
    modules = {}
    for path in package.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names
                             if f"{node.module}.{alias.name}" in modules)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name in modules)
        graph[name] = found - {name, "vllm_selfspec"}
    return graph


def test_the_plugins_modules_import_each_other_without_a_cycle():
    graph = package_imports()
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for imported in sorted(graph[module]):
            assert state.get(imported) != "open", " -> ".join(
                [*path[path.index(imported):], imported] if imported in path
                else [*path, imported])
            if imported not in state:
                visit(imported, [*path, imported])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    # config is the bottom layer: of the plugin it imports where assets live, nothing else.
    assert graph["vllm_selfspec.config"] == {"vllm_selfspec.assets"}


def test_docs_cite_the_plugins_code_by_symbol_not_by_line():
    """Line numbers of our own code move with every change, so a doc names the
    function or class; vLLM 0.32.0's files are fixed and may be cited by line
    (`v1/worker/gpu_model_runner.py:5070`, `cpu_attn.py:120`)."""
    package = ROOT / "vllm_selfspec"
    ours = {path.name for path in package.rglob("*.py")}
    cited = re.compile(r"(?<![\w/.])((?:\w+/)*(\w+\.py)):\d+")
    found = [f"{doc}: {match.group(0)}" for doc in docs()
             for match in cited.finditer((ROOT / doc).read_text())
             if (package / match.group(1).removeprefix("vllm_selfspec/")).exists()
             or ("/" not in match.group(1) and match.group(2) in ours)]
    assert not found, found
