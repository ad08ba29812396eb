"""The Serve app's HTTP front: routes, request and response bodies, errors, image routes, /metrics, proxy guard."""
