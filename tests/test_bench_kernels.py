"""bench kernels: one bytes-moved convention on both sides of every ratio, and the load average beside every timing."""

import pytest

from dilocox.bench import kernels as bk


def test_bytes_moved_convention_and_load_column(monkeypatch, capsys):
    G, n = 128, 4096
    monkeypatch.setattr(bk, "load_average", lambda: 0.5)
    rows = bk.run([n], group_size=G, repeats=1, ref_repeats=1)
    per = {r["op"]: r["bytes_moved"] / n for r in rows}
    pay = 0.5 + 2 / G
    # a copy moves 12 B/element (read src, write-allocate + write dst), like the in-place add roofline;
    # the send kernel's payload store is write-allocated too, its in-place error update is not
    assert per["copy (fp32)"] == 12 and per["add_ (in-place, roofline)"] == 12
    assert per["ef_quantize_pack_int4"] == pytest.approx(12 + 2 * pay)
    assert per["dequantize_accumulate_int4"] == pytest.approx(8 + pay)
    assert per["sparse_encode (top 1/64, 2-bit)"] == pytest.approx(4 + 2 * 82 / 4096)  # 82 B per 4096-chunk (Rice)
    roof = next(r for r in rows if r["op"].startswith("add_"))
    assert roof["pct_of_roofline"] == pytest.approx(100.0)
    for r in rows:
        assert r["load_avg"] == 0.5
        assert r["pct_of_roofline"] == pytest.approx(100.0 * r["gbps"] / roof["gbps"])
    table = bk.format_table(rows)
    assert "Bytes moved per element" in table and "| load |" in table.splitlines()[2]
    assert all(line.rstrip().endswith("| 0.50 |") for line in table.splitlines()[4:])
    assert "warning" not in capsys.readouterr().err


def test_overloaded_machine_is_flagged(monkeypatch, capsys):
    monkeypatch.setattr(bk, "load_average", lambda: 99.0)
    rows = bk.run([1024], repeats=1, reference=False)
    assert "warning: load average 99.00" in capsys.readouterr().err
    assert "99.00 (> cores)" in bk.format_table(rows)
    assert bk.overloaded(3.0, 2) and not bk.overloaded(1.5, 2) and not bk.overloaded(None, 2)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--sizes", "0"], "element count must be >= 1"),  # (was a ZeroDivisionError traceback)
        (["--sizes", "-5"], "element count must be >= 1"),  # (a negative-dimension RuntimeError)
        (["--sizes", "abc"], "is not an element count"),
        (["--group-size", "0"], "--group-size: '0': must be >= 1"),  # (a ValueError traceback)
        (["--group-size", "7"], "must be even"),
        (["--repeats", "0"], "--repeats: '0': must be >= 1"),  # (accepted: a row of nothing timed)
        (["--threads", "0"], "--threads: '0': must be >= 1"),
        (["--device", "cuda"], "sees no CUDA GPU"),  # (an AssertionError traceback on a CPU torch)
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args, needle, capsys):
    with pytest.raises(SystemExit) as e:
        bk.main([*args, "--no-reference"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and "Traceback" not in err, err
