"""The console entry reads the device off argv before the CLI exists, to start the driver's init
early: it must read what the parser will, for every command that loads a model."""
import pytest

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
