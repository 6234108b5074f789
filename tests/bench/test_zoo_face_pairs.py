"""``bench dev zoo --against-face``: one zoo's cells against another's (the DDP face's against
the Horovod face's), cell by cell and over seeds, on records made here."""
from __future__ import annotations

import json
import math

from click.testing import CliRunner

from hvd_onebit_tools.bench.zoo.face_pairs import against_faces


def records(face: str, ratios: dict[int, float], family: str = "mnist_cnn") -> list[dict]:
    """An Adam cell (loss 1.0) and a bounded 20% cell per seed, whose loss is the ratio given
    (inf: the cell diverged)."""
    out = []
    for seed, ratio in ratios.items():
        common = {"family": family, "lr_rule": "scaled", "seed": seed, "steps": 120, "batch": 32,
                  "face": face, "lr": 0.004, "world": 4, "params": 100, "initial_loss": 2.0,
                  "nonfinite_at": None, "steps_taken": 120, "curve": [], "seconds": 1.0,
                  "cpu_seconds": 2.0}
        out.append({**common, "method": "adam", "scheme": None, "freeze": None,
                    "final_loss": 1.0, "tail_loss": 1.0, "diverged": False})
        diverged = math.isinf(ratio)
        out.append({**common, "method": "onebit", "scheme": "bounded", "freeze": "20%",
                    "final_loss": None if diverged else ratio,
                    "tail_loss": None if diverged else ratio, "diverged": diverged,
                    "options": {}, "freeze_step": 24, "compressed_steps": 96, "skipped_steps": 0,
                    "clamped_fraction": 0.0, "clamped_max": 0.0, "input_clamped_fraction": 0.0,
                    "zero_variance_fraction": 0.0, "held_fraction": 0.0, "bound": "adam"})
    return out


def test_a_zoo_within_the_others_largest_ratio_and_one_above_it():
    ours = records("ddp", {0: 0.95, 1: 1.02, 2: 0.99}) + \
        records("ddp", {0: 1.08, 1: 1.09, 2: 1.10}, family="dropout_cnn")
    theirs = records("horovod", {0: 0.96, 1: 1.03, 2: 0.98}) + \
        records("horovod", {0: 1.01, 1: 1.00, 2: 1.02}, family="dropout_cnn")
    result = against_faces(ours, {"horovod": theirs})
    groups = {g["family"]: g for g in result["groups"]}
    mnist, dropout = groups["mnist_cnn"], groups["dropout_cnn"]
    assert (mnist["max_ratio"], mnist["others_max_ratio"]["horovod"], mnist["within"]) == \
        (1.02, 1.03, True), mnist
    assert (dropout["max_ratio"], dropout["within"]) == (1.10, False), dropout
    assert result["worse_beyond_seed_noise"] == \
        ["dropout_cnn scaled bounded/20% against horovod"], result["worse_beyond_seed_noise"]
    geo = dropout["over_seeds"]["horovod"]["geo_mean_ratio_of_ratios"]
    assert math.isclose(geo, (1.08 / 1.01 * 1.09 / 1.00 * 1.10 / 1.02) ** (1 / 3)), geo
    assert not result["within_every_group"], result["groups"]
    cell = next(c for c in result["cells"] if (c["family"], c["seed"]) == ("mnist_cnn", 1))
    assert (cell["face"], cell["ratio"], cell["others"]) == ("ddp", 1.02, {"horovod": 1.03})


def test_a_divergence_of_ours_alone_is_never_within():
    result = against_faces(records("ddp", {0: math.inf, 1: 0.9}),
                           {"horovod": records("horovod", {0: 1.2, 1: 1.2})})
    (group,) = result["groups"]
    assert (group["divergences"], group["within"]) == (1, False), group
    assert group["over_seeds"]["horovod"]["worse_beyond_seed_noise"] is True, group


def test_the_command_writes_faces_json(tmp_path):
    from hvd_onebit_tools.cli import main

    ours, theirs = tmp_path / "ddp", tmp_path / "horovod"
    for folder, cells in ((ours, records("ddp", {0: 0.97, 1: 1.01})),
                          (theirs, records("horovod", {0: 0.98, 1: 1.02}))):
        folder.mkdir()
        (folder / "cells.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cells))
    out = CliRunner().invoke(main, ["bench", "dev", "zoo", "--report-only", "--out-dir", str(ours),
                                   "--against-face", str(theirs)])
    assert out.exit_code == 0, out.output
    written = json.loads((ours / "faces.json").read_text())
    assert (written["within_every_group"], written["others"]) == (True, [str(theirs)]), written
    assert "worse beyond seed noise: none" in out.output, out.output
