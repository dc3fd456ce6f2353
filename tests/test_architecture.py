"""Layering rules of docs/ARCHITECTURE.md, checked on the source: imports only point down.

Between packages: the table of docs/ARCHITECTURE.md (``FORBIDDEN``): entry points -> method packages (a
method's training code and its recipe hooks) -> ``recipes`` (the one recipe sequence) ->
``fastdecode.training`` -> ``fastdecode``. A method package never imports another. The one way from
``recipes`` up to a method package is the recipe registry ``recipes.RECIPES``: dotted
module names (strings, not imports) that ``recipes.run`` imports by name when a run asks for
that recipe (``test_the_recipe_registry_is_the_only_way_up``). Inside ``fastdecode``: ``RULES``, each one a
bullet of the document's "Rules inside fastdecode" list, word for word, so the two cannot drift apart.
Imports are read from the syntax tree, function-local ones included. "Reaches" follows every import chain
inside ``fastdecode``, package ``__init__`` files included (importing ``a.b.c`` runs ``a`` and ``a.b``).
``fastdecode.training`` (training-only code shared by the method packages) sits between
``recipes`` and the rest of ``fastdecode``: the method packages, the recipes and the entry points
may import it, no other ``fastdecode`` module may.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
# The method packages: every top-level ``<method>_train/`` package (a new one is checked without an edit here).
METHODS = {path.parent.name for path in ROOT.glob("*_train/__init__.py")}
ENTRY = {"fastdecode_cli", "eval", "train", "collect_jacobi"}  # console scripts, eval/, the root scripts
SHARED_TRAINING = "fastdecode.training"
RECIPES = "recipes"
FORBIDDEN = {
    "fastdecode": METHODS | {RECIPES} | ENTRY,
    RECIPES: METHODS | ENTRY,  # below the method packages: RECIPES' dotted names aside (the registry)
    **{package: (METHODS - {package}) | ENTRY for package in METHODS},  # never another method package
}
DYNAMIC_IMPORTS = {"import_module", "__import__", "spec_from_file_location"}  # imports by name
LIBRARY = sorted(FORBIDDEN)  # the importable packages; entry points may import anything below them


@dataclass(frozen=True)
class Rule:
    """``areas`` (fastdecode modules or subpackages, names relative to ``fastdecode``) may import only the
    ``only`` ones directly (when given), and reach none of ``never`` through any chain of imports."""

    text: str  # the bullet in docs/ARCHITECTURE.md
    areas: tuple[str, ...]
    only: tuple[str, ...] | None = None
    never: tuple[str, ...] = ()


ENGINE_RULE = (
    "`runtime.cache` imports only `config`; `runtime.fast_linear` and `runtime.gguf_blocks` nothing from "
    "fastdecode; `runtime.quant_linear` only `runtime.gguf_blocks`; `runtime.weights` only `config`, `files.checkpoint`, "
    "`runtime.fast_linear`, `runtime.gguf_blocks` and `runtime.quant_linear`; `runtime.engine` only `config`, "
    "`runtime.fast_linear` and `runtime.weights`; `runtime.families` only `config`; `runtime.exit_blocks` only "
    "`config`, `runtime.cache` and `runtime.families`; `runtime.engine_build` only `runtime.engine`, "
    "`runtime.fast_linear`, `runtime.families` and `runtime.weights`; `runtime.model` only `config`, "
    "`runtime.model_lock`, `runtime.engine_build` and the engine's other modules."
)
WEIGHTS = ("runtime.gguf_blocks", "runtime.quant_linear", "runtime.weights")
ENGINE = (
    "runtime.cache",
    "runtime.engine",
    "runtime.fast_linear",
    "runtime.families",
    "runtime.exit_blocks",
    *WEIGHTS,
)
# The model seam: the only modules that touch Hugging Face model internals (docs/ARCHITECTURE.md).
MODEL_SEAM = ("runtime.model", "runtime.families", "runtime.engine_build", "runtime.exit_blocks")
# One package per drafter: every ``fastdecode/drafters/<name>/`` (a new one is checked without an edit here).
DRAFTERS = sorted(p.parent.name for p in (ROOT / "fastdecode" / "drafters").glob("*/__init__.py"))
ABOVE_DRAFTERS = ("registry", "api", "data", "training", "reports", "bench")
DRAFTER_RULE = (
    "A drafter package (`drafters.<name>`) reaches no other drafter package, nor `registry`, `api`, `data`, "
    "`training`, `reports` or `bench`."
)
RULES = [
    Rule(
        "`errors`, `config` and `files` (the base) import nothing from fastdecode but each other.",
        areas=("errors", "config", "files"),
        only=("errors", "config", "files"),
    ),
    Rule(
        "`runtime` imports only `config`, `errors`, `files` and itself.",
        areas=("runtime",),
        only=("config", "errors", "files"),
    ),
    *(
        Rule(ENGINE_RULE, areas=(area,), only=only)
        for area, only in {
            "runtime.cache": ("config",),
            "runtime.fast_linear": (),
            "runtime.gguf_blocks": (),
            "runtime.quant_linear": ("runtime.gguf_blocks",),
            "runtime.weights": (
                "config",
                "files",
                "runtime.fast_linear",
                "runtime.gguf_blocks",
                "runtime.quant_linear",
            ),
            "runtime.engine": ("config", "runtime.fast_linear", "runtime.weights"),
            "runtime.families": ("config",),
            "runtime.exit_blocks": ("config", "runtime.cache", "runtime.families"),
            "runtime.engine_build": (
                "runtime.engine",
                "runtime.fast_linear",
                "runtime.families",
                "runtime.weights",
            ),
            "runtime.model": ("config", "runtime.model_lock", "runtime.engine_build", *ENGINE),
        }.items()
    ),
    Rule(
        "`plan.cost`, `plan.cost_store`, `plan.timing` and `plan.acceptance` reach none of `decoding`, "
        "`drafters` and `registry`; `plan.choose` reaches no drafter (it plans from the loop's tables).",
        areas=("plan.cost", "plan.cost_store", "plan.timing", "plan.acceptance"),
        never=("decoding", "drafters", "registry"),
    ),
    Rule(
        "`plan.cost`, `plan.cost_store`, `plan.timing` and `plan.acceptance` reach none of `decoding`, "
        "`drafters` and `registry`; `plan.choose` reaches no drafter (it plans from the loop's tables).",
        areas=("plan.choose",),
        never=("drafters", "registry"),
    ),
    Rule(
        "`jacobi` and `skipdecode` (the concepts training and decoding share) reach none of `decoding`, "
        "`drafters`, `data` and `bench`.",
        areas=("jacobi", "skipdecode"),
        never=("decoding", "drafters", "data", "bench"),
    ),
    Rule(
        "`decoding` (the loop) reaches none of `drafters`, `registry`, `api`, `data`, `training`, `reports`, "
        "`bench`, `runtime.loading`, `runtime.tokenizer`, `files.assets`: it stands on the runtime and the plan.",
        areas=("decoding",),
        never=(
            "drafters",
            "registry",
            "api",
            "data",
            "training",
            "reports",
            "bench",
            "runtime.loading",
            "runtime.tokenizer",
            "files.assets",
        ),
    ),
    *(
        Rule(
            DRAFTER_RULE,
            areas=(f"drafters.{name}",),
            never=(*(f"drafters.{other}" for other in DRAFTERS if other != name), *ABOVE_DRAFTERS),
        )
        for name in DRAFTERS
    ),
    Rule(
        "`data` reaches none of `decoding`, `drafters`, `registry`, `bench`, `runtime.model`, `runtime.cache`: "
        "the data pipeline needs a tokenizer, never a model.",
        areas=("data",),
        never=("decoding", "drafters", "registry", "bench", "runtime.model", "runtime.cache"),
    ),
]
OTHER_RULES = [  # bullets of the same list, checked by the tests below rather than by a Rule
    "`bench` is imported only by `bench` itself and the entry points (`fastdecode_cli`, `eval/`).",
    "No library package imports an entry point (`fastdecode_cli`, `train`, `collect_jacobi`, `eval/`).",
    "No relative imports (`from . import x`): every import names its module in full.",
]


# --------------------------------------------------------------------------------------------------------
# Reading the imports
def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _import_nodes(path: Path) -> list[ast.Import | ast.ImportFrom]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def _imports(path: Path) -> set[str]:
    """Absolute module names ``path`` imports; ``from a import b`` counts ``a.b`` when that is a module."""
    names = set()
    for node in _import_nodes(path):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif node.module and node.level == 0:
            names.add(node.module)
            names.update(
                f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}")
            )
    return names


@functools.cache
def _graph() -> dict[str, set[str]]:
    """fastdecode module -> the fastdecode modules it imports, with the packages each import runs."""
    graph = {}
    for path in _sources("fastdecode"):
        targets = set()
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "fastdecode":
                targets.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
        graph[_module_name(path)] = {t for t in targets if _is_module(t)}
    return graph


def _reach(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for target in _graph().get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen - {module}


def _in(module: str, area: str) -> bool:
    full = f"fastdecode.{area}"
    return module == full or module.startswith(full + ".")


def _members(area: str) -> list[str]:
    members = [m for m in _graph() if _in(m, area)]
    assert members, f"rule about fastdecode.{area}, which does not exist: update RULES and the document"
    return members


# --------------------------------------------------------------------------------------------------------
# Between packages
@pytest.mark.parametrize("package", LIBRARY)
def test_imports_only_point_down(package):
    for path in _sources(package):
        for name in _imports(path):
            top = name.split(".")[0]
            assert top not in FORBIDDEN[package], f"{path.relative_to(ROOT)} imports {name}"


def test_a_method_package_never_imports_another():
    """Each method package holds one method's training side (config, losses, trainer, recipe hooks, report);
    what two of them share goes down, into ``recipes``, ``fastdecode.training`` or ``fastdecode``."""
    assert {"layerskip_train", "cllm_train", "skipdecode_train", "adapter_train"} <= METHODS
    for package in sorted(METHODS):
        for path in _sources(package):
            bad = sorted(n for n in _imports(path) if n.split(".")[0] in METHODS - {package})
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}: a method package never imports another"


def _dotted_strings(path: Path) -> set[str]:
    """String constants of ``path`` that name a module of a method package (``layerskip_train.recipe``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    strings = (n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return {s for s in strings if re.fullmatch(r"\w+(\.\w+)+", s) and s.split(".")[0] in METHODS}


def test_the_recipe_registry_is_the_only_way_up():
    """``recipes.RECIPES`` maps a recipe name to the dotted name of its module (a method package's
    ``recipe`` module, or ``recipes.sft``); ``run`` imports it by that name. No other module of
    ``recipes`` imports by name or names a method package's module."""
    import recipes

    for name, module in recipes.RECIPES.items():
        package, _, rest = module.partition(".")
        assert package in METHODS | {RECIPES}, f"recipe {name}: {module} is in no method package"
        assert package == RECIPES or rest == "recipe", f"recipe {name}: {module} is not {package}.recipe"
        path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
        tree = ast.parse(path.read_text(), filename=str(path))
        assert any(isinstance(n, ast.FunctionDef) and n.name == "run" for n in tree.body), f"{module}.run"
    registry = ROOT / RECIPES / "__init__.py"
    assert _dotted_strings(registry) == {m for m in recipes.RECIPES.values() if not m.startswith(RECIPES)}
    for path in _sources(RECIPES):
        if path == registry:
            continue
        calls = [
            n.lineno
            for n in ast.walk(ast.parse(path.read_text(), filename=str(path)))
            if isinstance(n, ast.Call)
            and getattr(n.func, "attr", getattr(n.func, "id", "")) in DYNAMIC_IMPORTS
        ]
        assert not calls, f"{path.relative_to(ROOT)} line(s) {calls} import by name: only the registry may"
        assert not _dotted_strings(path), f"{path.relative_to(ROOT)} names {_dotted_strings(path)}"


def _imports_shared_training(name: str) -> bool:
    return name == SHARED_TRAINING or name.startswith(SHARED_TRAINING + ".")


def test_fastdecode_core_never_imports_the_training_layer():
    """Only ``fastdecode/training/`` itself; the model, data, decoders and reports stay Trainer-free."""
    training_dir = ROOT / "fastdecode" / "training"
    for path in _sources("fastdecode"):
        if training_dir in path.parents:
            continue
        bad = sorted(n for n in _imports(path) if _imports_shared_training(n))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}: fastdecode.training is for training code"


def test_the_training_layer_imports_only_fastdecode_core():
    """``fastdecode.training`` is below the method packages: it imports none of them (nor anything above)."""
    above = METHODS | {RECIPES} | ENTRY
    for path in (ROOT / "fastdecode" / "training").rglob("*.py"):
        bad = sorted(n for n in _imports(path) if n.split(".")[0] in above)
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_only_the_model_seam_imports_hf_modeling_code():
    """HF model internals (transformers.models.*) are touched by the model seam alone (``MODEL_SEAM``)."""
    allowed = {ROOT.joinpath("fastdecode", *name.split(".")).with_suffix(".py") for name in MODEL_SEAM}
    for package in FORBIDDEN:
        for path in _sources(package):
            if path in allowed:
                continue
            bad = [n for n in _imports(path) if n.startswith("transformers.models")]
            assert not bad, (
                f"{path.relative_to(ROOT)} imports {bad}: go through the model seam (fastdecode/runtime/model.py)"
            )


# --------------------------------------------------------------------------------------------------------
# Inside fastdecode
@pytest.mark.parametrize("rule", RULES, ids=lambda r: "+".join(r.areas))
def test_rules_inside_fastdecode(rule):
    for area in rule.areas:
        for module in _members(area):
            if rule.only is not None:
                outside = {t for t in _graph()[module] if not _in(t, area) and not module.startswith(f"{t}.")}
                allowed = {t for t in outside if any(_in(t, a) for a in rule.only)}
                assert outside == allowed, f"{module} imports {sorted(outside - allowed)}: {rule.text}"
            reached = [t for t in _reach(module) for bad in rule.never if _in(t, bad)]
            assert not reached, f"{module} reaches {sorted(reached)}: {rule.text}"


def test_only_entry_points_import_the_benchmark():
    for package in LIBRARY:
        for path in _sources(package):
            if _module_name(path).startswith("fastdecode.bench"):
                continue
            bad = [n for n in _imports(path) if n == "fastdecode.bench" or n.startswith("fastdecode.bench.")]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}: {OTHER_RULES[0]}"


