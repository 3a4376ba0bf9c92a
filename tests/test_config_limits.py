"""Impossible settings fail when the config is loaded, not after the ranks have started.

Each case fails on the code before its fix: ``log.every=0`` passed validation and crashed with
ZeroDivisionError at the first step; a negative ``optim.min_lr_ratio`` passed and made the lr
schedule negative; streaming/overlap/adaptive conflicts were only found after the ranks had started.
"""

from __future__ import annotations

import pytest

from dilocox.config import ConfigError, load_config


@pytest.mark.parametrize(
    "overrides, needles",
    [
        (["--log.every=0"], ["log.every=0", "> 0"]),
        (["--train.eval_batches=-1"], ["train.eval_batches=-1", ">= 0"]),
        (["--checkpoint.every=-5"], ["checkpoint.every=-5", ">= 0"]),
        (["--train.max_tokens=0"], ["train.max_tokens=0", "> 0"]),
        (["--optim.min_lr_ratio=-0.5"], ["optim.min_lr_ratio=-0.5", "[0, 1]"]),
        (["--optim.min_lr_ratio=1.5"], ["optim.min_lr_ratio=1.5", "[0, 1]"]),
        # one fragment: tau must still be below H (was found only when the outer loop was built)
        (
            ["--outer.method=diloco", "--outer.sync_every=4", "--outer.streaming.tau=4"],
            ["outer.streaming.tau=4", "[0, sync_every/fragments=4)"],
        ),
        (
            ["--outer.method=diloco", "--outer.overlap=delayed", "--outer.streaming.tau=1"],
            ["outer.streaming.tau=1", "overlap='delayed'"],
        ),
        (
            [
                "--outer.method=diloco",
                "--outer.sync_every=4",
                "--outer.streaming.fragments=2",
                "--compress.adaptive.enabled=true",
            ],
            ["compress.adaptive.enabled=True", "fragments=2"],
        ),
    ],
)
def test_impossible_settings_fail_at_load(overrides, needles):
    with pytest.raises(ConfigError) as ei:
        load_config(None, overrides)
    for n in needles:
        assert n in str(ei.value), (n, str(ei.value))


def test_valid_streaming_and_schedule_settings_still_load():
    load_config(None, ["--outer.method=diloco", "--outer.sync_every=4", "--outer.streaming.tau=3"])
    load_config(None, ["--optim.min_lr_ratio=0", "--log.every=1", "--train.eval_batches=0", "--checkpoint.every=0"])
