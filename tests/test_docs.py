"""The documentation cannot rot: the Sphinx site builds with warnings as errors (the API from the
docstrings, the CLI from click, the results from the committed JSON), and the README's generated
blocks match the code and the JSON they come from."""
from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_onebit_tools import docs_tables

REPO = Path(__file__).resolve().parents[1]
PAGES = ("install", "usage", "ddp", "tuning", "checkpoints", "hierarchical", "troubleshooting",
         "how-it-works", "predicting", "gpu", "results", "limitations", "api", "cli")


@pytest.mark.parametrize("horovod", ["installed", "missing"])
def test_the_site_builds_without_a_warning(tmp_path, horovod):
    """Also where Horovod does not import (a DDP user's environment, a docs builder): the
    Horovod face's page is built from its docstring all the same."""
    env = dict(os.environ)
    if horovod == "missing":  # a package named horovod that fails to import, first on the path
        (tmp_path / "blocked" / "horovod").mkdir(parents=True)
        (tmp_path / "blocked" / "horovod" / "__init__.py").write_text(
            "raise ModuleNotFoundError('No module named horovod', name='horovod')\n")
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "blocked"),
                                             env.get("PYTHONPATH", "")])
    site = tmp_path / "html"
    out = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b",
                          "html", str(REPO / "docs"), str(site)], capture_output=True,
                         text=True, timeout=600, cwd=REPO, env=env)
    assert out.returncode == 0, f"horovod {horovod}: " + out.stdout + out.stderr
    tmp_path = site
    missing = [p for p in PAGES if not (tmp_path / f"{p}.html").is_file()]
    assert not missing, f"pages not built: {missing}"
    api = (tmp_path / "api.html").read_text()
    for name in ("freeze_step", "variance_refresh", "hierarchical", "Experimental",
                 "torch_adam_state_dict"):
        assert name in api, f"the API page does not document {name}"
    cli = (tmp_path / "cli.html").read_text()
    for command in ("check", "bench-train", "bench-predict", "bench-dev-kernel", "cluster"):
        assert f'id="hvd-onebit-{command}"' in cli, f"the CLI page has no hvd-onebit {command}"
    dashes = re.findall(r"\u2013\w+", cli)
    assert not dashes and "--np" in cli, \
        f"the CLI page shows options with an en dash (smart quotes), not --: {dashes[:5]}"
    signature = html.unescape(re.sub(r"<[^>]+>", "", api.split(
        'id="hvd_onebit.DistributedOptimizer">')[1].split("</dt>")[0]))
    for default in ("compression=hvd.Compression.none", "op=hvd.Average",
                    "process_set=hvd.global_process_set", "block_size=512"):
        assert default in signature, f"horovod {horovod}: no {default} in {signature}"
    for face in ("hvd_onebit.DistributedOptimizer", "hvd_onebit.ddp.DistributedOptimizer"):
        entry = api.split(f'id="{face}"')[1].split('<dl class="py')[0]
        lists = re.findall(r'<dt class="field-\w+">Parameters', entry)
        assert len(lists) == 1, f"{face}: {len(lists)} Parameters lists on the API page, want one"


def test_the_generated_blocks_match_the_code_and_the_json():
    stale = docs_tables.stale(docs_tables.generate())
    assert not stale, (f"generated blocks are stale in {sorted(str(p) for p in stale)}: run "
                       "python -m hvd_onebit_tools.docs_tables")


def test_every_image_a_page_shows_is_committed():
    missing = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page.read_text()):
            if not (page.parent / target).is_file():
                missing.append(f"{page.name}: {target}")
    assert not missing, f"images shown but not in the repository: {missing}"


def test_the_settings_table_takes_each_default_from_the_signature():
    import inspect

    from hvd_onebit import DistributedOptimizer
    from hvd_onebit.config import REQUIRED

    settings = docs_tables.settings()
    for name in docs_tables.SETTINGS:
        default = inspect.signature(DistributedOptimizer).parameters[name].default
        shown = "required" if default in (inspect.Parameter.empty, REQUIRED) else f"`{default!r}`"
        row = [line for line in settings.splitlines() if line.startswith(f"| `{name}` |")]
        assert len(row) == 1 and f"| {shown} |" in row[0], f"{name}: {row} lacks {shown}"