def test_no_relative_imports():
    roots = [*LIBRARY, *sorted(ENTRY - {"train", "collect_jacobi"}), "tests"]
    paths = [p for root in roots for p in _sources(root)] + sorted(ROOT.glob("*.py"))
    assert paths
    for path in paths:
        relative = [node.lineno for node in _import_nodes(path) if getattr(node, "level", 0) > 0]
        assert not relative, f"{path.relative_to(ROOT)} line(s) {relative}: {OTHER_RULES[2]}"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_private_names_imported_from_another_module():
    """A name another module needs is public: no ``from ours import _helper`` (nor ``import ours._module``)
    anywhere in the library packages, the entry points or the tests."""
    ours = {*LIBRARY, *ENTRY, "tests"}
    roots = [*LIBRARY, *sorted(ENTRY - {"train", "collect_jacobi"}), "tests"]
    paths = [p for root in roots for p in _sources(root)] + sorted(ROOT.glob("*.py"))
    bad = []
    for path in paths:
        for node in _import_nodes(path):
            if isinstance(node, ast.ImportFrom):
                if node.level or (node.module or "").split(".")[0] not in ours:
                    continue
                dotted = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                dotted = [alias.name for alias in node.names if alias.name.split(".")[0] in ours]
            bad += [
                f"{path.relative_to(ROOT)}:{node.lineno} imports {name}"
                for name in dotted
                if any(_private(part) for part in name.split("."))
            ]
    assert not bad, "private names imported from another module (make them public):\n" + "\n".join(bad)


