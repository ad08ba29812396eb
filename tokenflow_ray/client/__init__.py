"""A pacing streaming client for the OpenAI-compatible app, and a bounded loopback load generator built on it."""

from tokenflow_ray.client.load import LoadResult, run_load
from tokenflow_ray.client.stream import PacedStreamClient, StreamResult, StreamSpec

__all__ = ["LoadResult", "PacedStreamClient", "StreamResult", "StreamSpec", "run_load"]
