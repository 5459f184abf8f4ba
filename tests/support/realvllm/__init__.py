"""A real vLLM server for the tests (issue 14): installed, built and started from these modules.

    make vllm                                  # install.py + build_model.py, reused when unchanged
    .venv-vllm/bin/python -m tests.support.realvllm.serve   # serve the tiny model by hand

`paths` says where everything lives; `server` starts and stops the engine for the test session.
"""