# Options whose meaning differs between the faces, each said in its own face's words.
FACE_OWN_WORDS = {
    "overlap": "the buckets start from Horovod's gradient hooks or from DDP's communication hook",
}


def test_the_faces_document_each_shared_option_in_the_same_words():
    import inspect

    from hvd_onebit import DistributedOptimizer as HorovodFace
    from hvd_onebit.ddp import DistributedOptimizer as DDPFace

    horovod, ddp = inspect.signature(HorovodFace), inspect.signature(DDPFace)
    shared = [n for n in ddp.parameters if n in horovod.parameters
              and ddp.parameters[n].kind is inspect.Parameter.KEYWORD_ONLY]
    assert len(shared) >= 10, f"only {shared} shared: the faces' signatures drifted apart"
    differ = []
    for name in shared:
        assert horovod.parameters[name].default == ddp.parameters[name].default, \
            (f"{name}: default {horovod.parameters[name].default!r} in the Horovod face, "
             f"{ddp.parameters[name].default!r} in the DDP face")
        words = [docs_tables.arg_doc(inspect.getdoc(face) or "", name)
                 for face in (HorovodFace, DDPFace)]
        if words[0] != words[1] and name not in FACE_OWN_WORDS:
            differ.append(f"{name}:\n  Horovod: {words[0]}\n  DDP:     {words[1]}")
    assert not differ, "the faces document shared options differently:\n" + "\n".join(differ)


def test_the_readme_is_short_and_undated():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines"
    dated = [line for line in lines if re.search(r"\b20\d\d-\d\d-\d\d\b", line)]
    assert not dated, f"dated lines in README.md: {dated}"


def test_no_prose_holds_a_dated_line():
    """Dates belong to the JSON, and to the generated blocks that quote its provenance."""
    pages = [REPO / "CHANGELOG.md", REPO / "DEVELOPERS.md", *sorted((REPO / "docs").glob("*.md"))]
    blocks = re.compile(r"<!-- generated:(\w+) -->.*?<!-- /generated:\1 -->", re.S)
    dated = [f"{p.name}: {line.strip()[:80]}" for p in pages
             for line in blocks.sub("", p.read_text()).splitlines()
             if re.search(r"\b20\d\d-\d\d-\d\d\b", line)]
    assert not dated, f"{len(dated)} dated lines outside the generated blocks: {dated[:5]}"


def test_provenance_shows_an_absolute_output_path_as_out():
    shown = docs_tables.shown_command(
        "python benchmarks/fading.py --out /work/wt/out/fading.json --lr 1e-2 --bw 1/2")
    assert shown == "python benchmarks/fading.py --out OUT/fading.json --lr 1e-2 --bw 1/2", shown
    kept = "python benchmarks/fading.py --out docs/step/fading.json"
    assert docs_tables.shown_command(kept) == kept
    assert "/work/" not in (REPO / "docs" / "results.md").read_text(), \
        "docs/results.md shows a path of the machine that ran a benchmark"


def test_provenance_says_where_the_run_had_uncommitted_changes_and_its_date():
    data = {"command": "hvd-onebit bench dev kernel", "commit": "abc123", "date": "D",
            "uncommitted_changes": True}
    shown = docs_tables.provenance("kernel/run.json", data)
    assert "commit: abc123 with uncommitted changes" in shown and "date: D" in shown, shown
    clean = docs_tables.provenance("kernel/run.json", dict(data, uncommitted_changes=False),
                                   dated=False)
    assert "commit: abc123;" in clean and "date" not in clean, clean
    results = (REPO / "docs" / "results.md").read_text()
    assert "<!-- generated:headline_dated -->" in results, \
        "the results page's headline leaves out the date its JSON records"
