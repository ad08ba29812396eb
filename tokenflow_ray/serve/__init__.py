"""The Ray Serve app, cut by role (each importing only the ones before it):

- control/: the control plane: the central actor (the cluster's live-stream table, migration orders, the app's
  clean stop), the buffer-slack request router and the autoscaling policy (their decisions: cluster/);
- http/: the HTTP front: the OpenAI-compatible routes (ingress.py, in either placement), request models, errors and
  response bodies, the image routes, /metrics, the proxy guard, and the stream port a moved stream is followed by;
- replica/: the LLMServer replica around one engine: its token path, central link, stats, migration, stopping,
  admission and delta grouping;
- and here: the app's config (config.py), its assembly (app.py), `tokenflow serve` (cli.py, preflight.py,
  lifecycle.py) and the local Ray session (local.py).

The messages between these processes are cluster/messages.py.
"""
