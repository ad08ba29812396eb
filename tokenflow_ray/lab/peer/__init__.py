"""Peer runs: the same model, workload, KV bytes and client against vLLM, in its own venv outside ours.

vllm_env: create/reuse the isolated vLLM venv. vllm_server: start vLLM's OpenAI server in its own process group and
make sure the whole group is gone afterwards. vllm_engine: vLLM's offline decode tok/s for `bench engine --peer`
(vllm_offline.py is the script that runs inside the vLLM venv). peer_bench: fcfs, tokenflow, vLLM on one workload.
Nothing here runs in CI except the process-group handling (with a fake server).
"""
