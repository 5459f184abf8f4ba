"""Prefill/decode disaggregation between two real vLLM servers (NixlConnector over CPU memory):
how they are started, shared by bench/pd_vllm.py and tests/realengine/test_vllm_pd_real.py.

    prefill, decode = start_pair(progress_thread=False)

Both servers are `kv_both` with a CPU KV buffer, each with its own NIXL side-channel port. NIXL
(`nixl`, `nixl-cu12`, pinned in requirements-nixl.txt; `make vllm` installs them) runs on the CPU
here through UCX.
"""

from __future__ import annotations

import json
import os
import subprocess

from tests.support.ports import unused_port
from tests.support.realvllm.paths import LOG_DIR, VENV_PYTHON
from tests.support.realvllm.server import REQUIRE_ENV, RealVllm, require_engine, start_on_fresh_ports

KV_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
# The prefill server's log line when a decode read KV blocks after their lease expired
# (vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py).
LATE_READ = "Potentially invalid KV blocks"


def prompt(run: int) -> str:
    # ~160 tokens for the tiny tokenizer: a few KV blocks, distinct per run.
    return f"run {run}: " + "alpha beta gamma delta " * 40


# NIXL's Python API hard-codes its progress thread's poll delay to 0 (nixl_cu12/_api.py:
# `agent_config.pthrDelay = 0`) and vLLM keeps the thread on (base_worker.py builds
# `nixl_agent_config(num_threads=…)`): each server then spins a core polling UCX even when idle.
# `--no-progress-thread` turns the thread off through this sitecustomize (UCX then progresses
# when vLLM polls the transfer state), to test whether that spinning is what stalls decode.
NO_PROGRESS_THREAD = """
import functools
try:
    from nixl_cu12 import _api
except ImportError:
    pass
else:
    _original = _api.nixl_agent_config.__init__

    @functools.wraps(_original)
    def _init(self, *args, enable_prog_thread=False, **kwargs):
        _original(self, *args, enable_prog_thread=enable_prog_thread, **kwargs)

    _api.nixl_agent_config.__init__ = _init
"""


#: The decode server's log line when a request came without usable kv_transfer_params and it
#: prefilled the prompt itself.
NO_KV_TRANSFER = "will not utilize KVTransfer"


def require_nixl() -> None:
    """Skip (fail, with REQUIRE_REAL_VLLM=1) when the engine or NIXL is not installed."""
    import pytest

    require_engine()
    probe = subprocess.run([str(VENV_PYTHON), "-c", "import nixl_cu12"], capture_output=True, check=False)
    if probe.returncode == 0:
        return
    reason = "NIXL is not installed in the engine's virtualenv (run `make vllm`)"
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{reason}; {REQUIRE_ENV}=1 makes a missing real engine a failure")
    pytest.skip(reason)


def start_pair(progress_thread: bool = True) -> tuple[RealVllm, RealVllm]:
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
    if not progress_thread:
        patch_dir = LOG_DIR / "nixl-no-progress-thread"
        patch_dir.mkdir(parents=True, exist_ok=True)
        (patch_dir / "sitecustomize.py").write_text(NO_PROGRESS_THREAD)
        env["PYTHONPATH"] = str(patch_dir)
    def build() -> list[RealVllm]:
        return [
            RealVllm(
                "--kv-transfer-config", json.dumps(KV_CONFIG), name=role,
                env={**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(unused_port())},
            )
            for role in ("prefill", "decode")
        ]  # fmt: skip

    prefill, decode = start_on_fresh_ports(build)
    return prefill, decode
