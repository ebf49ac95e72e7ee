"""The repository's layout stays what README and docs/ describe.

- Every repository path that README.md or a file in docs/ names exists, and every
  `python -m MODULE` they give imports from here: a move that forgets a document
  fails here, not in a newcomer's terminal.
- No two modules of the package import each other, directly or in a circle: each
  layer imports only the ones below it. Imports inside functions count too.
- Every folder of the package that holds modules has a row in README's layout table.
Negative controls: a made-up path is reported missing, a made-up circle is found, and a
table without a folder's row names that folder.
"""

import ast
import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP = ("megatron_async/", "bench/", "tests/", "docs/", "examples/", "docker/", "patches/", ".ci/")
FILES = ("Dockerfile", "Makefile", "setup.py", "constraints.txt")
_PATH = re.compile(r"(?<![\w./-])((?:%s)[\w./-]*|(?:%s))(?![\w/-])" % ("|".join(map(re.escape, TOP)),
                                                                   "|".join(map(re.escape, FILES))))
_MODULE = re.compile(r"-m ((?:megatron_async|bench|tests)(?:\.\w+)+)")
_LINK = re.compile(r"\]\(([^)#\s]+)\)")


def _not_ours(text: str, match: re.Match) -> bool:
    """A name another repository holds (Megatron-LM's), or one the text says was removed."""
    return "Megatron-LM's" in text[max(match.start() - 20, 0):match.start()] or \
        "since removed" in text[match.end():match.end() + 80]


def named_paths(text: str) -> set[str]:
    """Repository paths in a document (placeholders, globs and generated folders left out)."""
    found = set()
    for match in _PATH.finditer(text):
        path = match.group(1).rstrip(".,:;")
        if text[match.end():match.end() + 1] in ("{", "*", "<", "$") or _not_ours(text, match):
            continue
        if not any(c in path for c in "<>*{}$") and "..." not in path:
            found.add(path)
    return found


def missing_paths(document: Path) -> list[str]:
    text = document.read_text(encoding="utf-8")
    missing = [p for p in named_paths(text) if not (REPO / p).exists()]
    missing += [f"-m {m.group(1)}" for m in _MODULE.finditer(text)
                if importlib.util.find_spec(m.group(1)) is None and not _not_ours(text, m)]
    missing += [link for link in _LINK.findall(text)
                if not link.startswith(("http:", "https:")) and not (document.parent / link).exists()]
    return missing


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_a_document_names_exists(document):
    assert missing_paths(document) == []


