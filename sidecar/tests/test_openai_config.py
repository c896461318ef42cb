"""Options: flags over environment variables over defaults, and one README table for them all."""
import os
import re

import pytest

from reflex_openai.config import OPTIONS, parse

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_a_flag_beats_its_environment_variable_which_beats_the_default():
    env = {"REFLEX_MODEL": "m.gguf", "REFLEX_MAX_QUEUE": "5", "PORT": "9000", "REFLEX_API_KEY": "k",
           "REFLEX_SERVED_MODEL_NAME": "served", "PORT_HEALTH": "9001"}
    cfg = parse([], environ=env)
    assert (cfg.model, cfg.max_queue, cfg.port, cfg.api_key, cfg.name, cfg.health_port) == (
        "m.gguf", 5, 9000, "k", "served", 9001)
    cfg = parse(["other.gguf", "--max-queue", "7", "--port", "1"], environ={**env, "REFLEX_PORT": "2"})
    assert (cfg.model, cfg.max_queue, cfg.port) == ("other.gguf", 7, 1)
    assert parse(["x.gguf"], environ={"PORT": "3", "REFLEX_PORT": "4"}).port == 4  # ours before the platform's
    defaults = parse(["x.gguf"], environ={})
    assert (defaults.port, defaults.max_queue, defaults.on_engine_exit, defaults.name) == (8000, 64, "exit", "x.gguf")


@pytest.mark.parametrize("argv,env", [([], {}), (["m", "--max-queue", "-1"], {}), (["m"], {"REFLEX_MAX_QUEUE": "many"}),
                                      (["m"], {"REFLEX_ON_ENGINE_EXIT": "explode"}), (["m", "--device", "tpu"], {})])
def test_bad_options_are_refused(argv, env, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv, environ=env)
    assert e.value.code == 2 and "Traceback" not in capsys.readouterr().err


def test_the_engine_command():
    cfg = parse(["m.gguf", "--engine-cmd", "python3 -m reflex_engine", "--device", "cpu", "--ctx-size", "256"], environ={})
    assert cfg.engine_argv() == ["python3", "-m", "reflex_engine", "stdio", "m.gguf", "--device", "cpu", "-c", "256"]


def test_the_readme_table_names_every_option_and_variable():
    with open(README) as f:
        rows = [line for line in f if line.startswith("| `")]
    for option in OPTIONS:
        flag = "MODEL" if option.flag == "model" else option.flag
        row = next((r for r in rows if r.startswith(f"| `{flag}` |")), None)
        assert row is not None, f"{flag} is not in the README's table"
        assert all(f"`{env}`" in row for env in option.env), row
        if option.default is not None and not isinstance(option.default, bool):
            assert re.search(rf"`{re.escape(str(option.default))}`", row), f"the default of {flag}: {row}"
