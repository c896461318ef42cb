"""The console entry reads the device off argv before the CLI exists, to start the driver's init
early: it must read what the parser will, for every command that loads a model. It ends the process
while a one-shot command's model is still loaded."""
import gc
import subprocess
import sys

import pytest

from model_files import GOLDEN_QWEN3
from reflex_engine import cli, engine
from reflex_engine.cli import build_parser
from reflex_engine.launch import DEVICE_DEFAULTS, device_in

REQUIRED = {"generate": ["m.gguf", "hi"], "system1": ["m.gguf", "hi"], "stdio": ["m.gguf"], "uds": ["m.gguf", "/tmp/s"],
            "bench": ["m.gguf"], "check": ["m.gguf", "--reference", "r.npz"]}


@pytest.mark.parametrize("command", sorted(DEVICE_DEFAULTS))
@pytest.mark.parametrize("extra", [[], ["--device", "cuda"], ["--device=cpu"], ["--device", "cpu", "--device", "auto"],
                                   ["-c", "64", "--device", "cuda"]])
def test_the_device_read_off_argv_is_the_parsers(command, extra):
    argv = [command, *REQUIRED[command], *extra]
    assert device_in(argv) == build_parser().parse_args(argv).device


def test_commands_without_a_model_on_a_device_start_nothing():
    for argv in ([], ["info", "m.gguf"], ["tokenize", "m.gguf", "--device", "cuda"], ["smoke"], ["prepare", "m.gguf"], ["--help"]):
        assert device_in(argv) is None


def test_a_prompt_that_mentions_the_option_is_still_a_prompt():
    assert device_in(["generate", "m.gguf", "--device cpu please", "--device", "cuda"]) == "cuda"
    assert device_in(["generate", "m.gguf", "--", "--device", "cpu"]) == "auto"


def test_a_constrained_generate_on_auto_starts_the_driver():
    """Constraints run on either backend (the CUDA sampler masks on the device): options change nothing."""
    for option in (["--json-object"], ["--regex", "a+"], ["--json-schema=s.json"], ["--grammar", "g.lark"]):
        assert device_in(["generate", "m.gguf", "hi", *option]) == "auto"
        assert device_in(["generate", "m.gguf", "hi", *option, "--device", "cpu"]) == "cpu"


def test_the_process_ends_before_the_model_is_closed(monkeypatch, capsys):
    """The driver tears a device down at the exit sooner than closing it in the process does, so exit_now
    (launch.run's os._exit) comes while the model is loaded; a caller in the process gets it closed after."""
    closed, seen = [], []
    monkeypatch.setattr(engine, "_release", lambda step, ops: closed.append(ops))
    code = cli.main(["generate", GOLDEN_QWEN3, "hi", "-n", "2", "--device", "cpu"],
                    exit_now=lambda code: seen.append((code, len(closed))))
    gc.collect()
    assert (code, seen, len(closed)) == (0, [(0, 0)], 1)
    assert "REFLEX_GENERATE_OK" in capsys.readouterr().out


@pytest.mark.parametrize("argv, code", [(["generate", GOLDEN_QWEN3, "hi", "-n", "2", "--device", "cpu"], 0),
                                        (["generate", "/nonexistent.gguf", "hi", "--device", "cpu"], 2)])
def test_the_console_entry_flushes_its_output_and_keeps_the_exit_code(argv, code):
    proc = subprocess.run([sys.executable, "-m", "reflex_engine", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == code
    assert ("REFLEX_GENERATE_OK" in proc.stdout.splitlines()[-1]) if code == 0 else proc.stderr.startswith("reflex: error:")
