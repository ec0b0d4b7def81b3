"""``python -m jaxattn.demo`` runs end to end and says which backend ran."""

from __future__ import annotations

from jaxattn import demo


def test_demo_runs(capsys):
    demo.main(["--preset", "tiny", "--layers", "1", "--requests", "3", "--max-seqs", "2", "--prompt-len", "12",
               "--new-tokens", "3", "--chunk-size", "8", "--page-size", "8", "--backend", "xla"])
    out = capsys.readouterr().out
    assert "attention backend, decode step: xla" in out
    assert "3 requests" in out and "generated tokens/s" in out
