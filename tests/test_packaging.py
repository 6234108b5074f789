"""What `pip install .` (not editable) puts in the environment: every directory of modules the
library and its tools import from must be a package that setuptools finds."""
from pathlib import Path

from setuptools import find_packages

REPO = Path(__file__).resolve().parents[1]


def test_every_directory_of_modules_is_an_installed_package():
    # setup.cfg: packages = find:, include = hvd_onebit*
    installed = set(find_packages(where=str(REPO), include=["hvd_onebit*"]))
    with_modules = {str(p.parent.relative_to(REPO)).replace("/", ".")
                    for top in ("hvd_onebit", "hvd_onebit_tools")
                    for p in (REPO / top).rglob("*.py") if "__pycache__" not in p.parts}
    missing = sorted(with_modules - installed)
    assert not missing, (f"directories of modules a plain `pip install .` leaves out (no "
                         f"__init__.py): {missing}")


# import name -> distribution, where they differ; the examples' own modules, which the studies
# import from examples/ by path
DISTRIBUTION = {"sklearn": "scikit-learn"}
EXAMPLES = {"train_digits", "train_lm"}


def declared_requirements() -> dict:
    """setup.cfg's install_requires and extras: {"install_requires" or extra: {distribution}}."""
    import configparser
    import re

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    names = lambda text: {re.split(r"[<>=!\[ ;]", line.strip())[0].lower()  # noqa: E731
                          for line in text.splitlines() if line.strip()}
    out = {"install_requires": names(cfg["options"]["install_requires"])}
    out.update({extra: names(text) for extra, text in cfg["options.extras_require"].items()})
    return out


def test_every_package_the_tools_import_is_declared_and_the_cli_needs_only_the_tools_extra():
    """`pip install ".[tools]"` must install what `hvd-onebit` imports to start: psutil (its
    job runner's) was imported by every command and declared nowhere, which a development
    environment hid (Horovod depends on it)."""
    import ast
    import sys

    imported = {}
    for path in (REPO / "hvd_onebit_tools").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                       [node.module] if isinstance(node, ast.ImportFrom) and not node.level
                       else [])
            for module in modules:
                top = module.split(".")[0]
                if top not in sys.stdlib_module_names and not top.startswith("hvd_onebit") \
                        and top not in EXAMPLES:
                    imported.setdefault(DISTRIBUTION.get(top, top), set()).add(
                        str(path.relative_to(REPO)))
    declared = declared_requirements()
    undeclared = {name: sorted(paths) for name, paths in imported.items()
                  if not any(name in group for group in declared.values())}
    assert not undeclared, f"imported by the tools, declared in no requirement: {undeclared}"
    cli = declared["install_requires"] | declared["tools"]
    missing = {"click", "psutil"} - cli
    assert not missing, f"the CLI's own imports missing from the tools extra: {sorted(missing)}"
