"""``python -m jaxattn.demo`` runs end to end and says which backend ran; under ``jax.distributed``
(2 processes, the model split over their devices) it generates the one-device tokens."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from jaxattn import demo
from tests.xla_dump import REPO

SMALL = ["--preset", "tiny", "--layers", "1", "--requests", "3", "--max-seqs", "2", "--prompt-len", "12",
         "--new-tokens", "3", "--chunk-size", "8", "--page-size", "8", "--backend", "xla"]


def test_demo_runs(capsys):
    demo.main(SMALL)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(num_processes: int, args: list[str], env: dict[str, str], one_device_each: bool = False,
           timeout: float = 600) -> list[str]:
    """Runs ``python -m jaxattn.demo *args`` as each process of a ``jax.distributed`` job with a
    coordinator on localhost (process i on local device i with ``one_device_each``); returns their
    outputs, failing with them if any process fails."""
    coordinator = f"localhost:{_free_port()}"
    processes = [subprocess.Popen([sys.executable, "-m", "jaxattn.demo", *args, "--coordinator", coordinator,
                                   "--num-processes", str(num_processes), "--process-id", str(i),
                                   *(["--local-devices", str(i)] if one_device_each else [])],
                                  cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(num_processes)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in processes]
    finally:
        for p in processes:
            p.kill()
    assert all(p.returncode == 0 for p in processes), "\n".join(outputs)
    return outputs


@pytest.fixture(scope="module")
def one_device_tokens(tmp_path_factory) -> list[list[int]]:
    path = tmp_path_factory.mktemp("demo") / "one.json"
    demo.main(SMALL + ["--output", str(path)])
    return json.loads(path.read_text())


@pytest.mark.parametrize("devices_per_process", [1, 2])
def test_two_processes_generate_the_one_device_tokens(tmp_path, one_device_tokens, devices_per_process):
    """2 processes with 1 or 2 CPU devices each (gloo collectives), the tiny model (Hkv 2) split
    over all their devices (KV heads replicated over 4): the same greedy tokens as one device."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices_per_process}"
    outputs = launch(2, SMALL + ["--output", str(tmp_path / "two.json")],
                     dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags))
    assert f"tensor parallel over {2 * devices_per_process} devices, 2 processes" in outputs[0], outputs[0]
    assert "requests" not in outputs[1], outputs[1]           # only process 0 prints
    assert json.loads((tmp_path / "two.json").read_text()) == one_device_tokens


@pytest.mark.gpu
@pytest.mark.multigpu
def test_gpu_two_processes_one_gpu_each(tmp_path):
    """The README's launch on a 2-GPU host: one process per GPU (bf16 small preset, 2 layers, auto
    backend) against one process on one GPU. Greedy tokens start the same for every request (bf16
    sums in another order may part them later, after a near tie)."""
    args = ["--layers", "2", "--requests", "8", "--new-tokens", "16", "--prompt-len", "300"]
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    subprocess.run([sys.executable, "-m", "jaxattn.demo", *args, "--output", str(tmp_path / "one.json")],
                   cwd=REPO, env=env, check=True, timeout=600)
    outputs = launch(2, args + ["--output", str(tmp_path / "two.json")], env, one_device_each=True)
    print(outputs[0])
    assert "tensor parallel over 2 devices, 2 processes" in outputs[0]
    one, two = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(one, two)]
    print("tokens agreeing with one GPU before the first difference, per request:", agree)
    assert min(agree) >= 1, agree
