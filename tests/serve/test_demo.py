"""``python -m jaxattn.serve.demo`` runs end to end and says which backend ran; under ``jax.distributed``
(2 processes, the model split over their devices) it generates the one-device tokens."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from jaxattn.serve import demo
from tests.conftest import HAS_GPU, require_parity
from tests.xla_dump import REPO

SMALL = ["--preset", "tiny", "--layers", "1", "--requests", "3", "--max-seqs", "2", "--prompt-len", "12",
         "--new-tokens", "3", "--max-step-tokens", "8", "--page-size", "8", "--backend", "xla"]


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


def test_help_names_the_module_and_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m jaxattn.serve.demo")
    assert all(action.help for action in demo.build_parser(on_gpu=False)._actions)


def test_a_backend_that_cannot_run_here_is_a_usage_error(capsys):
    if HAS_GPU:
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--backend", "cudnn", "--layers", "1", "--requests", "1"])
    assert exit_info.value.code == 2
    assert "--backend cudnn: Engine: backend 'cudnn' cannot run here: no NVIDIA GPU" in capsys.readouterr().err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory of a tiny transformers checkpoint with a word-level tokenizer.json, the
    transformers model)."""
    require_parity()
    from tests.serve.models.hf_checkpoints import save_checkpoint, save_tokenizer

    path = tmp_path_factory.mktemp("qwen2-tied")
    reference = save_checkpoint("qwen2-tied", path)
    save_tokenizer(path)
    return path, reference


def test_demo_serves_a_checkpoint(checkpoint, tmp_path, capsys):
    """Prompts from a file of token ids and as text; outputs decoded, equal to transformers' greedy ones."""
    from tests.serve.models.hf_checkpoints import WORDS, generate

    path, reference = checkpoint
    prompts = [[1, 2, 3, 4, 5], list(range(100, 120)), [7], [5, 6, 7]]
    (tmp_path / "prompts.txt").write_text("1 2 3 4 5\n\n" + " ".join(map(str, prompts[1])) + "\n 7 \n")
    demo.main(["--model", str(path), "--prompt-ids", str(tmp_path / "prompts.txt"), "--prompt", "w5 w6 w7",
               "--dtype", "float32", "--backend", "xla", "--new-tokens", "5", "--max-seqs", "2", "--max-step-tokens", "8",
               "--page-size", "8"])
    out = capsys.readouterr().out
    assert f"checkpoint {path}" in out and "4 requests" in out
    def text(ids: list[int]) -> str:
        return " ".join(WORDS[t] for t in ids)

    for i, prompt in enumerate(prompts):
        assert f"request {i}: {text(prompt)!r} -> {text(generate(reference, prompt, 5))!r}\n" in out


@pytest.mark.parametrize("args, message", [
    (["--prompt", "hello"], "--prompt needs --model DIR with a DIR/tokenizer.json; or give token ids"),
    (["--model", "{path}", "--layers", "2"], "--preset and --layers choose a random-weight model"),
    (["--model", "{path}", "--prompt-ids", "{tmp}/bad.txt"], r"bad.txt, line 2: expected .* in \[0, 128\)"),
    (["--model", "{tmp}"], "is not a local checkpoint directory with a config.json"),
])
def test_bad_model_or_prompts_exit_with_a_usage_error(checkpoint, tmp_path, capsys, args, message):
    (tmp_path / "bad.txt").write_text("1 2\n3 128\n")
    with pytest.raises(SystemExit) as exit_info:
        demo.main([a.format(path=checkpoint[0], tmp=tmp_path) for a in args])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_text_prompts_without_the_tokenizers_package_say_what_to_install(checkpoint, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers raises ImportError
    with pytest.raises(SystemExit):
        demo.main(["--model", str(checkpoint[0]), "--prompt", "w1"])
    assert "--prompt needs the tokenizers package to read" in capsys.readouterr().err


@pytest.mark.gpu
def test_demo_serves_a_checkpoint_on_the_gpu(tmp_path, capsys):
    """A checkpoint with head_dim 128 in bfloat16, so that auto picks the GPU backends."""
    require_parity()
    from tests.serve.models.hf_checkpoints import save_checkpoint

    save_checkpoint("llama", tmp_path, head_dim=128)
    demo.main(["--model", str(tmp_path), "--dtype", "bfloat16", "--requests", "6", "--prompt-len", "100",
               "--new-tokens", "8", "--max-seqs", "4", "--max-step-tokens", "64"])
    out = capsys.readouterr().out
    assert "attention backend, decode step: xla" not in out, out
    assert "6 requests" in out and "request 0 generated: [" in out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(num_processes: int, args: list[str], env: dict[str, str], one_device_each: bool = False,
           timeout: float = 600) -> list[str]:
    """Runs ``python -m jaxattn.serve.demo *args`` as each process of a ``jax.distributed`` job with a
    coordinator on localhost (process i on local device i with ``one_device_each``); returns their
    outputs, failing with them if any process fails."""
    coordinator = f"localhost:{_free_port()}"
    processes = [subprocess.Popen([sys.executable, "-m", "jaxattn.serve.demo", *args, "--coordinator", coordinator,
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
    subprocess.run([sys.executable, "-m", "jaxattn.serve.demo", *args, "--output", str(tmp_path / "one.json")],
                   cwd=REPO, env=env, check=True, timeout=600)
    outputs = launch(2, args + ["--output", str(tmp_path / "two.json")], env, one_device_each=True)
    print(outputs[0])
    assert "tensor parallel over 2 devices, 2 processes" in outputs[0]
    one, two = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(one, two)]
    print("tokens agreeing with one GPU before the first difference, per request:", agree)
    assert min(agree) >= 1, agree


def test_the_serving_side_imports_without_triton():
    """``pip install -e .`` (no [triton] extra) serves the demo: the engine, the models and their
    FP8 layers import without Triton (a blocked import in a fresh process)."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import jaxattn.serve.demo, jaxattn.serve.engine, jaxattn.serve.models.quantization")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
