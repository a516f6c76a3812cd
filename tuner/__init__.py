"""The control plane's decisions: the policy model, the goodput tuner and draft diagnosis."""
