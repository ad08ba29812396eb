"""`ray job submit --working-dir . -- python jobs/serve.py [--config serve.yaml] [...]`: deploy the Serve app.

A thin entrypoint over `tokenflow serve`: it joins the job's cluster (RAY_ADDRESS is set by the job runtime).
"""

import sys

from tokenflow_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
