"""`bench engine --peer vllm` from our side: hand the same prompts to vllm_offline.py in the vLLM venv, read tok/s.

The script runs as a ProcessGroup (own session, stopped as a group) so a Ctrl-C or a timeout leaves no vLLM engine
core or worker behind; its output goes to a log file, whose tail is in the error if it fails.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tokenflow_ray.lab.peer.vllm_env import PeerError, ensure_vllm_env
from tokenflow_ray.lab.peer.vllm_server import ProcessGroup, clean_env

SCRIPT = Path(__file__).with_name("vllm_offline.py")


def run_vllm_offline(model_dir: Path, batches: dict[int, Sequence[Sequence[int]]], new_tokens: int, repeats: int, *,
                     mixed: tuple[Sequence[Sequence[int]], Sequence[int]] | None = None, threads: int,
                     max_num_batched_tokens: int, dtype: str = "float32", max_model_len: int = 1024,
                     env_dir: Path | str | None = None, log_path: Path | str | None = None,
                     timeout_s: float = 3600.0) -> dict:
    """vLLM's decode tok/s per batch ({batch: {"vllm_tok_s": ...}}) and, with `mixed`, "mixed_vllm_tok_s"."""
    python = ensure_vllm_env(env_dir)
    max_seqs = max([len(p) for p in batches.values()] + ([len(mixed[0])] if mixed else []))
    spec = {"model": str(model_dir), "dtype": dtype, "max_model_len": max_model_len, "max_num_seqs": max_seqs,
            "max_num_batched_tokens": max_num_batched_tokens, "new_tokens": new_tokens, "repeats": repeats,
            "batches": {str(b): [list(map(int, p)) for p in prompts] for b, prompts in batches.items()},
            "mixed": {"prompts": [list(map(int, p)) for p in mixed[0]], "lengths": list(map(int, mixed[1]))}
            if mixed else None}
    with tempfile.TemporaryDirectory(prefix="tokenflow-vllm-offline-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        log_path = Path(log_path) if log_path else Path(tempfile.gettempdir()) / "tokenflow-vllm-offline.log"
        group = ProcessGroup([str(python), str(SCRIPT), "--json-in", str(spec_path), "--json-out", str(out_path)],
                             log_path=log_path, env=clean_env(threads))
        with group:
            try:
                rc = group.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise PeerError(f"vLLM offline bench: no result after {timeout_s:.0f} s (log: {log_path})") from None
            if rc != 0 or not out_path.exists():
                raise PeerError(f"vLLM offline bench exited with code {rc} (log: {log_path}): {group.log_tail()}")
        out = json.loads(out_path.read_text())
    out["results"] = {int(b): row for b, row in out["results"].items()}
    out["threads"] = threads
    return out
