"""The Serve app's control plane: the central actor, the request router and the autoscaling policy."""
