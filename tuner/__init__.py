"""The control plane's decisions: policies now, the goodput tuner next."""