def _console_scripts() -> dict[str, str]:
    """``[project.scripts]`` of pyproject.toml: script name -> ``module:function``."""
    section = (ROOT / "pyproject.toml").read_text().split("[project.scripts]\n")[1].split("\n[")[0]
    pairs = [line.split("=", 1) for line in section.splitlines() if "=" in line]
    return {name.strip(): target.strip().strip('"') for name, target in pairs}


def test_every_command_is_a_console_script_and_a_thin_file():
    """One kind of entry point: the root scripts and ``eval/*.py`` define nothing, they import the ``main`` of
    a console script's module (``fastdecode_cli``); the programs live in the packages."""
    scripts = _console_scripts()
    modules = {target.split(":")[0] for target in scripts.values()}
    assert all(m.startswith("fastdecode_cli.") and _is_module(m) for m in modules), scripts
    files = [ROOT / "train.py", ROOT / "collect_jacobi.py", *sorted((ROOT / "eval").glob("*.py"))]
    for path in [p for p in files if p.name != "__init__.py"]:
        tree = ast.parse(path.read_text(), filename=str(path))
        defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        assert not defined, (
            f"{path.relative_to(ROOT)} defines {defined}: move the program into fastdecode_cli"
        )
        called = {n.module for n in _import_nodes(path) if isinstance(n, ast.ImportFrom) and n.module}
        assert called & modules, f"{path.relative_to(ROOT)} calls no console script's module"


