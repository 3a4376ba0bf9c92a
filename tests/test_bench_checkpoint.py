"""`dilocox bench checkpoint` runs end to end on the tiny model and its table holds what it measured."""

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_checkpoint_tiny(tmp_path):
    from dilocox.bench import checkpoint

    out = tmp_path / "out"
    model = os.path.join(ROOT, "configs", "model", "gpt2-tiny.yaml")
    args = ["--model", model, "--layouts", "pp2", "--repeats", "1", "--out", str(out), "--workdir", str(tmp_path / "w")]
    assert checkpoint.main(args) == 0
    rows = json.loads((out / "results.json").read_text())
    assert [r["layout"] for r in rows] == ["pp2"] and rows[0]["ranks"] == 2
    r = rows[0]
    # the DCP checkpoint holds what the per-rank torch.save holds (within the metadata and JSON overheads)
    assert 0.9 < r["bytes"] / r["ref_bytes"] < 1.2, r
    assert all(x > 0 for x in r["save"] + r["ref_save"] + r["load"] + r["reshard"]), r
    assert "| pp2 | 2 |" in (out / "results.md").read_text()


def test_bad_arguments_are_one_line_and_the_header_names_the_layouts(tmp_path, capsys):
    """Found by review: ``--repeats 0`` ended in a KeyError traceback (after the saves), a missing ``--model`` file in
    one from deep inside, and the table's header left out ``--layouts``."""
    import pytest

    from dilocox.bench import checkpoint as bc

    model = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs/model/gpt2-tiny.yaml")
    for args, needle in ((["--repeats", "0"], "--repeats 0: must be >= 1"), (["--model", "nope.yaml"], "no such file")):
        with pytest.raises(SystemExit) as e:
            bc.main(["--model", model, "--layouts", "one", "--out", str(tmp_path / "o"), *args])
        assert e.value.code == 2 and needle in capsys.readouterr().err
    row = {"layout": "one", "ranks": 1, "bytes": 1e6, "ref_bytes": 1e6, "params": 1e6, "save": [1.0],
           "ref_save": [1.0], "load": [1.0], "reshard": []}  # fmt: skip
    assert "--layouts one,tp2 --repeats 1`" in bc.markdown([row], model, 1, "one,tp2")


def test_bench_compression_takes_a_model_name_or_path(capsys):
    """Found by review: ``--model configs/model/gpt2-tiny.yaml`` (the form `bench checkpoint` takes) looked for
    configs/model/configs/model/gpt2-tiny.yaml.yaml and raised; a missing one raised too."""
    import pytest

    from dilocox.bench import compression as bcomp

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    by_name, by_path = (
        bcomp.model_config("gpt2-tiny"),
        bcomp.model_config(os.path.join(root, "configs/model/gpt2-tiny.yaml")),
    )
    assert by_name is not None and by_name == by_path
    with pytest.raises(SystemExit) as e:
        bcomp.main(["--model", "nope.yaml", "--no-real"])
    assert e.value.code == 2 and "no such model config" in capsys.readouterr().err
