"""The package's layers, read from its imports with ``ast``: data flows one way, face -> phases
-> state -> engine -> the options against the job -> comm -> kernels / transport -> the options
(config.py) -> base, and no module imports one above it. The tooling (``hvd_onebit_tools``) sits above the library: it imports the library, never the
reverse, and the library imports none of the tooling's dependencies. The sizes the house keeps
are checked here too."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "hvd_onebit"
TOOLS = PACKAGE.parent / "hvd_onebit_tools"
# What only the tooling may import: the library runs in a user's training environment.
TOOLING_ONLY = ("hvd_onebit_tools", "click", "matplotlib")

# Top to bottom. A module belongs to the first layer with a prefix of its dotted name (relative
# to the package); it may import modules of its own layer and of the layers below it.
LAYERS = [
    ("face", ["__init__", "optimizer", "elastic", "face", "ddp"]),
    ("phases", ["phases", "overlap"]),
    ("state", ["state", "auto_freeze"]),
    ("engine", ["engine"]),
    ("the options against the job", ["job"]),
    ("comm", ["comm"]),
    ("kernels and transport", ["kernels", "transport"]),
    ("options", ["config"]),
    ("base", ["layout", "step_bound", "low_precision", "consistency", "horovod_view", "dtypes",
              "variance_refresh", "param_groups", "values", "optimizer_view", "stall", "eager",
              "_C"]),
]
MAX_LINES = 400  # per library module (the C++ aside)
FACE_MAX_LINES = 300


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(name: str) -> int:
    for level, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if name == prefix or name.startswith(prefix + "."):
                return level
    raise AssertionError(f"module hvd_onebit.{name} belongs to no layer: add it to LAYERS")


def imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, dotted name relative to the package) of every hvd_onebit module ``path``
    imports, at any depth of the file (lazy imports inside functions count too)."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:  # from . import x, y: modules of that package
                    found += [(node.lineno, ".".join(base + [a.name])) for a in node.names]
                    continue
            elif node.module and node.module.startswith("hvd_onebit."):
                target = node.module[len("hvd_onebit."):]
            else:
                continue
            found.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name[len("hvd_onebit."):]) for a in node.names
                      if a.name.startswith("hvd_onebit.")]
    return [(line, t) for line, t in found if t]


def library_modules() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py"))


def test_no_module_imports_one_above_it():
    upward = []
    for path in library_modules():
        mine = layer_of(module_name(path))
        for line, target in imported_modules(path):
            theirs = layer_of(target)
            if theirs < mine:
                upward.append(f"hvd_onebit/{path.relative_to(PACKAGE)}:{line} "
                              f"({LAYERS[mine][0]}) imports hvd_onebit.{target} "
                              f"({LAYERS[theirs][0]})")
    assert not upward, "imports running up the layers:\n" + "\n".join(upward)


def test_the_options_are_a_leaf():
    # config.py is read by every layer above it; it imports the standard library, torch and
    # the base layer, nothing that needs a job, a transport or the kernels.
    path = PACKAGE / "config.py"
    library = [t for _, t in imported_modules(path)]
    base = len(LAYERS) - 1
    assert all(layer_of(t) == base for t in library), \
        f"config.py imports hvd_onebit modules above the base layer: {library}"
    others = sorted({name for _, name in top_level_imports(path)} - {"hvd_onebit"})
    import sys
    assert all(n in sys.stdlib_module_names or n == "torch" for n in others), \
        f"config.py imports beyond the standard library and torch: {others}"


def test_every_module_has_a_layer():
    unplaced = []
    for path in library_modules():
        try:
            layer_of(module_name(path))
        except AssertionError as exc:
            unplaced.append(str(exc))
    assert not unplaced, "\n".join(unplaced)


def test_modules_stay_small_and_the_face_thin():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines())
             for p in library_modules()}
    over = {k: v for k, v in sizes.items() if v > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"
    assert sizes["optimizer.py"] <= FACE_MAX_LINES, \
        f"optimizer.py has {sizes['optimizer.py']} lines, the face keeps to {FACE_MAX_LINES}"


def test_the_checker_reads_the_imports():
    # The walk above would pass vacuously if it found no imports: check that it reads a
    # module's relative imports, of its own package and of the one above.
    found = dict((t, line) for line, t in imported_modules(PACKAGE / "comm" / "flat.py"))
    assert "comm.protocol" in found and "layout" in found, \
        f"imports read from comm/flat.py: {sorted(found)}"
    assert layer_of("optimizer") < layer_of("phases.warmup") < layer_of("engine.step") \
        < layer_of("job") < layer_of("comm.flat") < layer_of("config") < layer_of("layout"), \
        "layer order"


def top_level_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, top-level name) of every absolute import in ``path``, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
    return found


def test_the_library_imports_no_tooling():
    offending = [f"hvd_onebit/{path.relative_to(PACKAGE)}:{line} imports {name}"
                 for path in library_modules()
                 for line, name in top_level_imports(path) if name in TOOLING_ONLY]
    assert not offending, "the library imports tooling:\n" + "\n".join(offending)


def test_the_tooling_imports_the_library_by_name():
    # The tooling is its own package: a relative import cannot reach the library from it, and
    # it reads the library as any user would, as hvd_onebit.
    tools = sorted(TOOLS.rglob("*.py"))
    assert len(tools) > 20, f"found {len(tools)} tooling modules under {TOOLS}"
    used = {name for path in tools for _, name in top_level_imports(path)}
    assert "hvd_onebit" in used and "click" in used, f"tooling imports: {sorted(used)}"


def test_the_benchmarks_are_entry_points():
    # benchmarks/ holds scripts only: each one a few lines that call into the tooling, which is
    # where its logic and its tests live.
    scripts = sorted((PACKAGE.parent / "benchmarks").glob("*.py"))
    assert len(scripts) >= 5, f"found {len(scripts)} scripts in benchmarks/"
    fat = {}
    for path in scripts:
        tree = ast.parse(path.read_text())
        defs = [node.name for node in ast.walk(tree)
                if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
        imported = {name.split(".")[0] for _, name in top_level_imports(path)} - {"sys"}
        lines = len(path.read_text().splitlines())
        if defs or imported != {"hvd_onebit_tools"} or lines > 15:
            fat[path.name] = f"{lines} lines, defines {defs}, imports {sorted(imported)}"
    assert not fat, "benchmarks/ should only hold entry points into hvd_onebit_tools:\n" + \
        "\n".join(f"{name}: {why}" for name, why in fat.items())


def test_the_engine_and_the_collectives_import_without_horovod():
    # A face that runs them under torchrun has no Horovod: importing them must not need it.
    import subprocess
    import sys

    blocker = (
        "import sys\n"
        "class NoHorovod:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'horovod':\n"
        "            raise ImportError(f'{name} imported')\n"
        "sys.meta_path.insert(0, NoHorovod())\n"
        "import hvd_onebit.engine, hvd_onebit.comm.flat, hvd_onebit.comm.hierarchical\n")
    run = subprocess.run([sys.executable, "-c", blocker], cwd=PACKAGE.parent,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"importing engine/ and comm/ needs Horovod:\n{run.stderr}"
