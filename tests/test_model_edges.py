"""Edges of the model and the planner a review found: shapes that config validation refuses but a ModelConfig built
in code went through, and `dilocox plan` accepting layouts training refuses (or failing after its table)."""

from __future__ import annotations

import os

import pytest

from dilocox.config import ConfigError, ModelConfig
from dilocox.model.transformer import build_model
from dilocox.plan import main as plan_main
from dilocox.plan import rank_shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "model", "gpt2-tiny.yaml")  # 4 layers, 4 heads, d 128
PLAN = ["--model", TINY, "--replicas", "4", "--bandwidth", "1gbit", "--methods", "diloco"]


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(d_model=30, n_heads=4), "model.d_model=30"),  # before: built, attention 28 wide in a 30-wide stream
        (dict(n_heads=4, n_kv_heads=3), "model.n_kv_heads=3"),  # before: a RuntimeError from SDPA at forward
        (dict(n_heads=4, n_kv_heads=8), "model.n_kv_heads=8"),
        (dict(d_model=36, n_heads=4, pos_emb="rope"), "odd head_dim"),  # before: a shape error inside apply_rope
    ],
)
def test_build_refuses_the_shapes_config_validation_refuses(kw, field):
    with pytest.raises(ConfigError, match=field):
        build_model(ModelConfig(n_layers=1, vocab_size=64, max_seq_len=16, **kw))


def test_plan_refuses_a_tensor_degree_that_splits_attention_heads(capsys):
    """Before: --tensor 8 on a 4-head model printed a plan (the weight rows divide, the heads do not)."""
    with pytest.raises(ConfigError, match="model.n_heads=4 is not divisible by parallel.tensor=8"):
        rank_shards(ModelConfig(n_layers=2, n_heads=4, d_model=128, vocab_size=256), 1, 8)
    assert plan_main([*PLAN, "--tensor", "8"]) == 2
    assert "model.n_heads=4" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--pipeline", "0"), ("--tensor", "0"), ("--replicas", "1")])
def test_plan_refuses_layout_flags_out_of_range(capsys, flag, value):
    """Before: --pipeline 0 / --tensor 0 were planned as 1 in silence; --replicas 1 printed `infx` and 0 bit/s."""
    flags = {"--replicas": "4", flag: value}
    argv = [*PLAN[:2], *PLAN[4:], *(x for kv in flags.items() for x in kv)]
    assert plan_main(argv) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err, err


def test_plan_choice_line_skips_a_preset_whose_fragments_do_not_fit(tmp_path, capsys):
    """Two layers on two stages: the planned diloco row fits; the `dilocox` preset (2 streaming fragments) does not.
    Before: the table printed, then the preset chooser raised a ConfigError (a traceback)."""
    model = tmp_path / "two-layers.yaml"
    model.write_text(f"include: {TINY}\nmodel:\n  n_layers: 2\n")
    assert plan_main(["--model", str(model), *PLAN[2:], "--pipeline", "2"]) == 0
    out = capsys.readouterr().out
    assert "| diloco |" in out and "preset for this link: methods/dilocox-far.yaml" in out
    assert "`dilocox` does not fit this model and layout: outer.streaming.fragments=2" in out


def _out_of_vocab(rank, world):
    import torch

    from dilocox.model.parallel_layers import VocabParallelEmbedding, vocab_parallel_cross_entropy

    group, V, errors = torch.distributed.group.WORLD, 8, []
    emb = VocabParallelEmbedding(V, 4, group, rank, world)
    logits = torch.randn(2, 3, V // world)
    for name, call in (
        ("ids", lambda: emb(torch.tensor([[1, V]]))),
        ("negative ids", lambda: emb(torch.tensor([[-1, 2]]))),
        ("labels", lambda: vocab_parallel_cross_entropy(logits, torch.tensor([[0, 1, V], [2, 3, 4]]), group)),
    ):
        try:
            call()
            errors.append(f"{name}: accepted")
        except RuntimeError as e:
            errors.append(f"{name}: {e}")
    ok = vocab_parallel_cross_entropy(logits, torch.tensor([[0, 1, -100], [2, 3, 7]]), group)  # ignore_index: fine
    return errors, bool(torch.isfinite(ok))


def test_ids_and_labels_past_the_vocabulary_fail_under_tensor_parallel_as_on_one_process():
    """TP = 2: an id or label no rank owns was a zero embedding / zero target logit and a plausible loss (one process:
    F.embedding raises). Now the same error on every rank, with no host sync (``torch._assert_async``)."""
    from tests.spawn import run_ranks

    for errors, finite in run_ranks(2, _out_of_vocab):
        assert finite and all("outside [0, model.vocab_size=8)" in e for e in errors), errors