def test_public_functions_take_at_most_five_positional_parameters():
    """Past the fifth, parameters are keyword-only (methods: not counting ``self``/``cls``)."""
    wide = []
    for package in [*LIBRARY, *sorted(ENTRY - {"train", "collect_jacobi"})]:
        for path in _sources(package):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                    continue
                args = node.args.posonlyargs + node.args.args
                positional = [a.arg for a in args if a.arg not in ("self", "cls")]
                where = f"{path.relative_to(ROOT).as_posix()}:{node.name}"
                if len(positional) > 5:
                    wide.append(f"{where} (line {node.lineno}): {len(positional)} positional")
    assert not wide, "make the parameters past the fifth keyword-only (add *):\n" + "\n".join(wide)


MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60  # from the ``def`` line to the last line of the body (its docstring counts)


def test_no_module_over_400_lines_nor_function_over_60():
    """Library packages, entry points and the root scripts: a module that grows past 400 lines splits into
    cohesive modules, a function past 60 lines into named helpers."""
    roots = [*LIBRARY, *sorted(ENTRY - {"train", "collect_jacobi"})]
    paths = [p for root in roots for p in _sources(root)] + sorted(ROOT.glob("*.py"))
    big = []
    for path in paths:
        text = path.read_text()
        where = path.relative_to(ROOT).as_posix()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            big.append(f"{where}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    big.append(f"{where}:{node.lineno} {node.name}: {length} lines")
    assert not big, f"modules > {MAX_MODULE_LINES} or functions > {MAX_FUNCTION_LINES} lines:\n" + "\n".join(
        big
    )


def test_the_rules_graph_sees_real_imports():
    """Guards the checker itself: known edges are found (a parser bug would pass every rule vacuously)."""
    assert "fastdecode.runtime.cache" in _graph()["fastdecode.runtime.model"]
    assert "fastdecode.decoding.speculative" in _graph()["fastdecode.decoding.kinds"]
    assert {"fastdecode.decoding", "fastdecode.runtime.model"} <= _reach("fastdecode.reports.skipdecode")


# --------------------------------------------------------------------------------------------------------
# The document matches
def _section(title: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_the_document_lists_every_rule():
    rules = _section("Rules inside fastdecode")
    bullets = {line[2:].strip() for line in rules.splitlines() if line.startswith("- ")}
    expected = {rule.text for rule in RULES} | set(OTHER_RULES)
    assert bullets == expected, f"docs/ARCHITECTURE.md differs: {sorted(bullets ^ expected)}"


def _packages() -> list[Path]:
    """``fastdecode`` and every package inside it."""
    root = ROOT / "fastdecode"
    return [root, *sorted(p.parent for p in root.rglob("*/__init__.py"))]


@pytest.mark.parametrize("package", _packages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_document_has_one_row_per_module_of_each_package(package):
    """Each package of ``fastdecode`` has its section, ``## fastdecode/<package>/``, with one row per module
    and per subpackage."""
    rows = re.findall(r"^\| `([^`]+)` \|", _section(f"{package.relative_to(ROOT).as_posix()}/"), flags=re.M)
    modules = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    modules |= {f"{p.parent.name}/" for p in package.glob("*/__init__.py")}
    assert len(rows) == len(set(rows)), f"a module has two rows: {rows}"
    assert set(rows) == modules, (
        f"rows without a module: {set(rows) - modules}; modules without: {modules - set(rows)}"
    )


MAX_ROOT_MODULES = 10  # the public surface and the few modules every layer shares
MAX_DOCSTRING_LINES = 8  # what the module is for and what it owns; derivations go to docs/design/


def test_the_root_of_fastdecode_holds_the_public_surface_only():
    root = sorted(p.name for p in (ROOT / "fastdecode").glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at the root of fastdecode/: {root}"


def test_module_docstrings_are_short():
    """A module docstring says what the module is for and what it owns in at most 8 lines."""
    roots = [*LIBRARY, *sorted(ENTRY - {"train", "collect_jacobi"})]
    long = []
    for path in [p for root in roots for p in _sources(root)] + sorted(ROOT.glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(), filename=str(path)), clean=False) or ""
        if len(doc.splitlines()) > MAX_DOCSTRING_LINES:
            long.append(f"{path.relative_to(ROOT).as_posix()}: {len(doc.splitlines())} lines")
    assert not long, "module docstrings over 8 lines (move the rest to docs/design/):\n" + "\n".join(long)


# Who may name a drafter package outside it: the registry, the drafter's training package, and its commands.
NAMED_BY = {
    "eagle3": {"fastdecode.registry", "fastdecode_cli.eagle3_check"},
    "suffix": {"fastdecode.registry", "fastdecode_cli.suffix_index"},
    "lookup": {"fastdecode.registry", "fastdecode.bench.lookup_answers", "fastdecode.bench.lookup_replay"},
}


@pytest.mark.parametrize("drafter", sorted(NAMED_BY))
def test_a_drafter_lives_in_its_package(drafter):
    """Outside the tests, a drafter's code is its package, its training package (``<name>_train``) and at most
    3 registry or entry-point modules that import it (``NAMED_BY``): a newcomer finds it in one folder."""
    package = f"fastdecode.drafters.{drafter}"
    importers = set()
    for root in [*LIBRARY, *sorted(ENTRY - {"train", "collect_jacobi"})]:
        for path in _sources(root):
            module = _module_name(path)
            if module == package or module.startswith(package + ".") or root == f"{drafter}_train":
                continue
            if any(n == package or n.startswith(package + ".") for n in _imports(path)):
                importers.add(module)
    assert importers == NAMED_BY[drafter] and len(importers) <= 3, sorted(importers)
