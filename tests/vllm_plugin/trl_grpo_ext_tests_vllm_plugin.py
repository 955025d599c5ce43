"""vLLM's entry point (`vllm.general_plugins`) into the tests' CPU shim: `cpu_engines.vllm_plugin` in every process
vLLM starts. Installed editable, so that `tests/cpu_engines.py` is found beside this file."""

import importlib.util
import os
import sys

CPU_ENGINES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cpu_engines.py")


def register() -> None:
    if "cpu_engines" not in sys.modules:  # the module the tests import by that name, where they did already
        spec = importlib.util.spec_from_file_location("cpu_engines", CPU_ENGINES)
        module = importlib.util.module_from_spec(spec)
        sys.modules["cpu_engines"] = module
        spec.loader.exec_module(module)
    sys.modules["cpu_engines"].vllm_plugin()
