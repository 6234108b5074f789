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
