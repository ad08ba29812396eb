"""The LLMServer replica (server.py) and its parts: token path, central link, stats, migration, stopping."""
