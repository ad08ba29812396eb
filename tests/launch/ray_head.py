"""What the tests that start their own `ray start --head --block` add to its environment."""

# On SIGTERM the head first asks the GCS to drain its node, for up to RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S (30 s).
# The tests stop the head by signalling its whole process group, the GCS with it, so the request waited out all
# 30 s at every teardown (33.7 s to exit against 3.5 s with the drain off).
HEAD_ENV = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