def test_negative_control_a_made_up_path_is_missing(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("See `megatron_async/weight_stash.py` and run `python -m bench.pipeline_throughput`.\n")
    assert sorted(missing_paths(doc)) == ["-m bench.pipeline_throughput", "megatron_async/weight_stash.py"]


def layout_rows(readme: str) -> set[str]:
    """The paths the first column of README's layout table names."""
    table = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return {path for line in table.splitlines() if line.startswith("| `")
            for path in re.findall(r"`([^`]+)`", line.split(" | ")[0])}


def folders_without_a_row(rows: set[str]) -> list[str]:
    """Package folders holding modules of their own (not only subfolders) that no row names."""
    folders = {f"{p.parent.relative_to(REPO)}/" for p in (REPO / "megatron_async").rglob("*.py")
               if p.name != "__init__.py" and p.parent != REPO / "megatron_async"}
    return sorted(folders - rows)


def test_every_package_folder_has_a_layout_row():
    assert folders_without_a_row(layout_rows((REPO / "README.md").read_text(encoding="utf-8"))) == []


def test_negative_control_a_folder_without_a_row_is_named():
    table = ("\n## Layout\n\n| path | what |\n| --- | --- |\n"
             "| `megatron_async/stash/` | the weight stash |\n\n## Next\n| `megatron_async/pipeline/` | x |\n")
    rows = layout_rows(table)
    assert rows == {"megatron_async/stash/"}
    missing = folders_without_a_row(rows)
    assert "megatron_async/pipeline/" in missing and "megatron_async/megatron_lm/export/" in missing
    assert "megatron_async/stash/" not in missing and "megatron_async/megatron_lm/" not in missing


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the package's modules it imports (anywhere in its code)."""
    modules = {}
    for path in (root / package).rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    deps.add(target)
        graph[name] = deps
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle, as the modules around it, or [] when there is none."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (circle := visit(dep)):
                return circle
        state[node] = "done"
        stack.pop()
        return []

    for node in sorted(graph):
        if node not in state and (circle := visit(node)):
            return circle
    return []


def test_no_import_circles_in_the_package():
    graph = import_graph(REPO, "megatron_async")
    assert len(graph) > 50
    assert find_circle(graph) == []


# Lower layers never import the Megatron-LM adapter (megatron_lm/): it wires them into Megatron's loop.
LOWER_LAYERS = ("megatron_async.corrections", "megatron_async.stash", "megatron_async.schedules")


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((name, dep) for name, deps in graph.items() if name.startswith(LOWER_LAYERS)
                  for dep in deps if dep.startswith("megatron_async.megatron_lm"))


def test_lower_layers_do_not_import_the_megatron_lm_adapter():
    assert upward_imports(import_graph(REPO, "megatron_async")) == []


def test_negative_control_an_upward_import_is_found():
    graph = {"megatron_async.corrections.x": {"megatron_async.megatron_lm.checkpoint.y"}}
    assert upward_imports(graph) == [("megatron_async.corrections.x", "megatron_async.megatron_lm.checkpoint.y")]


def test_negative_control_a_circle_is_found():
    graph = {"a.registry": {"a.builtin"}, "a.builtin": {"a.registry"}, "a.sim": {"a.registry"}}
    assert find_circle(graph) == ["a.builtin", "a.registry", "a.builtin"]



_FILE = re.compile(r"(?<![\w/.-])([A-Za-z_][\w]*\.py)\b")


def _text_of_docs_and_comments(path: Path) -> str:
    """A Python file's docstrings and comments: where its words name other files."""
    import io
    import tokenize

    source = path.read_text(encoding="utf-8")
    parts = [ast.get_docstring(node) or "" for node in ast.walk(ast.parse(source))
             if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    parts += [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
              if tok.type == tokenize.COMMENT]
    return "\n".join(parts)


def _known_file_names() -> set[str]:
    """Every .py file name here, and in the Megatron-Core and torch this checkout runs on
    (docstrings name the Megatron files they hook)."""
    import megatron.core
    import torch

    names = {p.name for p in REPO.rglob("*.py") if ".venv" not in p.parts}
    for package in (Path(megatron.core.__file__).parents[1], Path(torch.__file__).parent):
        names |= {p.name for p in package.rglob("*.py")}
    return names


MEGATRON_LM_SCRIPTS = {"pretrain_gpt.py", "preprocess_data.py"}  # Megatron-LM's, not in megatron-core's wheel


def _exists(name: str) -> bool:
    """A path, or a module path with an attribute after it (tests/support/warm_launch.warm_python)."""
    module = name.split(".")[0]
    return (REPO / name).exists() or (REPO / f"{module}.py").exists()


def stale_names(paths: list[Path], known: set[str]) -> list[str]:
    found = []
    for path in paths:
        text = _text_of_docs_and_comments(path)
        found += [f"{path.relative_to(REPO)}: {p}" for p in named_paths(text) if not _exists(p)]
        found += [f"{path.relative_to(REPO)}: {name}" for name in set(_FILE.findall(text))
                  if name not in known | MEGATRON_LM_SCRIPTS]
    return sorted(found)


def test_every_path_a_docstring_or_comment_names_exists(tmp_path):
    """A file renamed or moved leaves no docstring or comment naming its old name. Control:
    a planted module naming a file that does not exist is reported."""
    known = _known_file_names()
    sources = [p for folder in ("megatron_async", "bench", "tests") for p in sorted((REPO / folder).rglob("*.py"))]
    assert stale_names(sources, known) == []
    planted = REPO / "tests" / f"_planted_{tmp_path.name}.py"
    planted.write_text('"""Reads megatron_async/plan_p2p.py."""\n# see gpu_te_stage.py\n')
    try:
        assert stale_names([planted], known) == [f"tests/{planted.name}: gpu_te_stage.py",
                                                 f"tests/{planted.name}: megatron_async/plan_p2p.py"]
    finally:
        planted.unlink()
