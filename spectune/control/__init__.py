"""The return half of the loop: tuner or operator -> ``PolicyService`` -> engine.

``service.PolicyService``: the one write path (validation, versions and audit, change feed).
``embedded.EmbeddedControl``: the in-process engine's subscriber.
``follower.PolicyFollower``: a remote engine's poll of the control plane.
"""

from .embedded import EmbeddedControl, initial_policy, rebuilt_config
from .follower import PolicyFollower
from .service import PolicyService, PolicySubscriber

__all__ = ["EmbeddedControl", "PolicyFollower", "PolicyService", "PolicySubscriber", "initial_policy", "rebuilt_config"]
