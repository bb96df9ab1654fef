"""kvfence as a Ray Serve application: `serve run kvfence.ray:app` (or a Serve config naming
`kvfence.ray:app`, deploy/ray/serve.yaml) and `kvfence serve --ray-replicas N` (kvfence.ray.local).

Contract: importing this package imports no Ray and no torch: Ray loads when `app` builds an application
(kvfence.ray.app), torch only inside a replica as it loads its engine (kvfence.ray.replica).
"""

from kvfence.ray.app import app

__all__ = ["app"]
