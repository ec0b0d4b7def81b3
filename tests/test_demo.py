"""``python -m jaxattn.demo`` runs end to end and says which backend ran."""

from __future__ import annotations

import pytest

from jaxattn import demo


def test_demo_runs(capsys):
    demo.main(["--preset", "tiny", "--layers", "1", "--requests", "3", "--max-seqs", "2", "--prompt-len", "12",
               "--new-tokens", "3", "--chunk-size", "8", "--page-size", "8", "--backend", "xla"])
    out = capsys.readouterr().out
    assert "attention backend, decode step: xla" in out
    assert "3 requests" in out and "generated tokens/s" in out


@pytest.mark.parametrize("flag, value", [("--page-size", "0"), ("--requests", "0"), ("--layers", "0"),
                                         ("--layers", "-2"), ("--max-seqs", "x")])
def test_bad_flags_exit_with_a_usage_error(capsys, flag, value):
    with pytest.raises(SystemExit) as exit_info:
        demo.main([flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: must be an int >= 1, got '{value}'" in capsys.readouterr().err
