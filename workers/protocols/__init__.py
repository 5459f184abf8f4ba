"""Disaggregated protocols: how a chat request is split into a context and a generation request.

One module per protocol; `trtllm` (TensorRT-LLM's `disaggregated_params`) is the one in use.
vLLM's `kv_transfer_params` or SGLang's bootstrap room would be one module each, with the same
three functions.
"""
